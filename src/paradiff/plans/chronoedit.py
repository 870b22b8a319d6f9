"""ChronoEdit (`ChronoEditTransformer3DModel`): Wan 2.1 I2V's architecture; its rotary table skips to the last of
`rope_temporal_skip_len` temporal positions when given two frames (input image and edited image)."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import wan
from paradiff.plans.common import Grid
from paradiff.plans.family import Family

MODEL_CLASSES = ("ChronoEditTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return wan.tensor_parallel_plan(config)


def context_parallel_plan(config) -> ContextParallelPlan:
    return wan.context_parallel_plan(config)


_BASE = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
             text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64, image_dim=24,
             added_kv_proj_dim=64, rope_temporal_skip_len=4)
EXAMPLES = {
    "chronoedit": ("ChronoEditTransformer3DModel", _BASE),
    # two frames take the temporal-skip rotary path; 2 x 21 x 5 tokens, which 4 ranks do not divide
    "chronoedit-two-frames": ("ChronoEditTransformer3DModel", _BASE),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    p_t, p_h, p_w = config.patch_size
    # 512 replicated text tokens: enough video tokens that the split work dominates (see wan2.1-i2v)
    frames = 2 if name == "chronoedit-two-frames" else grid.frames
    height = grid.height * (7 if frames == 2 else 5)
    return dict(
        hidden_states=torch.randn(batch, config.in_channels, frames * p_t, height * p_h, grid.width * p_w,
                                  generator=generator),
        encoder_hidden_states=torch.randn(batch, 512, config.text_dim, generator=generator),
        encoder_hidden_states_image=torch.randn(batch, 4, config.image_dim, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        return_dict=False,
    )


FAMILY = Family.of(__name__)
