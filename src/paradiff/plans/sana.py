"""Sana / Sana 1.5 / Sana Sprint (`SanaTransformer2DModel`): ReLU linear self-attention, PixArt-style cross-attention
and a convolutional (GLUMBConv) feed-forward over the token grid; and its ControlNet (`SanaControlNetModel`: the same
blocks, each block's tokens projected by its own Linear into a residual the transformer adds before the next
block)."""

from paradiff.context_parallel.plan import ContextParallelPlan, GridSplit, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import PackedColwise
from paradiff.plans.common import attention, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, Full, Noise, Uniform, When, text_mask

MODEL_CLASSES = ("SanaTransformer2DModel", "SanaControlNetModel")
CONTROLNET = "SanaControlNetModel"


def block_styles(config, blocks: str = "transformer_blocks.*") -> dict:
    """Both attentions by heads (linear attention splits by heads like softmax attention); the GLUMBConv's 1x1
    convolutions are Linears over channels: its value/gate expansion and their depthwise convolution colwise (each
    half on its own), the projection back rowwise."""
    norms = ("norm_q", "norm_k") if getattr(config, "qk_norm", None) == "rms_norm_across_heads" else ()
    return {
        **attention(f"{blocks}.attn1", norms_across_heads=norms),
        **attention(f"{blocks}.attn2", norms_across_heads=norms),
        f"{blocks}.ff.conv_inverted": PackedColwise([1, 1]),
        f"{blocks}.ff.conv_depth": PackedColwise([1, 1]),
        f"{blocks}.ff.conv_point": "rowwise",
    }


def embedder_styles(config) -> dict:
    styles = {**mlp("caption_projection"), "time_embed.linear": "rowwise_split_input"}
    if getattr(config, "guidance_embeds", False):
        styles.update({**mlp("time_embed.timestep_embedder"), **mlp("time_embed.guidance_embedder")})
    else:
        styles.update(mlp("time_embed.emb.timestep_embedder"))
    return styles


def tensor_parallel_plan(config, model_class: str = "SanaTransformer2DModel") -> TensorParallelPlan:
    styles = {**block_styles(config), **embedder_styles(config)}
    if model_class == CONTROLNET:
        # each residual projection reads its block's replicated output: the residuals come out whole on every rank,
        # as the transformer's replicated tokens they are added to (the condition's input block stays whole)
        styles["controlnet_blocks.*"] = "rowwise_split_input"
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config, model_class: str = "SanaTransformer2DModel") -> ContextParallelPlan:
    # The feed-forward convolves over the image grid, so the tokens are split by whole rows and its 3x3 depthwise
    # convolution borrows one row from each neighbour. Linear attention sums over the keys: one all-reduce of the
    # partial sums. Cross-attention reads the replicated text.
    blocks = dict(
        split_inputs={"transformer_blocks.*": {"hidden_states": GridSplit(1, ("height", "width"))}},
        halo_convs=("transformer_blocks.*.ff.conv_depth",),
        linear_attention=("transformer_blocks.*.attn1",),
        local_attention=("transformer_blocks.*.attn2",),
    )
    if model_class == CONTROLNET:
        # the condition was added to the tokens before the first block, where they are split; every residual is
        # gathered whole: a transformer on any mesh (or none) takes them as a plain model does
        return ContextParallelPlan(**blocks, gather_outputs={"controlnet_blocks.*": 1})
    # the ControlNet's residuals (whole, one per token) are added between the blocks, where the grid is split by
    # rows: each is split like the tokens when the model reads it
    blocks["split_inputs"][""] = {"controlnet_block_samples": Split(1, like="hidden_states", deferred=True)}
    return ContextParallelPlan(**blocks, gather_outputs={"proj_out": 1})


_BASE = dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2,
             num_cross_attention_heads=2, cross_attention_head_dim=32, cross_attention_dim=64, caption_channels=32,
             sample_size=8, patch_size=1)
EXAMPLES = {
    "sana-1.0": ("SanaTransformer2DModel", _BASE),
    # Sana Sprint / 1.5: QK RMSNorm across heads, guidance embedding, sin-cos positions
    "sana-sprint": ("SanaTransformer2DModel", {**_BASE, "qk_norm": "rms_norm_across_heads", "guidance_embeds": True,
                                               "interpolation_scale": 1}),
    "sana-controlnet": (CONTROLNET, {**_BASE, "num_layers": 1}),
}


# the text and its mask, the last prompt shorter
TEXT_INPUTS = dict(encoder_hidden_states=Noise(("batch", "text", "caption_channels")),
                   encoder_attention_mask=text_mask("float32", keep="text // 2"))
# rows = the grid's width, so four CP ranks each get a row
_LATENTS = Noise(("batch", "in_channels", "width * patch_size", "height * patch_size"))
_INPUTS = dict(hidden_states=_LATENTS, timestep=Uniform(1000), **TEXT_INPUTS,
               guidance=When('field("guidance_embeds", False)', Full(("batch",), 4.5)), return_dict=False)
INPUTS = ByExample({
    "sana-1.0": _INPUTS,
    "sana-sprint": _INPUTS,
    # the control image's latents, patchified like the noise latents
    "sana-controlnet": {**_INPUTS, "controlnet_cond": _LATENTS},
})


FAMILY = Family.of(__name__)
