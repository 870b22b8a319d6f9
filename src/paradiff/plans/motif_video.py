"""Motif-Video (`MotifVideoTransformer3DModel`): dual-stream then single-stream joint attention over [video, text],
optional text cross-attention, decoder single blocks over a second video stream, image-embedding tokens."""

from paradiff.context_parallel.plan import ContextParallelPlan, Count, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import PackedRowwise
from paradiff.plans.common import attention, feed_forward, mlp, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Uniform, When, text_mask

MODEL_CLASSES = ("MotifVideoTransformer3DModel",)


def _inner(config) -> int:
    return config.num_attention_heads * config.attention_head_dim


def _single_out_blocks(config) -> list[int]:
    return [_inner(config), int(_inner(config) * config.mlp_ratio)]  # proj_out reads [attention, MLP]


def _single_with_cross(config) -> range:
    return range(config.num_single_layers - config.num_decoder_layers) if config.enable_text_cross_attention_single \
        else range(0)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        **attention("transformer_blocks.*.attn"),
        **{f"transformer_blocks.*.attn.add_{x}_proj": "colwise" for x in "qkv"},
        "transformer_blocks.*.attn.to_add_out": "rowwise",
        **feed_forward("transformer_blocks.*.ff"),
        **feed_forward("transformer_blocks.*.ff_context"),
        **split_input("transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear",
                      "single_transformer_blocks.*.norm.linear", "norm_out.linear"),
        **{f"single_transformer_blocks.*.attn.to_{x}": "colwise" for x in "qkv"},
        "single_transformer_blocks.*.proj_mlp": "colwise",
        "single_transformer_blocks.*.proj_out": PackedRowwise(_single_out_blocks),
        **mlp("context_embedder"),
        **mlp("time_text_embed.timestep_embedder"),
    }
    if config.image_embed_dim is not None:
        styles.update(mlp("image_embedder"))
    if config.enable_text_cross_attention_dual:
        styles.update(attention("transformer_blocks.*.cross_attn"))
    # A single block's cross-attention reads the unprojected attention output, which TP leaves split by heads: its
    # query projection is rowwise over those heads (the all-reduced query cut back to the rank's heads), and its
    # output is cut back to the rank's slice, to be added to that split attention output.
    cut = {}
    for block in _single_with_cross(config):
        prefix = f"single_transformer_blocks.{block}.cross_attn"
        styles.update({f"{prefix}.to_q": "rowwise", f"{prefix}.to_k": "colwise", f"{prefix}.to_v": "colwise",
                       f"{prefix}.to_out.0": "rowwise"})
        cut.update({f"{prefix}.to_q": {0: -1}, f"{prefix}.to_out.0": {0: -1}})
    return TensorParallelPlan(styles=styles, head_outputs=cut)


def context_parallel_plan(config) -> ContextParallelPlan:
    # Video and text attend jointly ([video, text]): both are split, the key mask by parts. Image-embedding tokens
    # lead the text stream; each rank counts those in its chunk. The text cross-attention reads the split text:
    # its keys are gathered (the text is short). Decoder blocks run over a second copy of the video stream.
    per_block = {"attention_mask": Split(-1, parts=("hidden_states", "encoder_hidden_states")),
                 "image_embed_seq_len": Count("encoder_hidden_states")}
    split_inputs = {
        "transformer_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)},
        "transformer_blocks.*": per_block,
        "single_transformer_blocks.*": per_block,
    }
    if config.num_decoder_layers:
        first_decoder = config.num_single_layers - config.num_decoder_layers
        split_inputs[f"single_transformer_blocks.{first_decoder}"] = {"hidden_states": Split(1)}
    gathered = [f"single_transformer_blocks.{block}.cross_attn" for block in _single_with_cross(config)]
    if config.enable_text_cross_attention_dual:
        gathered.append("transformer_blocks.*.cross_attn")
    return ContextParallelPlan(
        split_inputs=split_inputs,
        split_outputs={"rope": {0: Split(0), 1: Split(0)}},
        gather_outputs={"proj_out": 1},
        gathered_attention=tuple(gathered),
    )


_BASE = dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=1,
             num_single_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=32, rope_axes_dim=(4, 6, 6))
EXAMPLES = {
    "motif-video-t2v": ("MotifVideoTransformer3DModel", _BASE),
    # image tokens before the text, text cross-attention in both block kinds, a decoder single block
    "motif-video-i2v-cross": ("MotifVideoTransformer3DModel", {
        **_BASE, "num_single_layers": 2, "num_decoder_layers": 1, "image_embed_dim": 24,
        "enable_text_cross_attention_dual": True, "enable_text_cross_attention_single": True}),
}


INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "frames * patch_size_t", "height * patch_size", "width * patch_size")),
    timestep=Uniform(1000),
    encoder_hidden_states=Noise(("batch", "text", "text_embed_dim")),
    encoder_attention_mask=text_mask("long", keep="text // 2"),  # the last prompt is shorter
    image_embeds=When("image_embed_dim is not None", Noise(("batch", 3, "image_embed_dim"))),
    return_dict=False,
)


FAMILY = Family.of(__name__)
