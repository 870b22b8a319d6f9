"""AuraFlow (`AuraFlowTransformer2DModel`): how it splits under tensor and context parallelism."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.errors import PlanError
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention, joint_attention, mlp, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import image_inputs

MODEL_CLASSES = ("AuraFlowTransformer2DModel",)


def _feed_forward(prefix: str) -> dict[str, str]:
    # AuraFlowFeedForward: silu(linear_1(x)) * linear_2(x), then out_projection
    return {f"{prefix}.linear_1": "colwise", f"{prefix}.linear_2": "colwise", f"{prefix}.out_projection": "rowwise"}


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={
        **joint_attention("joint_transformer_blocks.*.attn"),
        **_feed_forward("joint_transformer_blocks.*.ff"),
        **_feed_forward("joint_transformer_blocks.*.ff_context"),
        **split_input("joint_transformer_blocks.*.norm1.linear", "joint_transformer_blocks.*.norm1_context.linear",
                      "single_transformer_blocks.*.norm1.linear", "context_embedder", "norm_out.linear"),
        **attention("single_transformer_blocks.*.attn"),
        **_feed_forward("single_transformer_blocks.*.ff"),
        **mlp("time_step_proj"),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    # Image and text (with its register tokens) are split at the first joint block. The single blocks run on
    # [text, image] concatenated per rank, and the model slices the image back off by the local text length, so
    # each rank keeps its own image rows in order.
    if config.num_mmdit_layers == 0:
        raise PlanError("AuraFlow's context-parallel plan splits the text at the first joint block, but this config "
                        "has num_mmdit_layers=0; use tensor parallelism, or a config with joint blocks.")
    return ContextParallelPlan(
        split_inputs={"joint_transformer_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)}},
        gather_outputs={"proj_out": 1},
    )


EXAMPLES = {
    "auraflow": ("AuraFlowTransformer2DModel", dict(
        sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=2,
        attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64,
        out_channels=4, pos_embed_max_size=64)),
}


INPUTS = image_inputs("joint_attention_dim")


FAMILY = Family.of(__name__)
