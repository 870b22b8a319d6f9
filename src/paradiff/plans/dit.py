"""DiT (`DiTTransformer2DModel`): how it splits under tensor and context parallelism."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, attention, feed_forward, mlp, split_input
from paradiff.plans.family import Family

MODEL_CLASSES = ("DiTTransformer2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={
        **attention("transformer_blocks.*.attn1"),
        **feed_forward("transformer_blocks.*.ff"),
        # every block embeds the timestep (and class label) itself, then modulates dim -> 6 dim
        **mlp("transformer_blocks.*.norm1.emb.timestep_embedder"),
        **split_input("transformer_blocks.*.norm1.linear", "proj_out_1"),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={"transformer_blocks.0": {"hidden_states": Split(1)}},
        gather_outputs={"proj_out_2": 1},
    )


# the forward computes its output modulation with block 0's embedder after the blocks ran
FSDP_OWN_UNITS = ("transformer_blocks.0.norm1.emb",)

EXAMPLES = {
    "dit": ("DiTTransformer2DModel", dict(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, num_layers=2, sample_size=10,
        patch_size=2, num_embeds_ada_norm=10)),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    # DiT infers a square latent from the token count, so the image is grid.width x grid.width patches
    side = grid.width * config.patch_size
    return dict(
        hidden_states=torch.randn(batch, config.in_channels, side, side, generator=generator),
        timestep=torch.randint(0, 1000, (batch,), generator=generator),
        class_labels=torch.randint(0, config.num_embeds_ada_norm, (batch,), generator=generator),
        return_dict=False,
    )


FAMILY = Family.of(__name__)
