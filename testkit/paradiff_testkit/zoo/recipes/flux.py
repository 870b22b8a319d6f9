"""FLUX.1 and Chroma pipelines. The tiny FLUX.1 VAE has a scale factor of 2 and the pipelines pack 2 x 2 latents
per token: 44 x 36 pixels are 11 x 9 = 99 image tokens, a count two (and four) ranks do not divide."""

from paradiff_testkit.zoo import Mask, Picture, Recipe

SIZE = dict(height=44, width=36)
IMAGE, MASK = Picture(**SIZE), Mask(**SIZE)
CONTROL = Picture(**SIZE, seed=11)
LATENT_TOKENS = 16  # 4 latent channels x 2 x 2 packed
# img2img and inpaint: strength 0.6 of 4 steps leaves 2
PARTIAL = dict(strength=0.6, num_inference_steps=4)
# true CFG (two transformer calls a step) on the pipelines that offer it
TRUE_CFG = dict(negative_prompt="blurry, low quality", true_cfg_scale=2.0)
NO_TRUE_CFG = ("negative_prompt", "true_cfg_scale")



def chroma_transformer_saying_no_guidance_embeds(seed: int, parts: dict, config: dict):
    """The family's Chroma transformer whose config also says `guidance_embeds: false`. diffusers 0.42.1's
    ChromaInpaintPipeline reads `transformer.config.guidance_embeds`, a key ChromaTransformer2DModel's config does
    not define (the call raises AttributeError without it); diffusers keeps a config.json key the class does not
    take as a hidden config entry, so a folder whose transformer config carries it (as this one's does) runs."""
    transformer = parts["transformer"]
    transformer.register_to_config(guidance_embeds=False)
    return transformer


RECIPES = {
    "FluxPipeline": Recipe(family="flux", call=dict(SIZE, **TRUE_CFG)),
    "FluxImg2ImgPipeline": Recipe(extends="FluxPipeline", call=dict(image=IMAGE, **PARTIAL)),
    "FluxInpaintPipeline": Recipe(extends="FluxImg2ImgPipeline", call=dict(mask_image=MASK)),
    # the reference image's 9 x 7 = 63 packed tokens follow the 99 noise tokens
    "FluxKontextPipeline": Recipe(extends="FluxPipeline", call=dict(image=Picture(36, 28), _auto_resize=False,
                                                                    max_area=44 * 36)),
    "FluxKontextInpaintPipeline": Recipe(extends="FluxPipeline", call=dict(
        image=IMAGE, mask_image=MASK, image_reference=Picture(36, 28, seed=9), _auto_resize=False,
        max_area=44 * 36, **PARTIAL)),
    # FLUX.1 Fill: the transformer reads noise, masked-image latents and the packed mask (scale factor 2: 2 x 2
    # mask channels, packed 16) side by side: 48 channels in, 16 out
    "FluxFillPipeline": Recipe(extends="FluxPipeline", transformer=dict(in_channels=3 * LATENT_TOKENS,
                                                                        out_channels=LATENT_TOKENS),
                               drop=NO_TRUE_CFG, call=dict(image=IMAGE, mask_image=MASK, guidance_scale=30.0)),
    # FLUX.1 Control (Canny / Depth): the control image's latents beside the noise, 32 channels in
    "FluxControlPipeline": Recipe(extends="FluxPipeline", transformer=dict(in_channels=2 * LATENT_TOKENS,
                                                                           out_channels=LATENT_TOKENS),
                                  drop=NO_TRUE_CFG, call=dict(control_image=CONTROL, guidance_scale=10.0)),
    "FluxControlImg2ImgPipeline": Recipe(extends="FluxControlPipeline", call=dict(image=IMAGE, **PARTIAL)),
    "FluxControlInpaintPipeline": Recipe(extends="FluxControlImg2ImgPipeline", call=dict(mask_image=MASK)),
    # a FluxControlNetModel of the transformer's config (built from the pipeline's annotation)
    "FluxControlNetPipeline": Recipe(extends="FluxPipeline", call=dict(control_image=CONTROL,
                                                                       controlnet_conditioning_scale=0.8)),
    "FluxControlNetImg2ImgPipeline": Recipe(extends="FluxControlNetPipeline", drop=NO_TRUE_CFG,
                                            call=dict(image=IMAGE, **PARTIAL)),
    "FluxControlNetInpaintPipeline": Recipe(extends="FluxControlNetImg2ImgPipeline", call=dict(mask_image=MASK)),
    # Chroma: FLUX.1 packing, real CFG against the negative prompt (two calls)
    "ChromaPipeline": Recipe(family="chroma", call=SIZE),
    "ChromaImg2ImgPipeline": Recipe(extends="ChromaPipeline", call=dict(image=IMAGE, **PARTIAL)),
    "ChromaInpaintPipeline": Recipe(extends="ChromaImg2ImgPipeline", call=dict(mask_image=MASK, true_cfg_scale=2.0),
                                    components={"transformer": chroma_transformer_saying_no_guidance_embeds}),
}
