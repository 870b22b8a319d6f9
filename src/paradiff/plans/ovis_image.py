"""Ovis-Image (`OvisImageTransformer2DModel`): FLUX.1's blocks with SwiGLU feed-forwards."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, mlp
from paradiff.plans.flux import flux_blocks, flux_context_plan, flux_inputs
from paradiff.plans.family import Family

MODEL_CLASSES = ("OvisImageTransformer2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(
        styles={
            **flux_blocks(gated=True), **mlp("timestep_embedder"),
            "context_embedder": "rowwise_split_input", "norm_out.linear": "rowwise_split_input",
        },
        # single blocks split their fused [value, gate] MLP projection by their own `mlp_hidden_dim`
        head_modules=("single_transformer_blocks.*",),
    )


def context_parallel_plan(config) -> ContextParallelPlan:
    return flux_context_plan()


EXAMPLES = {"ovis-image": ("OvisImageTransformer2DModel", dict(
    in_channels=16, out_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
    num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)))}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    return flux_inputs(config, batch, grid, generator)


FAMILY = Family.of(__name__)
