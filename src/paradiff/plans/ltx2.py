"""LTX-2 (`LTX2VideoTransformer3DModel`): a video and an audio stream, each with self-attention, cross-attention to
its text and feed-forward, joined by audio-to-video and video-to-audio cross-attention; QK-norms span all heads and
the rotary tables span the inner dimension ("interleaved") or hold one row per head ("split", LTX-2.3)."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, attention, feed_forward, mlp
from paradiff.plans.family import Family

MODEL_CLASSES = ("LTX2VideoTransformer3DModel",)
ROPES = ("rope", "cross_attn_rope", "audio_rope", "cross_attn_audio_rope")  # video positions first, then audio


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {**feed_forward("transformer_blocks.*.ff"), **feed_forward("transformer_blocks.*.audio_ff"),
              **mlp("caption_projection"), **mlp("audio_caption_projection")}
    gated = {"attn1": config.gated_attn, "attn2": config.gated_attn, "audio_to_video_attn": config.gated_attn,
             "audio_attn1": config.audio_gated_attn, "audio_attn2": config.audio_gated_attn,
             "video_to_audio_attn": config.audio_gated_attn}
    for name, has_gate in gated.items():
        prefix = f"transformer_blocks.*.{name}"
        styles.update(attention(prefix, norms_across_heads=("norm_q", "norm_k")))
        if has_gate:  # one gate logit per head
            styles[f"{prefix}.to_gate_logits"] = "colwise"
    adaln = ["time_embed", "audio_time_embed", "av_cross_attn_video_scale_shift", "av_cross_attn_audio_scale_shift",
             "av_cross_attn_video_a2v_gate", "av_cross_attn_audio_v2a_gate"]
    if (config.cross_attn_mod or config.audio_cross_attn_mod) and config.use_prompt_adaln_single:
        adaln += ["prompt_adaln", "audio_prompt_adaln"]
    for name in adaln:
        styles.update({**mlp(f"{name}.emb.timestep_embedder"), f"{name}.linear": "rowwise_split_input"})
    # every rank keeps its heads' part of each rotary table: channels ("interleaved") or head rows ("split")
    head_dim = -1 if config.rope_type == "interleaved" else 1
    return TensorParallelPlan(styles=styles, head_outputs={rope: {0: head_dim, 1: head_dim} for rope in ROPES})


def context_parallel_plan(config) -> ContextParallelPlan:
    token_dim = 1 if config.rope_type == "interleaved" else 2  # (batch, tokens, dim) or (batch, heads, tokens, dim)
    table = {0: Split(token_dim), 1: Split(token_dim)}
    return ContextParallelPlan(
        # both streams split at the input; per-token timesteps (and the keyframe marker) split with their tokens
        split_inputs={"": {
            "hidden_states": Split(1), "audio_hidden_states": Split(1), "timestep": Split(1, ndim=2),
            "audio_timestep": Split(1, ndim=2), "video_keyframes_mask": Split(1)}},
        split_outputs={rope: table for rope in ROPES},
        gather_outputs={"proj_out": 1, "audio_proj_out": 1},
        # the text cross-attentions see replicated text; audio <-> video attend between two split streams
        local_attention=("transformer_blocks.*.attn2", "transformer_blocks.*.audio_attn2"),
        unsupported_inputs={"": {"video_self_attention_mask": (
            "LTX-2's attention pads this (video tokens x video tokens) mask to the local token count, which a token "
            "split would silently misalign; run without context parallelism to use it")}},
    )


_BASE = dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
             audio_in_channels=6, audio_out_channels=6, audio_num_attention_heads=4, audio_attention_head_dim=8,
             audio_cross_attention_dim=32, num_layers=2, caption_channels=24)
EXAMPLES = {
    "ltx-2": ("LTX2VideoTransformer3DModel", _BASE),
    # LTX-2.3: per-head rotary rows, gated attention, prompt modulation, keyframe marker, STG on one block
    "ltx-2.3": ("LTX2VideoTransformer3DModel", {
        **_BASE, "rope_type": "split", "gated_attn": True, "audio_gated_attn": True, "cross_attn_mod": True,
        "audio_cross_attn_mod": True, "perturbed_attn": True, "use_keyframes_abs_pos_embedding": True}),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    tokens, audio_tokens = grid.frames * grid.height * grid.width, grid.width + 2
    text_mask = torch.ones(batch, grid.text, dtype=torch.int64)
    text_mask[-1, -3:] = 0
    timestep = torch.rand(batch, generator=generator)
    inputs = dict(
        hidden_states=torch.randn(batch, tokens, config.in_channels, generator=generator),
        audio_hidden_states=torch.randn(batch, audio_tokens, config.audio_in_channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, grid.text, config.caption_channels, generator=generator),
        audio_encoder_hidden_states=torch.randn(batch, grid.text, config.caption_channels, generator=generator),
        encoder_attention_mask=text_mask, audio_encoder_attention_mask=text_mask,
        num_frames=grid.frames, height=grid.height, width=grid.width, audio_num_frames=audio_tokens,
        return_dict=False,
    )
    if name == "ltx-2":  # per-token timesteps: the first (conditioning) frame is clean
        video_timestep = timestep[:, None].repeat(1, tokens)
        video_timestep[:, : grid.height * grid.width] = 0
        inputs.update(timestep=video_timestep * 1000, audio_timestep=timestep * 1000)
    else:
        keyframes = torch.zeros(batch, tokens, 1)
        keyframes[:, : grid.height * grid.width] = 1
        inputs.update(timestep=timestep * 1000, sigma=timestep, use_cross_timestep=True,
                      video_keyframes_mask=keyframes, spatio_temporal_guidance_blocks=[1],
                      perturbation_mask=torch.tensor([1.0, 0.0]).repeat(batch)[:batch])
    return inputs


FAMILY = Family.of(__name__)
