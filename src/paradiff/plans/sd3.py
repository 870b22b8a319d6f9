"""Stable Diffusion 3 / 3.5 (`SD3Transformer2DModel`) and its ControlNet (`SD3ControlNetModel`: joint blocks like
the transformer's, each block's image tokens projected by its own Linear into a residual the transformer adds after
its blocks): how they split under tensor and context parallelism."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.errors import PlanError
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, attention, feed_forward, joint_attention, mlp, split_input
from paradiff.plans.family import Family

MODEL_CLASSES = ("SD3Transformer2DModel", "SD3ControlNetModel")
CONTROLNET = "SD3ControlNetModel"


def tensor_parallel_plan(config, model_class: str = "SD3Transformer2DModel") -> TensorParallelPlan:
    if model_class == CONTROLNET:
        _check_joint_controlnet(config)
    # The transformer's last block is "context pre-only": its attention has no text output projection and it has no
    # text FFN; the ControlNet's blocks all keep their text stream.
    text_out = range(config.num_layers if model_class == CONTROLNET else config.num_layers - 1)
    styles = {
        **joint_attention("transformer_blocks.*.attn"),
        **feed_forward("transformer_blocks.*.ff"),
        **split_input("transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear",
                      "context_embedder"),
        **mlp("time_text_embed.timestep_embedder"),
        **mlp("time_text_embed.text_embedder"),
    }
    if model_class == CONTROLNET:
        # each residual projection reads its block's replicated output: the residuals come out whole
        styles["controlnet_blocks.*"] = "rowwise_split_input"
    else:
        styles["norm_out.linear"] = "rowwise_split_input"
    del styles["transformer_blocks.*.attn.to_add_out"]
    for i in text_out:
        styles[f"transformer_blocks.{i}.attn.to_add_out"] = "rowwise"
        styles.update(feed_forward(f"transformer_blocks.{i}.ff_context"))
    for i in config.dual_attention_layers:  # SD3.5: a second self-attention on the image tokens
        styles.update(attention(f"transformer_blocks.{i}.attn2"))
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config, model_class: str = "SD3Transformer2DModel") -> ContextParallelPlan:
    # Image and text tokens attend jointly, so both are split; the patch embedding (with its cropped positional
    # table) runs before the first block on the full image; the ControlNet adds its condition's patches there too.
    blocks = {"transformer_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)}}
    if model_class == CONTROLNET:
        _check_joint_controlnet(config)
        # every residual is gathered whole: a transformer on any mesh (or none) takes them as a plain model does
        return ContextParallelPlan(split_inputs=blocks, gather_outputs={"controlnet_blocks.*": 1})
    # the ControlNet's residuals (whole, one per image token) are added to the image tokens after the blocks: each
    # rank adds its own tokens' slice, as the first block's split gave it
    return ContextParallelPlan(
        split_inputs={**blocks, "": {"block_controlnet_hidden_states": Split(1)}},
        gather_outputs={"proj_out": 1},
    )


def _check_joint_controlnet(config) -> None:
    if config.joint_attention_dim is None or not config.use_pos_embed:
        raise PlanError(
            "SD3ControlNetModel without joint blocks (joint_attention_dim=None, SD3.5 Large's 8B ControlNets, whose "
            "single blocks take the transformer's embedded tokens) has no built-in plan yet; only the joint-block "
            f"ControlNets do (this config: joint_attention_dim={config.joint_attention_dim!r}, "
            f"use_pos_embed={config.use_pos_embed!r}).")


_BASE = dict(sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
             joint_attention_dim=32, caption_projection_dim=64, pooled_projection_dim=24, out_channels=4,
             pos_embed_max_size=12)
EXAMPLES = {
    "sd3": ("SD3Transformer2DModel", _BASE),
    "sd3-controlnet": (CONTROLNET, _BASE),
    "sd3.5": ("SD3Transformer2DModel", {**_BASE, "num_layers": 3, "dual_attention_layers": (0, 1),
                                        "qk_norm": "rms_norm"}),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    p = config.patch_size
    inputs = dict(
        hidden_states=torch.randn(batch, config.in_channels, grid.height * p, grid.width * p, generator=generator),
        encoder_hidden_states=torch.randn(batch, grid.text, config.joint_attention_dim, generator=generator),
        pooled_projections=torch.randn(batch, config.pooled_projection_dim, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        return_dict=False,
    )
    if name == "sd3-controlnet":  # the control image's latents, patchified like the noise latents
        inputs["controlnet_cond"] = torch.randn(batch, config.in_channels, grid.height * p, grid.width * p,
                                                generator=generator)
    return inputs


FAMILY = Family.of(__name__)
