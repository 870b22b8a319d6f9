"""Cosmos 1.0 / Predict2 / Predict2.5 / Transfer2.5 (`CosmosTransformer3DModel`): how it splits."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import DEFAULT_HEAD_ATTRS, TensorParallelPlan
from paradiff.plans.common import Grid, basic_transformer_block, mlp, split_input
from paradiff.plans.family import Family

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


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    p_t, p_h, p_w = config.patch_size
    frames, height, width = grid.frames * p_t, grid.height * p_h, grid.width * p_w
    channels = config.in_channels - (name != "cosmos1.0-text2world")  # the condition mask is the last channel
    inputs = dict(
        hidden_states=torch.randn(batch, channels, frames, height, width, generator=generator),
        timestep=torch.rand(batch, generator=generator),
        encoder_hidden_states=torch.randn(batch, grid.text, config.text_embed_dim, generator=generator),
        fps=24,
        return_dict=False,
    )
    if name == "cosmos1.0-text2world":
        mask = torch.ones(batch, grid.text, dtype=torch.bool)
        mask[-1, grid.text // 2:] = False  # the last prompt is shorter
        inputs["attention_mask"] = mask
        return inputs
    condition = torch.zeros(batch, 1, frames, height, width)
    condition[:, :, 0] = 1  # the first frame conditions the rest, at its own (small) timestep
    inputs["condition_mask"] = condition
    inputs["timestep"] = (torch.rand(batch, 1, frames, 1, 1, generator=generator) * (1 - condition[:, :, :, :1, :1]))
    if name == "cosmos2.5-transfer":
        text = torch.randn(batch, grid.text, config.crossattn_proj_in_channels, generator=generator)
        image = torch.randn(batch, config.img_context_num_tokens, config.img_context_dim_in, generator=generator)
        inputs["encoder_hidden_states"] = (text, image)
        hidden = config.num_attention_heads * config.attention_head_dim
        inputs["block_controlnet_hidden_states"] = [
            torch.randn(batch, grid.frames * grid.height * grid.width, hidden, generator=generator)
            for _ in range(config.num_layers)]
    return inputs


FAMILY = Family.of(__name__)
