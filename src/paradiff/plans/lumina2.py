"""Lumina-Image 2.0 (`Lumina2Transformer2DModel`): how it splits under tensor and context parallelism.

Grouped-query attention: K/V have fewer heads than Q. `ColwiseHeads` splits them by whole heads up to their count
and, beyond it, gives each group of tp / kv_heads ranks one K/V head (the one its Q heads use); the processor derives
its repeat factor from the local shapes, so it stays right.
"""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import ColwiseHeads
from paradiff.plans.common import split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import image_inputs, text_mask

MODEL_CLASSES = ("Lumina2Transformer2DModel",)
STACKS = ("noise_refiner", "context_refiner", "layers")


def _head_dim(config) -> int:
    return config.hidden_size // config.num_attention_heads


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {}
    for stack in STACKS:
        styles.update({
            f"{stack}.*.attn.to_q": "colwise",
            f"{stack}.*.attn.to_k": ColwiseHeads(_head_dim),
            f"{stack}.*.attn.to_v": ColwiseHeads(_head_dim),
            f"{stack}.*.attn.to_out.0": "rowwise",
            # LuminaFeedForward: linear_2(silu(linear_1(x)) * linear_3(x))
            f"{stack}.*.feed_forward.linear_1": "colwise",
            f"{stack}.*.feed_forward.linear_3": "colwise",
            f"{stack}.*.feed_forward.linear_2": "rowwise",
        })
    for stack in ("noise_refiner", "layers"):  # the context refiner has no modulation
        styles[f"{stack}.*.norm1.linear"] = "rowwise_split_input"
    styles.update({
        "time_caption_embed.timestep_embedder.linear_1": "colwise",
        "time_caption_embed.timestep_embedder.linear_2": "rowwise",
        **split_input("time_caption_embed.caption_embedder.1", "norm_out.linear_1"),
    })
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    # Three sequences: the text (context refiner), the image (noise refiner) and, after the model joins them sample
    # by sample, the joint one (main layers). Each is split at its stack's first block with its rotary table (and
    # key mask) at every block, and gathered after the refiners, where the model joins them on the full sequences.
    stacks = STACKS if config.num_refiner_layers else ("layers",)
    split_inputs, gather_outputs = {}, {"norm_out": 1}
    for stack in stacks:
        split_inputs[f"{stack}.0"] = {"hidden_states": Split(1)}
        split_inputs[f"{stack}.*"] = {"attention_mask": Split(1), "image_rotary_emb": Split(1)}
    for stack in stacks[:-1]:
        gather_outputs[f"{stack}.{config.num_refiner_layers - 1}"] = 1
    return ContextParallelPlan(split_inputs=split_inputs, gather_outputs=gather_outputs)


EXAMPLES = {
    # 4 query heads, 2 K/V heads: tp2 splits both, tp4 replicates each K/V head on two ranks
    "lumina2": ("Lumina2Transformer2DModel", dict(
        sample_size=16, patch_size=2, in_channels=4, hidden_size=64, num_layers=2, num_refiner_layers=1,
        num_attention_heads=4, num_kv_heads=2, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(32, 32, 32),
        cap_feat_dim=32)),
}
EXTRA_MODES = {"lumina2": ("tp4",)}


# the last caption is padded
INPUTS = {**image_inputs("cap_feat_dim", flow=True), "encoder_attention_mask": text_mask(keep="text - 3")}


FAMILY = Family.of(__name__)
