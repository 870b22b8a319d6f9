"""Stable Diffusion 3 pipelines: batch CFG (one call on [uncond, cond]). The tiny SD3 VAE has a scale factor of 2
and the transformer 2 x 2 patches: 44 x 36 pixels are 11 x 9 = 99 image tokens. The ControlNet pipeline takes
multiples of 8 pixels only: a three-level VAE (factor 4) makes 40 x 56 pixels 5 x 7 = 35 tokens."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Mask, Picture, Recipe

SIZE = dict(height=44, width=36)
IMAGE, MASK = Picture(**SIZE), Mask(**SIZE)
PARTIAL = dict(strength=0.6, num_inference_steps=4)
CONTROL_SIZE = dict(height=40, width=56)


def factor4_vae(seed: int, parts: dict, config: dict):
    return tiny._small_vae(seed, scaling_factor=1.5305, shift_factor=0.0609,
                           down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                           block_out_channels=(8, 16, 16))


def latent16_vae(seed: int, parts: dict, config: dict):
    return tiny._small_vae(seed, scaling_factor=1.5305, shift_factor=0.0609, latent_channels=16)


RECIPES = {
    "StableDiffusion3Pipeline": Recipe(family="sd3", call=SIZE),
    "StableDiffusion3Img2ImgPipeline": Recipe(extends="StableDiffusion3Pipeline", call=dict(image=IMAGE, **PARTIAL)),
    # the inpainting pipeline accepts SD3's own latent width only (16 channels, or 33 for an inpainting model)
    "StableDiffusion3InpaintPipeline": Recipe(
        extends="StableDiffusion3Img2ImgPipeline", components=dict(vae=latent16_vae),
        transformer=dict(in_channels=16, out_channels=16), call=dict(mask_image=MASK)),
    # the ControlNet runs on the same [uncond, cond] batch; its residuals reach the transformer batched too
    "StableDiffusion3ControlNetPipeline": Recipe(
        extends="StableDiffusion3Pipeline", components=dict(vae=factor4_vae),
        call=dict(CONTROL_SIZE, control_image=Picture(**CONTROL_SIZE, seed=11), controlnet_conditioning_scale=0.8)),
    # the control image's latents and its mask (one extra channel) go into the ControlNet's patch embedding
    "StableDiffusion3ControlNetInpaintingPipeline": Recipe(
        extends="StableDiffusion3ControlNetPipeline", controlnet=dict(extra_conditioning_channels=1),
        call=dict(control_mask=Mask(**CONTROL_SIZE))),
    # perturbed-attention guidance: [uncond, cond, perturbed] in one call, the perturbed branch's attention in
    # the second block an identity
    "StableDiffusion3PAGPipeline": Recipe(extends="StableDiffusion3Pipeline", call=dict(pag_scale=3.0)),
    "StableDiffusion3PAGImg2ImgPipeline": Recipe(extends="StableDiffusion3PAGPipeline",
                                                 call=dict(image=IMAGE, **PARTIAL)),
}
