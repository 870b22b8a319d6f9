"""Cosmos3 Omni (`Cosmos3OmniTransformer`): a packed sequence (no batch axis) of a causal text prefix ("und") and
generation tokens (vision, sound, action; "gen") through mixture-of-transformers layers with grouped K/V heads."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import DEFAULT_HEAD_ATTRS, TensorParallelPlan
from paradiff.tensor_parallel.styles import ColwiseHeads
from paradiff.plans.common import Grid, mlp
from paradiff.plans.family import Family

MODEL_CLASSES = ("Cosmos3OmniTransformer",)


def _mlp(prefix: str, gated: bool) -> dict:
    styles = {f"{prefix}.up_proj": "colwise", f"{prefix}.down_proj": "rowwise"}
    if gated:
        styles[f"{prefix}.gate_proj"] = "colwise"
    return styles


def tensor_parallel_plan(config) -> TensorParallelPlan:
    # one attention holds both streams' projections; K/V have fewer (grouped) heads; QK-norms are per head
    kv = ColwiseHeads(lambda c: c.head_dim)
    gated = config.hidden_act == "silu"
    styles = {
        **{f"layers.*.self_attn.{name}": "colwise" for name in ("to_q", "add_q_proj")},
        **{f"layers.*.self_attn.{name}": kv for name in ("to_k", "to_v", "add_k_proj", "add_v_proj")},
        **{f"layers.*.self_attn.{name}": "rowwise" for name in ("to_out", "to_add_out")},
        **_mlp("layers.*.mlp", gated),
        **_mlp("layers.*.mlp_moe_gen", gated),
        **mlp("time_embedder"),
    }
    return TensorParallelPlan(styles=styles,
                              head_attrs=DEFAULT_HEAD_ATTRS + ("num_attention_heads", "num_key_value_heads"))


def context_parallel_plan(config) -> ContextParallelPlan:
    # The generation tokens are split; the short causal text prefix stays whole on every rank (its causal
    # attention is computed whole, the generation tokens attend to it locally and to each other across the ranks).
    # The split generation stream is gathered after the stack's last norm, before the model picks its rows.
    return ContextParallelPlan(
        split_inputs={
            "layers.0": {"gen_seq": Split(0)},
            "layers.*": {"rotary_emb": {2: Split(0), 3: Split(0)}},  # (cos, sin) of the text, then of the rest
        },
        gather_outputs={"norm_moe_gen": 0},
        prefix_attention={"layers.*.self_attn": "und_seq"},
    )


EXAMPLES = {
    "cosmos3-omni": ("Cosmos3OmniTransformer", dict(
        head_dim=16, hidden_size=64, intermediate_size=128, latent_channel=4, latent_patch_size=2,
        num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, patch_latent_dim=16,
        rope_theta=10000.0, vocab_size=64, sound_gen=True, sound_dim=6, rope_axes_dim=[4, 2, 2])),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    # The model has no batch axis (one packed sequence per call). Layout: [text, video (first frame a clean
    # condition), sound (first step clean)]; predictions are read for the noisy rows.
    p = config.latent_patch_size
    text, frame = grid.text, grid.height * grid.width
    video, sound = grid.frames * frame, 5
    length = text + video + sound
    positions = torch.zeros(3, length, dtype=torch.long)
    positions[:, :text] = torch.arange(text)
    t, h, w = torch.meshgrid(torch.arange(grid.frames), torch.arange(grid.height), torch.arange(grid.width),
                             indexing="ij")
    positions[:, text:text + video] = torch.stack([t.flatten() + text, h.flatten(), w.flatten()])
    positions[:, text + video:] = torch.arange(sound) + text
    vision_at, sound_at = torch.arange(text, text + video), torch.arange(text + video, length)
    return dict(
        input_ids=torch.randint(0, config.vocab_size, (text,), generator=generator),
        text_indexes=torch.arange(text),
        position_ids=positions,
        und_len=text,
        sequence_length=length,
        vision_tokens=[torch.randn(1, config.latent_channel, grid.frames, grid.height * p, grid.width * p,
                                   generator=generator)],
        vision_token_shapes=[(grid.frames, grid.height, grid.width)],
        vision_sequence_indexes=vision_at,
        vision_mse_loss_indexes=vision_at[frame:],
        vision_timesteps=torch.rand(video - frame, generator=generator) * 1000,
        vision_noisy_frame_indexes=[torch.arange(1, grid.frames)],
        sound_tokens=[torch.randn(config.sound_dim, sound, generator=generator)],
        sound_token_shapes=[(sound, 1, 1)],
        sound_sequence_indexes=sound_at,
        sound_mse_loss_indexes=sound_at[1:],
        sound_timesteps=torch.rand(sound - 1, generator=generator) * 1000,
        sound_noisy_frame_indexes=[torch.arange(1, sound)],
        return_dict=False,
    )


FAMILY = Family.of(__name__)
