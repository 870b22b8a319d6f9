"""MiniMax-H3 (`MiniMaxH3Transformer3DModel`): one packed sequence of text, video and audio rows, full
self-attention, AdaLN parameters picked per row from a (timestep, modality) table; a text token refiner before."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, attention, feed_forward, mlp, split_input
from paradiff.plans.family import Family

MODEL_CLASSES = ("MiniMaxH3Transformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    # heads x head_dim is wider than the residual stream here; QK-norms are per head
    return TensorParallelPlan(styles={
        **attention("transformer_blocks.*.attn"),
        **feed_forward("transformer_blocks.*.ff", gated=True),
        **split_input("transformer_blocks.*.adaln_proj.linear", "context_embedder", "norm_out.linear"),
        **attention("token_refiner.refiner_blocks.*.attn"),
        **feed_forward("token_refiner.refiner_blocks.*.ff", gated=True),
        **mlp("time_embedder"),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    # The packed sequence is split at the first block with its per-row tables (AdaLN row index, rotary angles,
    # timestep index at the output norm); both output heads are gathered before the model picks their rows. The
    # text refiner runs on the whole, replicated text before packing: its attention stays local.
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1)},
            "transformer_blocks.*": {"adaln_indices": Split(0)},
            "norm_out": {"timestep_indices": Split(0)},
        },
        split_outputs={"rope": {0: Split(0), 1: Split(0)}},
        gather_outputs={"proj_out": 1, "audio_proj_out": 1},
        local_attention=("token_refiner.refiner_blocks.*.attn",),
    )


EXAMPLES = {
    "minimax-h3": ("MiniMaxH3Transformer3DModel", dict(
        num_attention_heads=4, attention_head_dim=16, hidden_size=48, num_layers=2, num_refiner_layers=1,
        ffn_dim=96, in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=32, freq_dim=32,
        time_embed_hidden_dim=32, time_embed_dim=24, rope_freq_dim=2)),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    # packed as [text, video (first frame a clean condition), audio]
    video, audio, text = grid.frames * grid.height * grid.width, 6, grid.text
    frame = grid.height * grid.width
    t, h, w = torch.meshgrid(torch.arange(grid.frames), torch.arange(grid.height), torch.arange(grid.width),
                             indexing="ij")
    video_positions = torch.stack([t, h, w], dim=-1).view(-1, 3) + torch.tensor([1, 0, 0])
    text_positions = torch.zeros(text, 3, dtype=torch.long)
    audio_positions = torch.stack([torch.arange(audio) + 1, torch.zeros(audio, dtype=torch.long),
                                   torch.zeros(audio, dtype=torch.long)], dim=-1)
    timestep_indices = torch.cat([torch.zeros(text + frame, dtype=torch.long),
                                  torch.ones(video - frame + audio, dtype=torch.long)])
    patch = config.in_channels * 4
    return dict(
        hidden_states=torch.randn(batch, video, patch, generator=generator),
        audio_hidden_states=torch.randn(batch, audio, config.audio_in_channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, text, config.text_dim, generator=generator),
        timestep=torch.tensor([0.0, 0.7]),
        timestep_indices=timestep_indices,
        token_tags=torch.cat([torch.ones(text), torch.zeros(video), torch.full((audio,), 2)]).long(),
        position_ids=torch.cat([text_positions, video_positions, audio_positions]),
        text_indices=torch.arange(text),
        video_indices=torch.arange(text, text + video),
        audio_indices=torch.arange(text + video, text + video + audio),
        return_dict=False,
    )


FAMILY = Family.of(__name__)
