"""Helios (`HeliosTransformer3DModel`): Wan-style blocks over [long, mid and short history tokens, current tokens];
the blocks find the current window by its length (`original_context_length`), cross-attend only from it, and may
amplify the history keys per head."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Count, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import SplitParameter
from paradiff.plans import wan
from paradiff.plans.common import Grid
from paradiff.plans.family import Family

MODEL_CLASSES = ("HeliosTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {**wan.block_styles("blocks.*", config), **wan.condition_styles("condition_embedder")}
    if config.is_amplify_history and config.history_scale_mode == "per_head":
        styles["blocks.*.attn1.history_key_scale"] = SplitParameter(0)
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={
            "blocks.0": {"hidden_states": Split(1)},
            # per-token modulation and rotary table of [history, current]; the current window is the sequence's
            # tail, so each rank gets the part of it its chunk holds (its history tokens come first)
            "blocks.*": {"temb": Split(1, ndim=4), "rotary_emb": Split(1),
                         "original_context_length": Count("hidden_states", tail=True)},
        },
        # the output norm keeps the last `original_context_length` tokens: the sequence is whole by then
        gather_outputs={f"blocks.{config.num_layers - 1}": 1},
        local_attention=("blocks.*.attn2",),
    )


EXAMPLES = {
    "helios": ("HeliosTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_dim=(4, 6, 6), is_amplify_history=True)),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    p_t, p_h, p_w = config.patch_size

    def latents(frames: int) -> torch.Tensor:
        return torch.randn(batch, config.in_channels, frames * p_t, grid.height * p_h, grid.width * p_w,
                           generator=generator)

    def indices(start: int, frames: int) -> torch.Tensor:
        return torch.arange(start, start + frames).unsqueeze(0).expand(batch, -1)

    # history: 4 frames at 4x compression, 2 at 2x, 2 at full size; 2 + 6 + 30 history and 45 current tokens
    return dict(
        hidden_states=latents(grid.frames),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, grid.text, config.text_dim, generator=generator),
        indices_hidden_states=indices(8, grid.frames),
        latents_history_long=latents(4), indices_latents_history_long=indices(0, 4),
        latents_history_mid=latents(2), indices_latents_history_mid=indices(4, 2),
        latents_history_short=latents(2), indices_latents_history_short=indices(6, 2),
        return_dict=False,
    )


FAMILY = Family.of(__name__)
