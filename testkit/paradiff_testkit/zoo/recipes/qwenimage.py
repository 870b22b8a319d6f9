"""Qwen-Image pipelines: true CFG (the prompt's call, then the negative prompt's). The tiny Qwen-Image VAE has a
scale factor of 2 and the pipelines pack 2 x 2 latents per token: 44 x 36 pixels are 11 x 9 = 99 image tokens.

The edit pipelines resize the input image to a 1024 x 1024 area for the VAE (and 384 x 384 for the vision
encoder, Edit Plus) whatever the output size: their recipes use a five-level VAE (scale factor 16, so the reference
image is 32 x 32 = 1024 tokens) and a Qwen2-VL processor whose pixel budget keeps the vision tower's input at 64 x 64
pixels (the tiny Qwen2.5-VL's vision tower: 4 x 4 patches, 2 x 2 merged: 64 image tokens in the prompt). The
processor is `TinyQwen2VLProcessor` (zoo/processors.py: transformers cannot build a Qwen2VLProcessor without
torchvision, which this environment lacks)."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Mask, Picture, Recipe

SIZE = dict(height=44, width=36)
IMAGE, MASK = Picture(**SIZE), Mask(**SIZE)
PARTIAL = dict(strength=0.6, num_inference_steps=4)
# the edit outputs: multiples of 32 pixels (scale factor 16 x 2 x 2 packing): 96 x 160 pixels are 3 x 5 = 15 tokens
EDIT_SIZE = dict(height=96, width=160)
LATENT_CHANNELS = 4


def edit_vae(seed: int, parts: dict, config: dict):
    import diffusers

    with tiny._seeded(seed, 3):
        return diffusers.AutoencoderKLQwenImage(
            base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
            temperal_downsample=[False, False, False, False], latents_mean=tiny._latent_stats(seed, 0.0),
            latents_std=tiny._latent_stats(seed, 1.0))


def processor(seed: int, parts: dict, config: dict):
    """The family's tokenizer with a Qwen2-VL image processor matching the tiny vision tower."""
    from transformers import Qwen2VLImageProcessor

    from paradiff_testkit.zoo.processors import TinyQwen2VLProcessor

    vision = parts["text_encoder"].config.vision_config
    side = vision.patch_size * vision.spatial_merge_size
    images = Qwen2VLImageProcessor(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                   merge_size=vision.spatial_merge_size, min_pixels=(4 * side) ** 2,
                                   max_pixels=(8 * side) ** 2)
    return TinyQwen2VLProcessor(image_processor=images, tokenizer=parts["tokenizer"])


EDIT = dict(vae=edit_vae, processor=processor)

RECIPES = {
    "QwenImagePipeline": Recipe(family="qwenimage", call=SIZE),
    "QwenImageImg2ImgPipeline": Recipe(extends="QwenImagePipeline", call=dict(image=IMAGE, **PARTIAL)),
    "QwenImageInpaintPipeline": Recipe(extends="QwenImageImg2ImgPipeline", call=dict(mask_image=MASK)),
    # a QwenImageControlNetModel of the transformer's config; the control image's latents at its embedder
    "QwenImageControlNetPipeline": Recipe(extends="QwenImagePipeline", call=dict(
        control_image=Picture(**SIZE, seed=11), controlnet_conditioning_scale=0.8)),
    # the control image's latents and its mask (one channel, packed 2 x 2: four more) into the ControlNet
    "QwenImageControlNetInpaintPipeline": Recipe(
        extends="QwenImageControlNetPipeline", controlnet=dict(extra_condition_channels=4),
        call=dict(control_mask=Mask(**SIZE))),
    # the reference image's tokens follow the noise tokens, and the vision encoder reads it with the prompt
    "QwenImageEditPipeline": Recipe(extends="QwenImagePipeline", components=EDIT,
                                    call=dict(EDIT_SIZE, image=Picture(48, 40))),
    "QwenImageEditInpaintPipeline": Recipe(extends="QwenImageEditPipeline", call=dict(
        image=Picture(**EDIT_SIZE), mask_image=Mask(**EDIT_SIZE), **PARTIAL)),
    # two reference images
    "QwenImageEditPlusPipeline": Recipe(extends="QwenImageEditPipeline", call=dict(
        image=[Picture(48, 40), Picture(40, 48, seed=9)])),
    # the image decomposed into layers: one frame per layer and the input's, a 3D rotary layout, the RGB
    # condition's extra timestep embedding; resolution 640 (the smaller bucket)
    "QwenImageLayeredPipeline": Recipe(
        extends="QwenImageEditPipeline", transformer=dict(use_additional_t_cond=True, use_layer3d_rope=True),
        drop=("height", "width"), call=dict(image=Picture(48, 40), layers=2, resolution=640)),
}
