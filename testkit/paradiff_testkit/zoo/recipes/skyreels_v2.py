"""SkyReels-V2: Wan's components (UMT5, Wan VAE, UniPC) around `SkyReelsV2Transformer3DModel`; text-to-video,
image-to-video (CLIP image tokens, first / last frame) and diffusion forcing (a noise level per latent frame:
synchronous, asynchronous with block-causal attention, long videos in overlapping windows), conditioned on an
image or a video.

Sizes as in wan_video: 48 x 48 pixels are 3 x 3 tokens a latent frame, 5 frames 3 latent frames (27 tokens)."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily
from paradiff_testkit.zoo.recipes.wan_video import (
    I2V_IN, IMAGE, SIZE, VIDEO, clip_image_processor, clip_vision_projection, factor8_vae)


def wan_components(seed: int) -> dict:
    """The tiny Wan family's tokenizer, UMT5 and UniPC scheduler, and the factor-8 Wan VAE."""
    return dict(tiny.family_components("wan", seed), vae=factor8_vae(seed, {}, {}))


FAMILIES = {"skyreels_v2": TinyFamily(transformer_class="SkyReelsV2Transformer3DModel",
                                      transformer=tiny.transformer_config("wan"), components=wan_components,
                                      call=tiny.default_call_kwargs("wan"))}
# the fps embedding (16 or 24 fps) added to the time embedding: the diffusion-forcing pipelines pass `fps`
WITH_FPS = dict(inject_sample_info=True)

RECIPES = {
    "SkyReelsV2Pipeline": Recipe(family="skyreels_v2", call=dict(SIZE, guidance_scale=6.0)),
    # the image's latents and a first-frame mask beside the noise, its CLIP tokens (with projection) before the text;
    # the class annotates a CLIPProcessor, of which the call uses only the image processor (given here alone)
    "SkyReelsV2ImageToVideoPipeline": Recipe(
        family="skyreels_v2", components=dict(image_encoder=clip_vision_projection,
                                      image_processor=clip_image_processor),
        transformer=dict(in_channels=I2V_IN, image_dim=24, added_kv_proj_dim=64),
        call=dict(SIZE, image=IMAGE, max_sequence_length=512)),
    # synchronous diffusion forcing: one noise level per latent frame, all frames moving together
    "SkyReelsV2DiffusionForcingPipeline": Recipe(family="skyreels_v2", transformer=WITH_FPS,
                                                 call=dict(SIZE, guidance_scale=6.0, fps=16)),
    # asynchronous: each latent frame one step behind the previous (more steps, a window of frames per step) under
    # block-causal self-attention (blocks of one latent frame)
    "SkyReelsV2DiffusionForcingPipeline@async": Recipe(
        extends="SkyReelsV2DiffusionForcingPipeline", call=dict(ar_step=1, causal_block_size=1)),
    # a long video: 9 frames (5 latent frames) in windows of 3 latent frames overlapping by 1
    "SkyReelsV2DiffusionForcingPipeline@long": Recipe(
        extends="SkyReelsV2DiffusionForcingPipeline", call=dict(num_frames=9, base_num_frames=5, overlap_history=1)),
    # the image's latents are the first latent frame (clean, timestep 0)
    "SkyReelsV2DiffusionForcingImageToVideoPipeline": Recipe(
        family="skyreels_v2", transformer=WITH_FPS,
        call=dict(SIZE, image=IMAGE, guidance_scale=5.0, fps=16)),
    # first and last frame
    "SkyReelsV2DiffusionForcingImageToVideoPipeline@flf2v": Recipe(
        extends="SkyReelsV2DiffusionForcingImageToVideoPipeline", call=dict(last_image=Picture(48, 48, seed=9))),
    # extending a 5-frame video by windows overlapping its last frames
    "SkyReelsV2DiffusionForcingVideoToVideoPipeline": Recipe(
        family="skyreels_v2", transformer=WITH_FPS,
        call=dict(SIZE, video=VIDEO, num_frames=9, base_num_frames=5, overlap_history=3, guidance_scale=6.0, fps=16)),
}
