"""Helios: Wan's text encoder and VAE around `HeliosTransformer3DModel`; chunk after chunk of latent frames, each
denoised with the chunks before it as long / mid / short history (4x, 2x and 1x patches), HeliosScheduler; the
pyramid pipeline denoises each chunk from a quarter of its size up in three stages.

Tiny: 2 latent frames a chunk (5 frames through the VAE of temporal factor 4: Wan's VAE encodes a video as its first
frame then groups of 4), history sizes [4, 2, 1]; 48 x 48 pixels are 3 x 3 tokens a latent frame (the pyramid: 64 x 64, stages of 1 x 1, 2 x 2 and 4 x 4 tokens a frame)."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily
from paradiff_testkit.zoo.recipes.wan_video import VIDEO, temporal4_vae


def helios_components(seed: int, pyramid: bool = False) -> dict:
    import diffusers

    parts = tiny.family_components("wan", seed)
    # the pyramid's block noise has covariance (1 + gamma) I - gamma over a 2 x 2 patch: positive definite for
    # gamma < 1/3 (the default 1/3 is singular, and fails the Cholesky factorisation in float32 here)
    stages = (dict(stages=3, stage_range=[0, 1 / 3, 2 / 3, 1], gamma=0.25) if pyramid
              else dict(stages=1, stage_range=[0, 1]))
    parts.update(vae=temporal4_vae(seed, {}, {}),
                 scheduler=diffusers.HeliosScheduler(use_dynamic_shifting=True, **stages))
    return parts


def pyramid_components(seed: int) -> dict:
    return helios_components(seed, pyramid=True)


HELIOS = dict(tiny.transformer_config("wan"), rope_dim=(4, 6, 6), has_multi_term_memory_patch=True,
              guidance_cross_attn=True, zero_history_timestep=True, is_amplify_history=True)
CALL = dict(tiny.default_call_kwargs("wan"), height=48, width=48, num_frames=9, history_sizes=[4, 2, 1],
            num_latent_frames_per_chunk=2)

FAMILIES = {
    "helios": TinyFamily(transformer_class="HeliosTransformer3DModel", transformer=HELIOS,
                         components=helios_components, call=CALL),
    "helios_pyramid": TinyFamily(transformer_class="HeliosTransformer3DModel", transformer=HELIOS,
                                 components=pyramid_components,
                                 call=dict({k: v for k, v in CALL.items() if k != "num_inference_steps"}, height=64,
                                           width=64, pyramid_num_inference_steps_list=[1, 1, 1])),
}

RECIPES = {
    # text-to-video in two chunks, the second with the first as history
    "HeliosPipeline": Recipe(family="helios"),
    # image-to-video: the image's latents are the short history's first frame
    "HeliosPipeline@image": Recipe(extends="HeliosPipeline", call=dict(image=Picture(48, 48))),
    # video-to-video: the video's latents fill the history
    "HeliosPipeline@video": Recipe(extends="HeliosPipeline", call=dict(video=VIDEO)),
    "HeliosPyramidPipeline": Recipe(family="helios_pyramid"),
}
