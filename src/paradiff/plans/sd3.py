"""Stable Diffusion 3 / 3.5 (`SD3Transformer2DModel`): how it splits under tensor and context parallelism."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, attention, feed_forward, joint_attention, mlp
from paradiff.plans.family import Family

MODEL_CLASSES = ("SD3Transformer2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    # The last block is "context pre-only": its attention has no text output projection and it has no text FFN.
    text_out = range(config.num_layers - 1)
    styles = {
        **joint_attention("transformer_blocks.*.attn"),
        **feed_forward("transformer_blocks.*.ff"),
        "transformer_blocks.*.norm1.linear": "rowwise_split_input",
        "transformer_blocks.*.norm1_context.linear": "rowwise_split_input",
        **mlp("time_text_embed.timestep_embedder"),
        **mlp("time_text_embed.text_embedder"),
        "context_embedder": "rowwise_split_input",
        "norm_out.linear": "rowwise_split_input",
    }
    del styles["transformer_blocks.*.attn.to_add_out"]
    for i in text_out:
        styles[f"transformer_blocks.{i}.attn.to_add_out"] = "rowwise"
        styles.update(feed_forward(f"transformer_blocks.{i}.ff_context"))
    for i in config.dual_attention_layers:  # SD3.5: a second self-attention on the image tokens
        styles.update(attention(f"transformer_blocks.{i}.attn2"))
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    # Image and text tokens attend jointly, so both are split; the patch embedding (with its cropped positional
    # table) runs before the first block on the full image.
    return ContextParallelPlan(
        split_inputs={"transformer_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)}},
        gather_outputs={"proj_out": 1},
    )


_BASE = dict(sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
             joint_attention_dim=32, caption_projection_dim=64, pooled_projection_dim=24, out_channels=4,
             pos_embed_max_size=12)
EXAMPLES = {
    "sd3": ("SD3Transformer2DModel", _BASE),
    "sd3.5": ("SD3Transformer2DModel", {**_BASE, "num_layers": 3, "dual_attention_layers": (0, 1),
                                        "qk_norm": "rms_norm"}),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    p = config.patch_size
    return dict(
        hidden_states=torch.randn(batch, config.in_channels, grid.height * p, grid.width * p, generator=generator),
        encoder_hidden_states=torch.randn(batch, grid.text, config.joint_attention_dim, generator=generator),
        pooled_projections=torch.randn(batch, config.pooled_projection_dim, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        return_dict=False,
    )


FAMILY = Family(
    name="sd3",
    model_classes=MODEL_CLASSES,
    tensor_parallel_plan=tensor_parallel_plan,
    context_parallel_plan=context_parallel_plan,
    examples=EXAMPLES,
    example_inputs=example_inputs,
)
