"""FLUX.1 (`FluxTransformer2DModel`) and its ControlNet (`FluxControlNetModel`: the same double- and single-stream
blocks, each block's image tokens projected by its own Linear into a residual the transformer adds after its block of
the same depth): how they split under tensor and context parallelism."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import PackedColwise, PackedRowwise
from paradiff.plans.common import joint_attention, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, Full, GridIds, Noise, Uniform

MODEL_CLASSES = ("FluxTransformer2DModel", "FluxControlNetModel")
CONTROLNET = "FluxControlNetModel"


def flux_blocks(gated: bool = False, modulation: bool = True) -> dict:
    """FLUX.1-style double- and single-stream blocks, shared by its derivatives (Chroma, Bria, LongCat-Image,
    Ovis-Image). `gated`: SwiGLU feed-forwards (value and gate packed in one projection); `modulation`: the blocks
    own their AdaLN linears (Chroma's come pruned, from one shared approximator)."""
    ff_in = PackedColwise([1, 1]) if gated else "colwise"
    styles = {
        # double-stream blocks: Q/K/V and FFN-in colwise, their projections back rowwise
        **joint_attention("transformer_blocks.*.attn"),
        "transformer_blocks.*.ff.net.0.proj": ff_in,
        "transformer_blocks.*.ff.net.2": "rowwise",
        "transformer_blocks.*.ff_context.net.0.proj": ff_in,
        "transformer_blocks.*.ff_context.net.2": "rowwise",
        # single-stream blocks: proj_out consumes [attention (dim), MLP (4 dim)] concatenated
        "single_transformer_blocks.*.attn.to_q": "colwise",
        "single_transformer_blocks.*.attn.to_k": "colwise",
        "single_transformer_blocks.*.attn.to_v": "colwise",
        "single_transformer_blocks.*.proj_mlp": ff_in,
        "single_transformer_blocks.*.proj_out": PackedRowwise(_single_out_blocks),
    }
    if modulation:  # AdaLN modulation (dim -> 6 dim) reads the replicated timestep embedding
        styles.update({
            **split_input("transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear",
                          "single_transformer_blocks.*.norm.linear"),
        })
    return styles


def tensor_parallel_plan(config, model_class: str = "FluxTransformer2DModel") -> TensorParallelPlan:
    styles = {
        **flux_blocks(),
        # embeddings
        "context_embedder": "rowwise_split_input",
        "time_text_embed.timestep_embedder.linear_1": "colwise",
        "time_text_embed.timestep_embedder.linear_2": "rowwise",
        "time_text_embed.text_embedder.linear_1": "colwise",
        "time_text_embed.text_embedder.linear_2": "rowwise",
    }
    if model_class == CONTROLNET:
        # each residual projection reads its block's replicated output: the residuals come out whole on every rank,
        # as the transformer's replicated tokens they are added to (the condition's x_embedder stays whole)
        styles["controlnet_blocks.*"] = "rowwise_split_input"
        styles["controlnet_single_blocks.*"] = "rowwise_split_input"
    else:
        styles["norm_out.linear"] = "rowwise_split_input"  # the final modulation
    if config.guidance_embeds:
        styles["time_text_embed.guidance_embedder.linear_1"] = "colwise"
        styles["time_text_embed.guidance_embedder.linear_2"] = "rowwise"
    return TensorParallelPlan(styles=styles)


def _single_out_blocks(config) -> list[int]:
    inner = config.num_attention_heads * config.attention_head_dim
    return [inner, 4 * inner]  # FLUX.1-style single blocks use mlp_ratio 4


def context_parallel_plan(config, model_class: str = "FluxTransformer2DModel") -> ContextParallelPlan:
    if model_class == CONTROLNET:
        return ContextParallelPlan(
            split_inputs={
                "": dict(_TOKEN_SPLITS),
                # the condition's packed latents (or, with an input hint block, its patches) go in at the embedder,
                # one per image token: split there like the image tokens
                "controlnet_x_embedder": {"input": Split(1)},
            },
            # every residual is gathered whole: a transformer on any mesh (or none) takes them as a plain model does
            gather_outputs={"controlnet_blocks.*": 1, "controlnet_single_blocks.*": 1},
            unsupported_inputs={"": {"controlnet_mode": (
                "the union ControlNet prepends its mode token to the text after the split, so every rank would add "
                "one; run union ControlNets without context parallelism")}},
        )
    # the ControlNet's residuals (whole, one per image token) are added to the image tokens after each block: each
    # rank adds its own tokens' slice
    return flux_context_plan({"controlnet_block_samples": Split(1), "controlnet_single_block_samples": Split(1)})


_TOKEN_SPLITS = {
    "hidden_states": Split(1),
    "encoder_hidden_states": Split(1),
    "img_ids": Split(-2),
    "txt_ids": Split(-2),
}


def flux_context_plan(inputs: dict[str, Split] | None = None, **extra) -> ContextParallelPlan:
    """Image and text tokens split at the model's input with their position ids (and `inputs`, more of the model's
    arguments); gathered at `proj_out`."""
    return ContextParallelPlan(split_inputs={"": {**_TOKEN_SPLITS, **(inputs or {})}}, gather_outputs={"proj_out": 1},
                               **extra)


_TINY = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
             num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
             axes_dims_rope=(4, 6, 6))
EXAMPLES = {
    "flux.1-dev": ("FluxTransformer2DModel", _TINY),
    "flux.1-controlnet": (CONTROLNET, _TINY),
}


# Packed image tokens, text, timestep and position ids, as FLUX.1-style models take them
FLUX_INPUTS = dict(
    hidden_states=Noise(("batch", "height * width", "in_channels")),
    encoder_hidden_states=Noise(("batch", "text", "joint_attention_dim")),
    timestep=Uniform(),
    img_ids=GridIds("height", "width", "len(axes_dims_rope)"),
    txt_ids=GridIds(1, "text", "len(axes_dims_rope)"),
    return_dict=False,
)
_INPUTS = {**FLUX_INPUTS, "guidance": Full(("batch",), 3.5),
           "pooled_projections": Noise(("batch", "pooled_projection_dim"))}
INPUTS = ByExample({
    "flux.1-dev": _INPUTS,
    # the control image's packed latents, one per image token
    "flux.1-controlnet": {**_INPUTS, "controlnet_cond": Noise(("batch", "height * width", "in_channels"))},
})


FAMILY = Family.of(__name__)
