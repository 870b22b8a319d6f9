"""FLUX.1 (`FluxTransformer2DModel`): how it splits under tensor and context parallelism."""

import torch

from ..context_parallel.plan import ContextParallelPlan, Split
from ..tensor_parallel.plan import TensorParallelPlan
from ..tensor_parallel.styles import PackedRowwise
from .common import Grid, joint_attention

MODEL_CLASSES = ("FluxTransformer2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        # double-stream blocks: Q/K/V and FFN-in colwise, their projections back rowwise
        **joint_attention("transformer_blocks.*.attn"),
        "transformer_blocks.*.ff.net.0.proj": "colwise",
        "transformer_blocks.*.ff.net.2": "rowwise",
        "transformer_blocks.*.ff_context.net.0.proj": "colwise",
        "transformer_blocks.*.ff_context.net.2": "rowwise",
        # AdaLN modulation (dim -> 6 dim) reads the replicated timestep embedding
        "transformer_blocks.*.norm1.linear": "rowwise_split_input",
        "transformer_blocks.*.norm1_context.linear": "rowwise_split_input",
        # single-stream blocks: proj_out consumes [attention (dim), MLP (4 dim)] concatenated
        "single_transformer_blocks.*.attn.to_q": "colwise",
        "single_transformer_blocks.*.attn.to_k": "colwise",
        "single_transformer_blocks.*.attn.to_v": "colwise",
        "single_transformer_blocks.*.proj_mlp": "colwise",
        "single_transformer_blocks.*.proj_out": PackedRowwise(_single_out_blocks),
        "single_transformer_blocks.*.norm.linear": "rowwise_split_input",
        # embeddings and the final modulation
        "context_embedder": "rowwise_split_input",
        "time_text_embed.timestep_embedder.linear_1": "colwise",
        "time_text_embed.timestep_embedder.linear_2": "rowwise",
        "time_text_embed.text_embedder.linear_1": "colwise",
        "time_text_embed.text_embedder.linear_2": "rowwise",
        "norm_out.linear": "rowwise_split_input",
    }
    if config.guidance_embeds:
        styles["time_text_embed.guidance_embedder.linear_1"] = "colwise"
        styles["time_text_embed.guidance_embedder.linear_2"] = "rowwise"
    return TensorParallelPlan(styles=styles)


def _single_out_blocks(config) -> list[int]:
    inner = config.num_attention_heads * config.attention_head_dim
    return [inner, 4 * inner]  # FluxSingleTransformerBlock uses mlp_ratio 4


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={
            "": {
                "hidden_states": Split(1),
                "encoder_hidden_states": Split(1),
                "img_ids": Split(-2),
                "txt_ids": Split(-2),
            }
        },
        gather_outputs={"proj_out": 1},
    )


EXAMPLES = {"flux.1-dev": ("FluxTransformer2DModel", dict(
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=4,
    joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6)))}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    h, w, t = grid.height, grid.width, grid.text
    axes = len(config.axes_dims_rope)
    img_ids = torch.zeros(h * w, axes)
    img_ids[:, -2] = torch.arange(h).repeat_interleave(w)
    img_ids[:, -1] = torch.arange(w).repeat(h)
    txt_ids = torch.zeros(t, axes)
    txt_ids[:, -1] = torch.arange(t)
    inputs = dict(
        hidden_states=torch.randn(batch, h * w, config.in_channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, t, config.joint_attention_dim, generator=generator),
        timestep=torch.rand(batch, generator=generator),
        img_ids=img_ids,
        txt_ids=txt_ids,
        guidance=torch.full((batch,), 3.5),
        return_dict=False,
    )
    inputs["pooled_projections"] = torch.randn(batch, config.pooled_projection_dim, generator=generator)
    return inputs
