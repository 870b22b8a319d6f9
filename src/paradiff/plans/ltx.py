"""LTX-Video (`LTXVideoTransformer3DModel`): self-attention with QK-norm over all heads and a rotary table over the
whole inner dimension (applied before the heads are split), cross-attention to the masked text; per-token
timesteps for conditioning frames (0.9.5+)."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, attention, feed_forward, mlp
from paradiff.plans.family import Family

MODEL_CLASSES = ("LTXVideoTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(
        styles={
            **attention("transformer_blocks.*.attn1", norms_across_heads=("norm_q", "norm_k")),
            **attention("transformer_blocks.*.attn2", norms_across_heads=("norm_q", "norm_k")),
            **feed_forward("transformer_blocks.*.ff"),
            **mlp("time_embed.emb.timestep_embedder"),
            "time_embed.linear": "rowwise_split_input",
            **mlp("caption_projection"),
        },
        # (cos, sin) span the inner dimension, so each rank keeps its heads' channels
        head_outputs={"rope": {0: -1, 1: -1}},
    )


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        # tokens come patchified; per-token timesteps come as (batch, tokens), or (batch, tokens, 1) from the long
        # multi-prompt pipeline
        split_inputs={"": {"hidden_states": Split(1), "timestep": Split(1, ndim=(2, 3))}},
        split_outputs={"rope": {0: Split(1), 1: Split(1)}},
        gather_outputs={"proj_out": 1},
        local_attention=("transformer_blocks.*.attn2",),
    )


_CONFIG = dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=12, cross_attention_dim=48,
               num_layers=2, caption_channels=32)
EXAMPLES = {
    "ltx-video": ("LTXVideoTransformer3DModel", _CONFIG),
    # 0.9.5+: per-token timesteps (clean conditioning frame) and explicit rotary coordinates
    "ltx-video-0.9.5": ("LTXVideoTransformer3DModel", _CONFIG),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    tokens = grid.frames * grid.height * grid.width
    text_mask = torch.ones(batch, grid.text, dtype=torch.int64)
    text_mask[-1, -3:] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, tokens, config.in_channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, grid.text, config.caption_channels, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_attention_mask=text_mask,
        num_frames=grid.frames, height=grid.height, width=grid.width,
        rope_interpolation_scale=(0.32, 32, 32),
        return_dict=False,
    )
    if name == "ltx-video-0.9.5":
        timestep = inputs["timestep"][:, None].repeat(1, tokens)
        timestep[:, : grid.height * grid.width] = 0  # the first frame conditions, fully denoised
        frames, rows, cols = torch.meshgrid(torch.arange(grid.frames), torch.arange(grid.height),
                                            torch.arange(grid.width), indexing="ij")
        coords = torch.stack([frames * 8 * 0.04, rows * 32.0, cols * 32.0]).flatten(1)  # (3, tokens), pixel units
        inputs.update(timestep=timestep, video_coords=coords[None].repeat(batch, 1, 1), rope_interpolation_scale=None)
    return inputs


FAMILY = Family.of(__name__)
