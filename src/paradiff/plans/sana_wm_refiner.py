"""SANA-WM stage-2 refiner (`SanaWMLTX2RefinerTransformer3DModel`): LTX-2's video blocks (the audio modules are built
but never run) over one block of frames, with per-token timesteps and the rotary tables given as an input. The
forward without a KV cache is split both ways; the sliding-window cache (sink + history keys kept per rank) is
refused under context parallelism."""

from types import SimpleNamespace

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import ltx2
from paradiff.plans.common import Grid
from paradiff.plans.family import Family

MODEL_CLASSES = ("SanaWMLTX2RefinerTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    plan = ltx2.tensor_parallel_plan(config)
    head_dim = -1 if config.rope_type == "interleaved" else 1
    # the model builds no rotary table itself: each rank keeps its heads' part of the one it is given
    return TensorParallelPlan(styles=plan.styles, head_inputs={"": {"video_rotary_emb": {0: head_dim, 1: head_dim}}})


def context_parallel_plan(config) -> ContextParallelPlan:
    token_dim = 1 if config.rope_type == "interleaved" else 2  # (batch, tokens, dim) or (batch, heads, tokens, dim)
    return ContextParallelPlan(
        split_inputs={"": {"hidden_states": Split(1), "timestep": Split(1),
                           "video_rotary_emb": {0: Split(token_dim), 1: Split(token_dim)}}},
        gather_outputs={"proj_out": 1},
        local_attention=("transformer_blocks.*.attn2",),
        unsupported_inputs={"": {"kv_cache": (
            "the sliding-window cache keeps the keys of the tokens a rank holds, and the sink's keys are re-rotated "
            "whole; run the cached refinement without context parallelism")}},
    )


_BASE = dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
             audio_in_channels=6, audio_out_channels=6, audio_num_attention_heads=4, audio_attention_head_dim=8,
             audio_cross_attention_dim=32, num_layers=2, caption_channels=24)
EXAMPLES = {
    "sana-wm-refiner": ("SanaWMLTX2RefinerTransformer3DModel", _BASE),
    "sana-wm-refiner-split-rope": ("SanaWMLTX2RefinerTransformer3DModel", {**_BASE, "rope_type": "split",
                                                                           "gated_attn": True}),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    from diffusers import SanaWMLTX2RefinerTransformer3DModel as Model
    from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMLTX2AudioVideoRotaryPosEmbed

    rope = SanaWMLTX2AudioVideoRotaryPosEmbed(
        dim=config.num_attention_heads * config.attention_head_dim, patch_size=config.patch_size,
        patch_size_t=config.patch_size_t, base_num_frames=config.pos_embed_max_pos, base_height=config.base_height,
        base_width=config.base_width, scale_factors=config.vae_scale_factors, theta=config.rope_theta,
        causal_offset=config.causal_offset, modality="video", double_precision=config.rope_double_precision,
        rope_type=config.rope_type, num_attention_heads=config.num_attention_heads)
    # absolute frame positions of a later window (frames 4-6 of the source video)
    tables = Model.build_rotary_emb_for_absolute_positions(SimpleNamespace(rope=rope), batch, [4, 5, 6], grid.height,
                                                           grid.width, torch.device("cpu"), fps=24.0)
    tokens = grid.frames * grid.height * grid.width
    timestep = torch.rand(batch, 1, generator=generator).repeat(1, tokens)
    timestep[:, : grid.height * grid.width] = 0  # the first frame is clean
    text_mask = torch.ones(batch, grid.text, dtype=torch.int64)
    text_mask[-1, -3:] = 0
    return dict(
        hidden_states=torch.randn(batch, tokens, config.in_channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, grid.text, config.caption_channels, generator=generator),
        timestep=timestep * 1000, video_rotary_emb=tables, encoder_attention_mask=text_mask, return_dict=False,
    )


FAMILY = Family.of(__name__)
