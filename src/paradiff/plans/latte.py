"""Latte (`LatteTransformer3DModel`): spatial blocks attend within each frame, temporal blocks within each location."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, adaln_single, attention, basic_transformer_block, feed_forward, mlp
from paradiff.plans.family import Family

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


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    # the pipeline passes no text mask (the model's own mask path only fits single-frame input)
    p = config.patch_size
    return dict(
        hidden_states=torch.randn(batch, config.in_channels, grid.frames, grid.height * p, grid.width * p,
                                  generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, grid.text, config.caption_channels, generator=generator),
        return_dict=False,
    )


FAMILY = Family.of(__name__)
