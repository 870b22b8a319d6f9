"""EasyAnimate (`EasyAnimateTransformer3DModel`): joint text-video attention, MMDiT blocks then shared-weight ones."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, attention, feed_forward, mlp, split_input
from paradiff.plans.family import Family

MODEL_CLASSES = ("EasyAnimateTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    # QK-norms are per head: whole on every rank
    styles = {
        **attention("transformer_blocks.*.attn1"),
        **feed_forward("transformer_blocks.*.ff"),
        **split_input("transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm2.linear", "norm_out.linear"),
        **mlp("time_embedding"),
    }
    for block in range(min(config.mmdit_layers, config.num_layers)):  # text's own projections and feed-forward
        prefix = f"transformer_blocks.{block}"
        styles.update({f"{prefix}.attn1.add_{x}_proj": "colwise" for x in "qkv"})
        styles.update({f"{prefix}.attn1.to_add_out": "rowwise", **feed_forward(f"{prefix}.txt_ff")})
    linear = ".1" if config.add_norm_text_encoder else ""  # behind an RMSNorm there
    styles[f"text_proj{linear}"] = "rowwise_split_input"
    if config.text_embed_dim_t5 is not None:
        styles[f"text_proj_t5{linear}"] = "rowwise_split_input"
    # the shared-weight blocks add the text's attention output to the text unprojected: it is gathered over heads
    shared = {f"transformer_blocks.{block}.attn1": {1: -1} for block in range(config.mmdit_layers, config.num_layers)}
    return TensorParallelPlan(styles=styles, gather_heads=shared)


def context_parallel_plan(config) -> ContextParallelPlan:
    # text and video attend jointly and both run through the blocks: both split; the rotary table covers the video
    return ContextParallelPlan(
        split_inputs={"transformer_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)}},
        split_outputs={"rope_embedding": {0: Split(0), 1: Split(0)}},
        gather_outputs={"proj_out": 1},
    )


_BASE = dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, patch_size=2,
             num_layers=2, mmdit_layers=2, time_embed_dim=32, text_embed_dim=32)
EXAMPLES = {
    "easyanimate-v5.1": ("EasyAnimateTransformer3DModel", _BASE),
    # one MMDiT block then a shared-weight block, inpainting latents, a second (T5) text stream, normed text input
    "easyanimate-mixed-inpaint": ("EasyAnimateTransformer3DModel", {
        **_BASE, "in_channels": 9, "mmdit_layers": 1, "after_norm": True, "add_norm_text_encoder": True,
        "text_embed_dim_t5": 32}),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    p = config.patch_size
    channels = config.out_channels
    inputs = dict(
        hidden_states=torch.randn(batch, channels, grid.frames, grid.height * p, grid.width * p, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, grid.text, config.text_embed_dim, generator=generator),
        return_dict=False,
    )
    if config.in_channels > channels:  # masked video latents and the mask itself
        inputs["inpaint_latents"] = torch.randn(batch, config.in_channels - channels, grid.frames, grid.height * p,
                                                grid.width * p, generator=generator)
    if config.text_embed_dim_t5 is not None:
        inputs["encoder_hidden_states_t5"] = torch.randn(batch, 5, config.text_embed_dim_t5, generator=generator)
    return inputs


FAMILY = Family.of(__name__)
