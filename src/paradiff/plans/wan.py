"""Wan 2.x (`WanTransformer3DModel`): context parallelism (its QK-norm spans all heads, so no TP plan)."""

from ..context_parallel.plan import ContextParallelPlan, Split

MODEL_CLASSES = ("WanTransformer3DModel",)


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={
            "blocks.0": {"hidden_states": Split(1)},
            "": {"timestep": Split(1, ndim=2)},  # Wan 2.2 per-token timesteps
        },
        split_outputs={"rope": {0: Split(1), 1: Split(1)}},
        gather_outputs={"proj_out": 1},
        # attn2 attends to the replicated text (and image) context: local, no communication
        local_attention=("blocks.*.attn2",),
    )
