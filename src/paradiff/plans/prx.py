"""PRX (`PRXTransformer2DModel`): how it splits under tensor and context parallelism.

Only the image tokens run through the blocks; each attention's queries are the image tokens and its keys the
(unchanged) text tokens followed by the image tokens. Under context parallelism both are split, so every rank holds
a part of the keys of each stream; Ulysses exchanges queries and keys by their own lengths.
"""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import PackedColwise
from paradiff.plans.common import mlp, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import image_inputs, text_mask

MODEL_CLASSES = ("PRXTransformer2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        "blocks.*.attention.img_qkv_proj": PackedColwise([1, 1, 1]),
        "blocks.*.attention.txt_kv_proj": PackedColwise([1, 1]),
        "blocks.*.attention.to_out.0": "rowwise",
        "blocks.*.gate_proj": "colwise",
        "blocks.*.up_proj": "colwise",
        "blocks.*.down_proj": "rowwise",
        **split_input("blocks.*.modulation.lin", "txt_in", "final_layer.adaLN_modulation.1"),
        **mlp("time_in", "in_layer", "out_layer"),
    }
    if config.resolution_embeds:
        styles.update(mlp("resolution_embedder.mlp", "in_layer", "out_layer"))
    return TensorParallelPlan(styles=styles, heads_config_key="num_heads")


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={
            "blocks.0": {"hidden_states": Split(1)},
            # the text, its mask and the image rotary table come whole to every block
            "blocks.*": {"encoder_hidden_states": Split(1), "attention_mask": Split(1), "image_rotary_emb": Split(2)},
        },
        gather_outputs={"final_layer": 1},
    )


EXAMPLES = {
    "prx": ("PRXTransformer2DModel", dict(
        in_channels=4, patch_size=2, context_in_dim=32, hidden_size=64, mlp_ratio=3.5, num_heads=4, depth=2,
        axes_dim=[8, 8])),
    "prx-7b": ("PRXTransformer2DModel", dict(  # pixel-space variant: bottleneck patch embedding, resolution embedding
        in_channels=4, patch_size=2, context_in_dim=32, hidden_size=64, mlp_ratio=3.5, num_heads=4, depth=2,
        axes_dim=[8, 8], bottleneck_size=24, resolution_embeds=True)),
}


# the last prompt is padded
INPUTS = {**image_inputs("context_in_dim", flow=True), "attention_mask": text_mask(keep="text - 3")}


FAMILY = Family.of(__name__)
