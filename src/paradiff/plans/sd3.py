"""Stable Diffusion 3 / 3.5 (`SD3Transformer2DModel`) and its ControlNet (`SD3ControlNetModel`: joint blocks like
the transformer's, each block's image tokens projected by its own Linear into a residual the transformer adds after
its blocks): how they split under tensor and context parallelism."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.errors import PlanError
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention, feed_forward, joint_attention, mlp, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, Noise, Uniform

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


_LATENTS = Noise(("batch", "in_channels", "height * patch_size", "width * patch_size"))
_INPUTS = dict(
    hidden_states=_LATENTS,
    encoder_hidden_states=Noise(("batch", "text", "joint_attention_dim")),
    pooled_projections=Noise(("batch", "pooled_projection_dim")),
    timestep=Uniform(1000),
    return_dict=False,
)
INPUTS = ByExample({
    "sd3": _INPUTS,
    "sd3-controlnet": {**_INPUTS, "controlnet_cond": _LATENTS},  # the control image's latents, patchified alike
    "sd3.5": _INPUTS,
})


FAMILY = Family.of(__name__)
