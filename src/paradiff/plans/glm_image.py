"""GLM-Image (`GlmImageTransformer2DModel`): CogView4's joint blocks with a glyph (text) projector and prior image
tokens; how it splits under tensor and context parallelism."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.cogview4 import blocks_plan, joint_context_plan
from paradiff.plans.common import Grid, feed_forward
from paradiff.plans.family import Family

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


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    p = config.patch_size
    tokens = grid.height * grid.width
    prior_drop = torch.zeros(batch, tokens, dtype=torch.bool)
    prior_drop[-1] = True  # the unconditional sample drops its prior tokens
    return dict(
        hidden_states=torch.randn(batch, config.in_channels, grid.height * p, grid.width * p, generator=generator),
        encoder_hidden_states=torch.randn(batch, grid.text, config.text_embed_dim, generator=generator),
        prior_token_id=torch.randint(0, config.prior_vq_quantizer_codebook_size, (batch, tokens), generator=generator),
        prior_token_drop=prior_drop,
        timestep=torch.rand(batch, generator=generator) * 1000,
        target_size=torch.tensor([[grid.height * p * 8.0, grid.width * p * 8.0]] * batch),
        crop_coords=torch.zeros(batch, 2),
        return_dict=False,
    )


FAMILY = Family.of(__name__)
