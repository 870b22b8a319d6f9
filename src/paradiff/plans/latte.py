"""Latte (`LatteTransformer3DModel`): spatial blocks attend within each frame, temporal blocks within each location."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, adaln_single, attention, basic_transformer_block, feed_forward, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Uniform

MODEL_CLASSES = ("LatteTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    gated = config.activation_fn in ("geglu", "geglu-approximate", "swiglu")
    return TensorParallelPlan(styles={
        **basic_transformer_block("transformer_blocks.*", gated=gated),
        **attention("temporal_transformer_blocks.*.attn1"),
        **feed_forward("temporal_transformer_blocks.*.ff", gated=gated),
        **adaln_single(),
        **mlp("caption_projection"),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    # Each rank keeps a share of every frame's patches (the spatial sequence). Spatial self-attention spans the
    # ranks; temporal attention runs over the frames of one patch location, all of them local: no communication.
    # The temporal blocks' timesteps are rows of (batch x locations), split per sample.
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1)},
            "temporal_transformer_blocks.*": {"timestep": Split(0, within="hidden_states")},
        },
        gather_outputs={"proj_out": 1},
        local_attention=("transformer_blocks.*.attn2", "temporal_transformer_blocks.*.attn1"),
    )


EXAMPLES = {
    "latte-1": ("LatteTransformer3DModel", dict(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=64, sample_size=8, patch_size=2, norm_type="ada_norm_single", caption_channels=32,
        video_length=Grid().frames)),
}


# the pipeline passes no text mask (the model's own mask path only fits single-frame input)
INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "frames", "height * patch_size", "width * patch_size")),
    timestep=Uniform(1000),
    encoder_hidden_states=Noise(("batch", "text", "caption_channels")),
    return_dict=False,
)


FAMILY = Family.of(__name__)
