"""Sana and PixArt pipelines: batch CFG (one transformer call on [uncond, cond]) with the text masks batched along.
Their pipelines take sizes in multiples of 32 (Sana) and 8 (PixArt) pixels; with the tiny VAEs' scale factor 2 and
2 x 2 patches every allowed size has an even token count: 32 x 32 pixels, 64 tokens."""

import diffusers

from paradiff_testkit.zoo import Picture, Recipe


def sprint_scheduler(seed: int, parts: dict, config: dict):
    # Sana Sprint's trigonometric-flow sampler (SCM)
    return diffusers.SCMScheduler()


RECIPES = {
    "SanaPipeline": Recipe(family="sana"),
    "SanaPAGPipeline": Recipe(extends="SanaPipeline", call=dict(pag_scale=3.0)),
    # a SanaControlNetModel of the transformer's config (one block); its residuals go into the transformer's blocks
    "SanaControlNetPipeline": Recipe(extends="SanaPipeline", controlnet=dict(num_layers=1),
                                     call=dict(control_image=Picture(32, 32, seed=11),
                                               controlnet_conditioning_scale=0.8)),
    # Sana Sprint: guidance embedded in the transformer, no negative prompt (never guides)
    "SanaSprintPipeline": Recipe(extends="SanaPipeline", components=dict(scheduler=sprint_scheduler),
                                 transformer=dict(guidance_embeds=True, qk_norm="rms_norm_across_heads"),
                                 drop=("negative_prompt",), call=dict(num_inference_steps=2, guidance_scale=4.5)),
    "SanaSprintImg2ImgPipeline": Recipe(extends="SanaSprintPipeline", call=dict(image=Picture(32, 32),
                                                                                strength=0.6)),
    "PixArtSigmaPipeline": Recipe(family="pixart_sigma"),
    "PixArtSigmaPAGPipeline": Recipe(extends="PixArtSigmaPipeline", call=dict(pag_scale=3.0)),
    # PixArt-alpha: the same transformer family, its own pipeline (T5 up to 120 tokens)
    "PixArtAlphaPipeline": Recipe(extends="PixArtSigmaPipeline"),
}
