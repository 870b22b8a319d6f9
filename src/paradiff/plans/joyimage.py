"""JoyImage Edit (`JoyImageEditTransformer3DModel`): dual-stream joint attention [image, text] with packed QKV and
Wan-style modulation tables."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import PackedColwise
from paradiff.plans.common import feed_forward, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, Noise, Uniform

MODEL_CLASSES = ("JoyImageEditTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    # Q, K and V share one projection per stream, each third split on its own; the QK-norms are per head
    return TensorParallelPlan(styles={
        **{f"double_blocks.*.attn.{s}_attn_qkv": PackedColwise([1, 1, 1]) for s in ("img", "txt")},
        **{f"double_blocks.*.attn.{s}_attn_proj": "rowwise" for s in ("img", "txt")},
        **feed_forward("double_blocks.*.img_mlp"),
        **feed_forward("double_blocks.*.txt_mlp"),
        **mlp("condition_embedder.time_embedder"),
        "condition_embedder.time_proj": "rowwise_split_input",
        **mlp("condition_embedder.text_embedder"),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    # image and text attend jointly, both split; the rotary argument is (image tables, text tables or None)
    return ContextParallelPlan(
        split_inputs={
            "double_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)},
            "double_blocks.*": {"image_rotary_emb": Split(0)},
        },
        gather_outputs={"proj_out": 1},
    )


_BASE = dict(patch_size=[1, 2, 2], in_channels=4, hidden_size=64, num_attention_heads=4, text_dim=32, num_layers=2,
             rope_dim_list=[4, 6, 6])
EXAMPLES = {
    # edit: the target and a reference image as two items of one input
    "joyimage-edit": ("JoyImageEditTransformer3DModel", _BASE),
    # rotary positions for the text too
    "joyimage-edit-mrope": ("JoyImageEditTransformer3DModel", {**_BASE, "rope_type": "mrope"}),
}


_TEXT = dict(timestep=Uniform(1000), encoder_hidden_states=Noise(("batch", "text", "text_dim")), return_dict=False)
INPUTS = ByExample({
    # two one-frame items (the target, a reference image) per sample
    "joyimage-edit": dict(hidden_states=Noise(("batch", 2, "in_channels", 1, "height * patch_size[1]",
                                               "width * patch_size[2]")), **_TEXT),
    "joyimage-edit-mrope": dict(hidden_states=Noise(("batch", "in_channels", "frames", "height * patch_size[1]",
                                                     "width * patch_size[2]")), **_TEXT),
})


FAMILY = Family.of(__name__)
