"""Allegro (`AllegroTransformer3DModel`): PixArt-style blocks over video tokens."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, adaln_single, basic_transformer_block, mlp
from paradiff.plans.family import Family

MODEL_CLASSES = ("AllegroTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={
        **basic_transformer_block("transformer_blocks.*"),
        **adaln_single(),
        **mlp("caption_projection"),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    # The rotary argument is ((per-axis tables), (t, h, w positions of every token, each (1, tokens))): the tables
    # are looked up by position and stay whole; the positions follow the video tokens.
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1)},
            "": {"image_rotary_emb": {1: Split(-1)}},
        },
        gather_outputs={"proj_out": 1},
        # attn2 attends to the replicated text
        local_attention=("transformer_blocks.*.attn2",),
    )


EXAMPLES = {
    # head_dim 24: the rotary splits each head in three (t, h, w) parts of even size
    "allegro": ("AllegroTransformer3DModel", dict(
        patch_size=2, patch_size_t=1, num_attention_heads=4, attention_head_dim=24, in_channels=4, out_channels=4,
        num_layers=2, cross_attention_dim=96, sample_height=6, sample_width=10, sample_frames=3, caption_channels=32)),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro

    p = config.patch_size
    tables_and_axes = get_3d_rotary_pos_embed_allegro(
        config.attention_head_dim, ((0, 0), (grid.height, grid.width)), (grid.height, grid.width), grid.frames,
        interpolation_scale=(config.interpolation_scale_t, config.interpolation_scale_h, config.interpolation_scale_w))
    axes = [axis.to(torch.long) for axis in tables_and_axes[3:]]
    positions = torch.cartesian_prod(*axes).transpose(0, 1).reshape(3, 1, -1)  # as the pipeline lays them out
    mask = torch.ones(batch, grid.text)
    mask[-1, grid.text // 2:] = 0  # the last prompt is shorter
    return dict(
        hidden_states=torch.randn(batch, config.in_channels, grid.frames, grid.height * p, grid.width * p,
                                  generator=generator),
        encoder_hidden_states=torch.randn(batch, grid.text, config.caption_channels, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_attention_mask=mask,
        image_rotary_emb=(tables_and_axes[:3], tuple(positions)),
        return_dict=False,
    )


FAMILY = Family.of(__name__)
