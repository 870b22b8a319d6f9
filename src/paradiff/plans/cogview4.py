"""CogView4 (`CogView4Transformer2DModel`): how it splits under tensor and context parallelism."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention, feed_forward, mlp, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import Full, Tensor, image_inputs

MODEL_CLASSES = ("CogView4Transformer2DModel",)

TEXT_MASK_REFUSED = (
    "the processor turns the text mask into an attention bias over the [text, image] tokens it sees, which under "
    "context parallelism are the rank's part only; diffusers' pipelines do not pass it. Use tensor parallelism"
)


def blocks_plan() -> dict:
    """CogView4's joint blocks (one attention and one feed-forward shared by text and image, AdaLN of both streams,
    dim -> 12 dim) and embedders, also GLM-Image's."""
    return {
        **attention("transformer_blocks.*.attn1"),
        **feed_forward("transformer_blocks.*.ff"),
        **split_input("transformer_blocks.*.norm1.linear", "norm_out.linear"),
        **mlp("time_condition_embed.timestep_embedder"),
        **mlp("time_condition_embed.condition_embedder"),
    }


def joint_context_plan(**extra) -> ContextParallelPlan:
    """Text and image split at the first block, the image rotary tables at every block; the text mask refused."""
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)},
            "transformer_blocks.*": {"image_rotary_emb": Split(0)},
        },
        gather_outputs={"proj_out": 1},
        unsupported_inputs={"": {"attention_mask": TEXT_MASK_REFUSED, **extra}},
    )


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={**blocks_plan(), "patch_embed.text_proj": "rowwise_split_input"})


def context_parallel_plan(config) -> ContextParallelPlan:
    return joint_context_plan()


EXAMPLES = {
    "cogview4": ("CogView4Transformer2DModel", dict(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
        text_embed_dim=32, time_embed_dim=32, condition_dim=8, rope_axes_dim=(16, 16))),
}


_SIZE = Tensor(("height * patch_size * 8.0", "width * patch_size * 8.0"), per_sample=True)
INPUTS = {**image_inputs("text_embed_dim"), "original_size": _SIZE, "target_size": _SIZE,
          "crop_coords": Full(("batch", 2), 0.0)}


FAMILY = Family.of(__name__)
