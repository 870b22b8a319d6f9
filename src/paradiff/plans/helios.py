"""Helios (`HeliosTransformer3DModel`): Wan-style blocks over [long, mid and short history tokens, current tokens];
the blocks find the current window by its length (`original_context_length`), cross-attend only from it, and may
amplify the history keys per head."""

from paradiff.context_parallel.plan import ContextParallelPlan, Count, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import SplitParameter
from paradiff.plans import wan
from paradiff.plans.family import Family
from paradiff.plans.inputs import Arange, Dim, Noise, Uniform

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


def _latents(frames: Dim) -> Noise:
    return Noise(("batch", "in_channels", f"({frames}) * patch_size[0]", "height * patch_size[1]",
                  "width * patch_size[2]"))


def _indices(start: int, frames: Dim) -> Arange:
    return Arange(f"{start} + {frames}", start=start, per_sample=True)


# history: 4 frames at 4x compression, 2 at 2x, 2 at full size; 2 + 6 + 30 history and 45 current tokens
INPUTS = dict(
    hidden_states=_latents("frames"),
    timestep=Uniform(1000),
    encoder_hidden_states=Noise(("batch", "text", "text_dim")),
    indices_hidden_states=_indices(8, "frames"),
    latents_history_long=_latents(4), indices_latents_history_long=_indices(0, 4),
    latents_history_mid=_latents(2), indices_latents_history_mid=_indices(4, 2),
    latents_history_short=_latents(2), indices_latents_history_short=_indices(6, 2),
    return_dict=False,
)


FAMILY = Family.of(__name__)
