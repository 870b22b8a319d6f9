"""LTX-2 (`LTX2VideoTransformer3DModel`): a video and an audio stream, each with self-attention, cross-attention to
its text and feed-forward, joined by audio-to-video and video-to-audio cross-attention; QK-norms span all heads and
the rotary tables span the inner dimension ("interleaved") or hold one row per head ("split", LTX-2.3)."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention, feed_forward, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, Full, Noise, Ref, Uniform, Value, text_mask

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


_INPUTS = dict(
    hidden_states=Noise(("batch", "frames * height * width", "in_channels")),
    audio_hidden_states=Noise(("batch", "width + 2", "audio_in_channels")),
    encoder_hidden_states=Noise(("batch", "text", "caption_channels")),
    audio_encoder_hidden_states=Noise(("batch", "text", "caption_channels")),
    encoder_attention_mask=text_mask("int64", keep="text - 3"),
    audio_encoder_attention_mask=Ref("encoder_attention_mask"),
    num_frames=Value("frames"), height=Value("height"), width=Value("width"), audio_num_frames=Value("width + 2"),
    return_dict=False,
)
INPUTS = ByExample({
    # per-token timesteps: the first (conditioning) frame is clean; the audio's drawn on its own
    "ltx-2": {**_INPUTS, "timestep": Uniform(1000, ("batch", 1), expand=("batch", "frames * height * width"),
                                             set=((":, :height * width", 0),)),
              "audio_timestep": Uniform(1000)},
    "ltx-2.3": {**_INPUTS, "sigma": Uniform(), "timestep": Ref("sigma", 1000), "use_cross_timestep": True,
                "video_keyframes_mask": Full(("batch", "frames * height * width", 1), 0.0,
                                            set=((":, :height * width", 1),)),
                "spatio_temporal_guidance_blocks": [1],
                "perturbation_mask": Full(("batch",), 1.0, set=(("1::2", 0.0),))},
})


FAMILY = Family.of(__name__)
