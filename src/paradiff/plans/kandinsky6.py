"""Kandinsky 6 (`Kandinsky6Transformer3DModel`): a text encoder per modality (self-attention blocks over the
text), then fused blocks in which video and audio each attend themselves and their text, then each other."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import DEFAULT_HEAD_ATTRS, TensorParallelPlan
from paradiff.plans.common import feed_forward, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, Full, Noise, Uniform, text_mask

MODEL_CLASSES = ("Kandinsky6Transformer3DModel",)
TEXT_STACKS = ("video_text_transformer_blocks", "audio_text_transformer_blocks")


def _attention(prefix: str) -> dict:
    # Q/K norms act on one head at a time; nothing to split there
    return {f"{prefix}.to_query": "colwise", f"{prefix}.to_key": "colwise", f"{prefix}.to_value": "colwise",
            f"{prefix}.out_layer": "rowwise"}


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {}
    for stack in TEXT_STACKS:
        styles.update({**_attention(f"{stack}.*.attn"), **feed_forward(f"{stack}.*.feed_forward"),
                       f"{stack}.*.text_modulation.out_layer": "rowwise_split_input"})
    fused = "visual_transformer_blocks.*"
    for stream in ("video_dec_block", "audio_dec_block"):
        styles.update({**_attention(f"{fused}.{stream}.self_attention"),
                       **_attention(f"{fused}.{stream}.cross_attention"),
                       **feed_forward(f"{fused}.{stream}.feed_forward"),
                       f"{fused}.{stream}.visual_modulation.out_layer": "rowwise_split_input"})
    styles.update({**_attention(f"{fused}.va_cross_attention"), **_attention(f"{fused}.av_cross_attention"),
                   f"{fused}.va_modulation.out_layer": "rowwise_split_input",
                   f"{fused}.av_modulation.out_layer": "rowwise_split_input"})
    for prefix in ("video", "audio"):
        styles.update({**mlp(f"{prefix}_time_embeddings.timestep_embedder"),
                       f"{prefix}_text_embeddings.in_layer": "rowwise_split_input"})
    styles.update({"out_layer.modulation.out_layer": "rowwise_split_input",
                   "audio_out_layer.modulation.out_layer": "rowwise_split_input"})
    # Kandinsky 6's attention counts its heads in `num_heads`
    return TensorParallelPlan(styles=styles, head_attrs=DEFAULT_HEAD_ATTRS + ("num_heads",))


def context_parallel_plan(config) -> ContextParallelPlan:
    splits, gathers = {}, {}
    for stack in TEXT_STACKS:  # each text encoder splits its text, gathered whole for the cross-attentions
        splits[f"{stack}.0"] = {"x": Split(1)}
        splits[f"{stack}.*"] = {"rope": Split(0), "attn_mask": Split(1)}
        gathers[f"{stack}.{config.num_text_blocks - 1}"] = 1
    fused = "visual_transformer_blocks"
    splits[f"{fused}.0"] = {"vis": Split(1), "aud": Split(1)}
    splits[f"{fused}.*"] = {"vis_rope": Split(0), "aud_rope": Split(0)}  # (tokens, 1, dim / 2, 2, 2) tables
    gathers[f"{fused}.{config.num_visual_blocks - 1}"] = {0: 1, 1: 1}
    return ContextParallelPlan(
        split_inputs=splits,
        gather_outputs=gathers,
        # video <-> audio attention runs between the two split streams; the text is whole in the fused blocks
        local_attention=(f"{fused}.*.video_dec_block.cross_attention", f"{fused}.*.audio_dec_block.cross_attention"),
    )


_BASE = dict(in_visual_dim=4, out_visual_dim=4, in_text_dim=24, in_text_dim2=16, time_dim=32, patch_size=(1, 2, 2),
             model_dim=64, ff_dim=128, num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6), in_audio_dim=6,
             out_audio_dim=6, model_dim_a=32, time_dim_a=24, ff_dim_a=64, ca_rope=True, cross_gates=True,
             fix_modulation=True, text_token_padding=True, visual_token_type_num_embeddings=2)
EXAMPLES = {
    "kandinsky6": ("Kandinsky6Transformer3DModel", _BASE),
    # no audio: the fused blocks run their video path only
    "kandinsky6-video": ("Kandinsky6Transformer3DModel", _BASE),
}


_INPUTS = dict(
    # Kandinsky 6 takes (batch, frames, height, width, channels)
    hidden_states=Noise(("batch", "frames * patch_size[0]", "height * patch_size[1]", "width * patch_size[2]",
                         "2 * in_visual_dim + 1 if visual_cond else in_visual_dim")),
    encoder_hidden_states=Noise(("batch", "text", "in_text_dim")),
    pooled_projections=Noise(("batch", "in_text_dim2")),
    timestep=Uniform(1000),
    encoder_attention_mask=text_mask(keep="text - 3"),
    # the first frame is the conditioning image
    visual_token_type_ids=Full(("batch", "frames"), 0, "long", set=((":, 0", 1),)),
    return_dict=False,
)
INPUTS = ByExample({
    "kandinsky6": {**_INPUTS, "audio_hidden_states": Noise(("batch", "width + 4", "in_audio_dim"))},
    "kandinsky6-video": _INPUTS,
})

# 7 text tokens over 4 ranks leave one rank a single token, whose key mask looks like a 1 x 1 padding mask
EXTRA_MODES = {"kandinsky6": ("unified2x2",)}


FAMILY = Family.of(__name__)
