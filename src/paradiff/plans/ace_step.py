"""ACE-Step 1.5 (`AceStepTransformer1DModel`): a 1-D music DiT with grouped-query attention, alternating
sliding-window and full self-attention, and cross-attention to the condition encoder's tokens."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import ColwiseHeads
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Uniform

MODEL_CLASSES = ("AceStepTransformer1DModel",)


def _attention(prefix: str, config) -> dict:
    # K/V have num_key_value_heads heads: split by whole heads, replicated in rank groups beyond their count
    return {f"{prefix}.to_q": "colwise", f"{prefix}.to_k": ColwiseHeads(config.head_dim),
            f"{prefix}.to_v": ColwiseHeads(config.head_dim), f"{prefix}.to_out.0": "rowwise"}


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {**_attention("layers.*.self_attn", config), **_attention("layers.*.cross_attn", config),
              "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
              "layers.*.mlp.down_proj": "rowwise", "condition_embedder": "rowwise_split_input"}
    for embedder in ("time_embed", "time_embed_r"):
        styles.update({f"{embedder}.linear_1": "colwise", f"{embedder}.linear_2": "rowwise",
                       f"{embedder}.time_proj": "rowwise_split_input"})
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    # The banded sliding-window mask covers the whole sequence and stays whole (CP attention takes its rows);
    # the rotary table is split with the tokens; the de-patchifying transposed conv is per token.
    return ContextParallelPlan(
        split_inputs={"layers.0": {"hidden_states": Split(1)}},
        split_token_arguments={"layers.*": ("position_embeddings",)},
        gather_outputs={"proj_out_conv": 2},
        local_attention=("layers.*.cross_attn",),
    )


EXAMPLES = {"ace-step-1.5": ("AceStepTransformer1DModel", dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, in_channels=24, audio_acoustic_hidden_dim=8, patch_size=2, sliding_window=4))}

# two K/V heads at tp=4: each pair of ranks holds one, replicated
EXTRA_MODES = {"ace-step-1.5": ("tp4",)}


INPUTS = dict(
    # 2 * height * width - 1 frames: padded to 30 and patchified to 15 tokens
    hidden_states=Noise(("batch", "2 * height * width - 1", "audio_acoustic_hidden_dim")),
    timestep=Uniform(),
    timestep_r=Uniform(),
    encoder_hidden_states=Noise(("batch", "text", "hidden_size")),
    context_latents=Noise(("batch", "2 * height * width - 1", "in_channels - audio_acoustic_hidden_dim")),
    return_dict=False,
)


FAMILY = Family.of(__name__)
