"""Stable Audio Open (`StableAudioDiTModel`): a 1-D audio DiT with one global token prepended to the audio,
self-attention with partial rotary embeddings, and cross-attention to the text with grouped K/V heads."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import ColwiseHeads
from paradiff.plans.common import Grid, attention, feed_forward, mlp
from paradiff.plans.family import Family

MODEL_CLASSES = ("StableAudioDiTModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    head_dim = config.attention_head_dim
    return TensorParallelPlan(styles={
        **attention("transformer_blocks.*.attn1"),
        # the processor reads the K/V head count from the projection's width: it follows ColwiseHeads' slice
        "transformer_blocks.*.attn2.to_q": "colwise",
        "transformer_blocks.*.attn2.to_k": ColwiseHeads(head_dim),
        "transformer_blocks.*.attn2.to_v": ColwiseHeads(head_dim),
        "transformer_blocks.*.attn2.to_out.0": "rowwise",
        **feed_forward("transformer_blocks.*.ff", gated=True),
        **mlp("timestep_proj", "0", "2"),
        **mlp("global_proj", "0", "2"),
        **mlp("cross_attention_proj", "0", "2"),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    # [global token, audio] is assembled inside the model: split at the first block with its key mask and rotary
    # table (both cover the joint sequence), gathered at the output projection, before the global token is dropped.
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1)},
            "transformer_blocks.*": {"attention_mask": Split(1), "rotary_embedding": Split(0)},
        },
        gather_outputs={"proj_out": 1},
        local_attention=("transformer_blocks.*.attn2",),
    )


EXAMPLES = {"stable-audio-open": ("StableAudioDiTModel", dict(
    in_channels=8, num_layers=2, attention_head_dim=16, num_attention_heads=4, num_key_value_attention_heads=2,
    out_channels=8, cross_attention_dim=32, time_proj_dim=32, global_states_input_dim=24,
    cross_attention_input_dim=24))}
EXTRA_MODES = {"stable-audio-open": ("tp4",)}  # 2 K/V heads over 4 ranks: replicated in pairs


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    length = 2 * grid.height * grid.width  # + the global token: 31
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[-1, -3:] = False  # the last clip is padded: exercises the self-attention key mask
    text_mask = torch.ones(batch, grid.text, dtype=torch.bool)
    text_mask[-1, -2:] = False
    # the pipeline's table: rotary on the first half of each head's features
    rotary = get_1d_rotary_pos_embed(config.attention_head_dim // 2, length + 1, use_real=True,
                                     repeat_interleave_real=False)
    return dict(
        hidden_states=torch.randn(batch, config.in_channels, length, generator=generator),
        timestep=torch.rand(batch, generator=generator),
        encoder_hidden_states=torch.randn(batch, grid.text, config.cross_attention_input_dim, generator=generator),
        global_hidden_states=torch.randn(batch, 1, config.global_states_input_dim, generator=generator),
        rotary_embedding=rotary,
        attention_mask=mask,
        encoder_attention_mask=text_mask,
        return_dict=False,
    )


FAMILY = Family.of(__name__)
