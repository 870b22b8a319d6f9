"""Bria FIBO (`BriaFiboTransformer2DModel`): FLUX.1's blocks, where every block replaces half of the text features
with its own projection of one text-encoder layer."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import mlp
from paradiff.plans.flux import FLUX_INPUTS, flux_blocks, flux_context_plan
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Repeat

MODEL_CLASSES = ("BriaFiboTransformer2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        **flux_blocks(), **mlp("time_embed.timestep_embedder"),
        # per-block text-layer projections feed a concatenation every rank needs whole
        "caption_projection.*.linear": "rowwise_split_input",
        "context_embedder": "rowwise_split_input", "norm_out.linear": "rowwise_split_input",
    }
    if config.guidance_embeds:
        styles.update(mlp("guidance_embed.timestep_embedder"))
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    plan = flux_context_plan()
    plan.split_inputs[""]["text_encoder_layers"] = Split(1)  # a list: each layer's text tokens split like the text
    # the pipeline's [text, image] key mask (batch, 1, 1, keys) when a prompt is padded: each stream's part split
    plan.split_inputs[""]["joint_attention_kwargs"] = Split(3, parts=("encoder_hidden_states", "hidden_states"))
    return plan


EXAMPLES = {"bria-fibo": ("BriaFiboTransformer2DModel", dict(
    in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=4,
    joint_attention_dim=32, axes_dims_rope=[4, 6, 6], text_encoder_dim=24))}


INPUTS = {**FLUX_INPUTS, "text_encoder_layers": Repeat(Noise(("batch", "text", "text_encoder_dim")),
                                                       "num_layers + num_single_layers")}


FAMILY = Family.of(__name__)
