"""GLM-Image (`GlmImageTransformer2DModel`): CogView4's joint blocks with a glyph (text) projector and prior image
tokens; how it splits under tensor and context parallelism."""

from paradiff.context_parallel.plan import ContextParallelPlan
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.cogview4 import blocks_plan, joint_context_plan
from paradiff.plans.common import feed_forward
from paradiff.plans.family import Family
from paradiff.plans.inputs import Full, Integers, Noise, Tensor, Uniform

MODEL_CLASSES = ("GlmImageTransformer2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={**blocks_plan(), **feed_forward("glyph_projector"),
                                      **feed_forward("prior_projector")})


def context_parallel_plan(config) -> ContextParallelPlan:
    return joint_context_plan()


EXAMPLES = {
    "glm-image": ("GlmImageTransformer2DModel", dict(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
        text_embed_dim=32, time_embed_dim=32, condition_dim=8, prior_vq_quantizer_codebook_size=64)),
}


INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "height * patch_size", "width * patch_size")),
    encoder_hidden_states=Noise(("batch", "text", "text_embed_dim")),
    prior_token_id=Integers("prior_vq_quantizer_codebook_size", ("batch", "height * width")),
    # the unconditional (last) sample drops its prior tokens
    prior_token_drop=Full(("batch", "height * width"), False, "bool", set=(("-1", True),)),
    timestep=Uniform(1000),
    target_size=Tensor(("height * patch_size * 8.0", "width * patch_size * 8.0"), per_sample=True),
    crop_coords=Full(("batch", 2), 0.0),
    return_dict=False,
)


FAMILY = Family.of(__name__)
