"""Chroma (`ChromaTransformer2DModel`): FLUX.1's blocks with pruned AdaLN, modulated by one shared approximator
MLP, and a text mask over the joint sequence."""

from paradiff.context_parallel.plan import ContextParallelPlan
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import mlp, split_input
from paradiff.plans.flux import FLUX_INPUTS, flux_blocks, flux_context_plan
from paradiff.plans.family import Family
from paradiff.plans.inputs import Full

MODEL_CLASSES = ("ChromaTransformer2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={
        **flux_blocks(modulation=False),
        # the approximator's residual MLPs (5 x hidden^2 at full size) and its output projection
        **mlp("distilled_guidance_layer.layers.*"),
        **split_input("distilled_guidance_layer.out_proj", "context_embedder"),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    # the blocks turn the whole (text + image) padding mask into a query-dependent mask over the joint sequence,
    # which CP attention takes whole and reorders to the split's token order
    return flux_context_plan()


EXAMPLES = {"chroma": ("ChromaTransformer2DModel", dict(
    in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=4,
    joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=8, approximator_hidden_dim=32,
    approximator_layers=2))}


# a key mask over the joint (text, image) sequence: the last prompt's padding
INPUTS = {**FLUX_INPUTS, "attention_mask": Full(("batch", "text + height * width"), set=(("-1, text - 2:text", 0),))}


FAMILY = Family.of(__name__)
