"""HunyuanVideo FramePack (`HunyuanVideoFramepackTransformer3DModel`): HunyuanVideo's blocks over [4x, 2x and 1x
compressed history tokens, current tokens; image and text tokens]; only the current tokens are predicted."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import hunyuan_video
from paradiff.plans.common import mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Arange, Dim, Full, Noise, Uniform

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


def _latents(frames: Dim) -> Noise:
    return Noise(("batch", "in_channels", frames, "height * patch_size", "width * patch_size"))


# history: 4 frames at 4x compression, 2 at 2x, 2 clean; 45 current + 30 + 6 + 2 history tokens. Frame positions
# (indices) are shared by the batch.
INPUTS = dict(
    hidden_states=_latents("frames"),
    timestep=Uniform(1000),
    encoder_hidden_states=Noise(("batch", "text", "text_embed_dim")),
    encoder_attention_mask=hunyuan_video.TEXT_MASK,
    pooled_projections=Noise(("batch", "pooled_projection_dim")),
    image_embeds=Noise(("batch", 3, "image_proj_dim")),
    indices_latents=Arange("8 + frames", start=8),
    guidance=Full(("batch",), 6000.0),
    latents_history_4x=_latents(4), indices_latents_history_4x=Arange(4),
    latents_history_2x=_latents(2), indices_latents_history_2x=Arange(6, start=4),
    latents_clean=_latents(2), indices_latents_clean=Arange(8, start=6),
    return_dict=False,
)


FAMILY = Family.of(__name__)
