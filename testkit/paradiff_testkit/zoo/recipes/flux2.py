"""FLUX.2 pipelines: the tiny FLUX.2 VAE (scale factor 2) and 2 x 2 patches per token: 44 x 36 pixels are 99 image
tokens; reference images are encoded to tokens placed after them."""

from paradiff_testkit.zoo import Mask, Picture, Recipe

SIZE = dict(height=44, width=36)
IMAGE, MASK = Picture(**SIZE), Mask(**SIZE)
REFERENCE = Picture(64, 68, seed=9)

RECIPES = {
    "Flux2Pipeline": Recipe(family="flux2", call=SIZE),
    # FLUX.2 with a reference image (64 pixels at least): its 16 x 17 = 272 tokens follow the 99 noise tokens
    "Flux2Pipeline@reference": Recipe(extends="Flux2Pipeline", call=dict(image=REFERENCE)),
    "Flux2KleinPipeline": Recipe(family="flux2_klein", call=SIZE),
    "Flux2KleinInpaintPipeline": Recipe(extends="Flux2KleinPipeline", call=dict(
        image=IMAGE, mask_image=MASK, strength=0.6, num_inference_steps=4)),
    # distilled (no CFG); the reference image's keys and values are computed at the first step and kept
    "Flux2KleinKVPipeline": Recipe(extends="Flux2KleinPipeline", drop=("guidance_scale",),
                                   call=dict(image=REFERENCE, num_inference_steps=3)),
}
