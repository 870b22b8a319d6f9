"""HunyuanVideo FramePack (`HunyuanVideoFramepackTransformer3DModel`): HunyuanVideo's blocks over [4x, 2x and 1x
compressed history tokens, current tokens; image and text tokens]; only the current tokens are predicted."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import hunyuan_video
from paradiff.plans.common import Grid, mlp
from paradiff.plans.family import Family

MODEL_CLASSES = ("HunyuanVideoFramepackTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    plan = hunyuan_video.tensor_parallel_plan(config)
    return TensorParallelPlan(styles={**plan.styles, **mlp("image_projection", "up", "down")})


def context_parallel_plan(config) -> ContextParallelPlan:
    splits = hunyuan_video.block_splits(config)
    # the rotary table of [history, current] tokens is assembled in the model's forward: split where blocks take it
    splits["transformer_blocks.*"] = {**splits["transformer_blocks.*"], "freqs_cis": Split(0)}
    splits["single_transformer_blocks.*"] = {**splits["single_transformer_blocks.*"], "image_rotary_emb": Split(0)}
    return ContextParallelPlan(
        split_inputs=splits,
        # the forward keeps the last `current` tokens right after the blocks: gather the last block's video stream
        gather_outputs={f"single_transformer_blocks.{config.num_single_layers - 1}": {0: 1}},
        local_attention=(hunyuan_video.REFINER_ATTENTION,),
    )


EXAMPLES = {
    "hunyuan-video-framepack": ("HunyuanVideoFramepackTransformer3DModel", {
        **hunyuan_video._BASE, "guidance_embeds": True, "has_image_proj": True, "image_proj_dim": 24,
        "has_clean_x_embedder": True}),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    p = config.patch_size
    height, width = grid.height * p, grid.width * p

    def latents(frames: int) -> torch.Tensor:
        return torch.randn(batch, config.in_channels, frames, height, width, generator=generator)

    def indices(start: int, frames: int) -> torch.Tensor:  # frame positions, shared by the batch
        return torch.arange(start, start + frames)

    # history: 4 frames at 4x compression, 2 at 2x, 2 clean; 45 current + 30 + 6 + 2 history tokens
    return dict(
        hidden_states=latents(grid.frames),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, grid.text, config.text_embed_dim, generator=generator),
        encoder_attention_mask=hunyuan_video.text_mask(batch, grid.text),
        pooled_projections=torch.randn(batch, config.pooled_projection_dim, generator=generator),
        image_embeds=torch.randn(batch, 3, config.image_proj_dim, generator=generator),
        indices_latents=indices(8, grid.frames),
        guidance=torch.full((batch,), 6000.0),
        latents_history_4x=latents(4), indices_latents_history_4x=indices(0, 4),
        latents_history_2x=latents(2), indices_latents_history_2x=indices(4, 2),
        latents_clean=latents(2), indices_latents_clean=indices(6, 2),
        return_dict=False,
    )


FAMILY = Family.of(__name__)
