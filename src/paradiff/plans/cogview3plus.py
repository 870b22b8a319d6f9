"""CogView3-Plus (`CogView3PlusTransformer2DModel`): how it splits under tensor and context parallelism."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention, feed_forward, mlp, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import Full, Tensor, image_inputs

MODEL_CLASSES = ("CogView3PlusTransformer2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    # one attention and one feed-forward over [text, image]; the AdaLN modulates both streams (dim -> 12 dim)
    return TensorParallelPlan(styles={
        **attention("transformer_blocks.*.attn1"),
        **feed_forward("transformer_blocks.*.ff"),
        **split_input("transformer_blocks.*.norm1.linear", "patch_embed.text_proj", "norm_out.linear"),
        **mlp("time_condition_embed.timestep_embedder"),
        **mlp("time_condition_embed.condition_embedder"),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={"transformer_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)}},
        gather_outputs={"proj_out": 1},
    )


EXAMPLES = {
    "cogview3plus": ("CogView3PlusTransformer2DModel", dict(
        patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4, out_channels=4,
        text_embed_dim=32, time_embed_dim=32, condition_dim=8, pos_embed_max_size=16, sample_size=16)),
}


_SIZE = Tensor(("height * patch_size * 8.0", "width * patch_size * 8.0"), per_sample=True)
INPUTS = {**image_inputs("text_embed_dim"), "original_size": _SIZE, "target_size": _SIZE,
          "crop_coords": Full(("batch", 2), 0.0)}


FAMILY = Family.of(__name__)
