"""DiT (`DiTTransformer2DModel`): how it splits under tensor and context parallelism."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention, feed_forward, mlp, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import Integers, Noise

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


INPUTS = dict(
    # DiT infers a square latent from the token count, so the image is width x width patches
    hidden_states=Noise(("batch", "in_channels", "width * patch_size", "width * patch_size")),
    timestep=Integers(1000),
    class_labels=Integers("num_embeds_ada_norm"),
    return_dict=False,
)


FAMILY = Family.of(__name__)
