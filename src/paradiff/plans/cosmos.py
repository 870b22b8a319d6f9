"""Cosmos 1.0 / Predict2 / Predict2.5 / Transfer2.5 (`CosmosTransformer3DModel`): how it splits."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import DEFAULT_HEAD_ATTRS, TensorParallelPlan
from paradiff.plans.common import basic_transformer_block, mlp, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, Full, Noise, Repeat, Uniform, text_mask

MODEL_CLASSES = ("CosmosTransformer3DModel",)

_PER_TOKEN = Split(1, ndim=3)  # per-frame timesteps give every token its own modulation


def tensor_parallel_plan(config) -> TensorParallelPlan:
    # QK-norms are per head (head_dim wide): whole on every rank
    styles = {
        **basic_transformer_block("transformer_blocks.*"),
        **{f"transformer_blocks.*.{norm}.{linear}": "rowwise_split_input"
           for norm in ("norm1", "norm2", "norm3") for linear in ("linear_1", "linear_2")},
        **mlp("time_embed.t_embedder"),
        **split_input("norm_out.linear_1", "norm_out.linear_2"),
    }
    head_attrs = DEFAULT_HEAD_ATTRS
    if config.img_context_dim_in:
        # Transfer2.5's image-context attention; its processor reshapes by out_dim // heads, so out_dim shrinks too
        styles.update({f"transformer_blocks.*.attn2.{name}": "colwise" for name in ("q_img", "k_img", "v_img")})
        head_attrs = DEFAULT_HEAD_ATTRS + ("out_dim",)
    return TensorParallelPlan(styles=styles, head_attrs=head_attrs)


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1)},
            "transformer_blocks.*": {"embedded_timestep": _PER_TOKEN, "temb": _PER_TOKEN},
            "norm_out": {"embedded_timestep": _PER_TOKEN, "temb": _PER_TOKEN},
            "": {"block_controlnet_hidden_states": Split(1)},  # Transfer2.5: a per-token residual per block
        },
        split_outputs={"rope": {0: Split(0), 1: Split(0)}, **(
            {"learnable_pos_embed": {0: Split(1)}} if config.extra_pos_embed_type else {})},
        gather_outputs={"proj_out": 1},
        # attn2 attends to the replicated text (and image) context
        local_attention=("transformer_blocks.*.attn2",),
    )


# concat_padding_mask needs torchvision (diffusers resizes the mask with it); the mask only adds an input channel
# before the patch embedding, which parallelism never touches
_BASE = dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2,
             text_embed_dim=32, adaln_lora_dim=16, max_size=(16, 32, 32), patch_size=(1, 2, 2),
             concat_padding_mask=False)
EXAMPLES = {
    "cosmos1.0-text2world": ("CosmosTransformer3DModel", {**_BASE, "rope_scale": (2.0, 1.0, 1.0)}),
    # Predict2 video2world: per-frame timesteps, a condition-mask channel, no learnable positions
    "cosmos2-video2world": ("CosmosTransformer3DModel", {
        **_BASE, "in_channels": 5, "rope_scale": (1.0, 3.0, 3.0), "extra_pos_embed_type": None}),
    # Transfer2.5: projected text, image context in attn2, control-net residuals
    "cosmos2.5-transfer": ("CosmosTransformer3DModel", {
        **_BASE, "in_channels": 5, "rope_scale": (1.0, 3.0, 3.0), "extra_pos_embed_type": None,
        "use_crossattn_projection": True, "crossattn_proj_in_channels": 48, "encoder_hidden_states_channels": 32,
        "controlnet_block_every_n": 1, "img_context_dim_in": 24, "img_context_num_tokens": 6,
        "img_context_dim_out": 64}),
}


_VIDEO = ("frames * patch_size[0]", "height * patch_size[1]", "width * patch_size[2]")
_TEXT = Noise(("batch", "text", "text_embed_dim"))
# Predict2 / Transfer2.5: the condition mask is the latents' last channel; the first frame conditions the rest,
# clean (timestep 0)
_VIDEO2WORLD = dict(
    hidden_states=Noise(("batch", "in_channels - 1", *_VIDEO)),
    timestep=Uniform(1, ("batch", 1, "frames * patch_size[0]", 1, 1), set=((":, :, 0", 0),)),
    encoder_hidden_states=_TEXT,
    fps=24,
    return_dict=False,
    condition_mask=Full(("batch", 1, *_VIDEO), 0.0, set=((":, :, 0", 1),)),
)
INPUTS = ByExample({
    "cosmos1.0-text2world": dict(hidden_states=Noise(("batch", "in_channels", *_VIDEO)), timestep=Uniform(),
                                 encoder_hidden_states=_TEXT, fps=24, return_dict=False,
                                 attention_mask=text_mask(keep="text // 2")),  # the last prompt is shorter
    "cosmos2-video2world": _VIDEO2WORLD,
    "cosmos2.5-transfer": {
        **_VIDEO2WORLD,
        "encoder_hidden_states": (Noise(("batch", "text", "crossattn_proj_in_channels")),
                                  Noise(("batch", "img_context_num_tokens", "img_context_dim_in"))),
        "block_controlnet_hidden_states": Repeat(
            Noise(("batch", "frames * height * width", "num_attention_heads * attention_head_dim")), "num_layers"),
    },
})


FAMILY = Family.of(__name__)
