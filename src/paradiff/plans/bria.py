"""Bria 3.x (`BriaTransformer2DModel`): FLUX.1's double- and single-stream blocks."""

from paradiff.context_parallel.plan import ContextParallelPlan
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import mlp
from paradiff.plans.flux import FLUX_INPUTS, flux_blocks, flux_context_plan
from paradiff.plans.family import Family

MODEL_CLASSES = ("BriaTransformer2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={
        **flux_blocks(), **mlp("time_embed.timestep_embedder"),
        "context_embedder": "rowwise_split_input", "norm_out.linear": "rowwise_split_input",
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    return flux_context_plan()


EXAMPLES = {"bria-3.2": ("BriaTransformer2DModel", dict(
    in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=4,
    joint_attention_dim=32, axes_dims_rope=[4, 6, 6]))}


INPUTS = FLUX_INPUTS


FAMILY = Family.of(__name__)
