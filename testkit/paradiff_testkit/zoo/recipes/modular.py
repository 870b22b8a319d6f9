"""Modular Diffusers pipelines built from the zoo's standard recipes (`ModularRecipe(standard=...)`: the standard
tiny pipeline loaded through `ModularPipeline.from_pretrained`), and Krea 2 Turbo, which diffusers ships only as a
modular pipeline (built here at the sizes of diffusers' own Krea 2 tests, with a Qwen3-VL text encoder deep enough for
the layers the modular text step stacks).

A guided modular pipeline's guidance scale is its guider component's (ClassifierFreeGuidance), not an argument of
the call: the standard call's `guidance_scale` / `true_cfg_scale` are dropped there (and `guider=` sets the guider
where the blocks' default does not guide); a guidance-distilled one (FLUX.1, FLUX.2, Klein) keeps `guidance_scale`
where its transformer embeds it, and takes no negative prompt."""

import torch

from paradiff_testkit.zoo import ModularRecipe

GUIDER_SCALES = ("guidance_scale", "true_cfg_scale")
NO_TRUE_CFG = ("negative_prompt", "true_cfg_scale")


def krea2_turbo(seed: int):
    from diffusers.modular_pipelines import Krea2TurboModularPipeline

    return _krea2(seed, Krea2TurboModularPipeline)


def krea2(seed: int):
    from diffusers.modular_pipelines import Krea2ModularPipeline

    return _krea2(seed, Krea2ModularPipeline)


def _krea2(seed: int, cls: type):
    """Krea 2 at the sizes of diffusers' own tests: the modular text step stacks fixed layers of the Qwen3-VL text
    encoder (up to the 35th), deeper than the standard Krea 2 recipe's."""
    import diffusers
    from diffusers.modular_pipelines.krea2.encoders import KREA2_TEXT_ENCODER_SELECT_LAYERS

    from paradiff_testkit.pipelines import _qwen2_tokenizer, _seeded
    from paradiff_testkit.zoo.recipes.image_misc import krea2_text_encoder

    tokenizer = _qwen2_tokenizer()
    # hidden_states[0] is the embedding output
    text_encoder = krea2_text_encoder(seed, tokenizer, max(KREA2_TEXT_ENCODER_SELECT_LAYERS))
    with _seeded(seed, 0):
        transformer = diffusers.Krea2Transformer2DModel(
            in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=32, timestep_embed_dim=8, text_hidden_dim=16,
            num_text_layers=len(KREA2_TEXT_ENCODER_SELECT_LAYERS), text_num_attention_heads=2,
            text_num_key_value_heads=1, text_intermediate_size=16, num_layerwise_text_blocks=1,
            num_refiner_text_blocks=1, axes_dims_rope=(4, 2, 2), rope_theta=1000.0,
        ).eval()
        with torch.no_grad():  # diffusers zero-initialises some projections: perturb everything
            for param in transformer.parameters():
                param.add_(torch.randn_like(param) * 0.05)
    with _seeded(seed, 3):
        # one spatial downsampling: 32 x 32 pixels are 16 x 16 latents, 64 tokens of 2 x 2 patches
        vae = diffusers.AutoencoderKLQwenImage(
            base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[False],
            latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.1, 0.9, 1.3, 1.0],
        ).eval()
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400)
    pipe = cls()  # its default blocks
    pipe.update_components(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                           scheduler=scheduler)
    return pipe


RECIPES = {
    # FLUX.1 [dev] style: the embedded guidance scale, no true CFG
    "FluxModularPipeline": ModularRecipe(standard="FluxPipeline", drop=NO_TRUE_CFG),
    # the reference image's 63 packed tokens after the 99 noise tokens
    "FluxKontextModularPipeline": ModularRecipe(standard="FluxKontextPipeline", drop=NO_TRUE_CFG),
    "Flux2ModularPipeline": ModularRecipe(standard="Flux2Pipeline"),
    # FLUX.2 Klein: the distilled class runs no guidance, the base class guides through its guider (scale 4)
    "Flux2KleinModularPipeline": ModularRecipe(standard="Flux2KleinPipeline", drop=GUIDER_SCALES),
    "Flux2KleinBaseModularPipeline": ModularRecipe(standard="Flux2KleinPipeline", drop=GUIDER_SCALES),
    "QwenImageModularPipeline": ModularRecipe(standard="QwenImagePipeline", drop=GUIDER_SCALES),
    "QwenImageEditModularPipeline": ModularRecipe(standard="QwenImageEditPipeline",
                                                  drop=GUIDER_SCALES + ("max_sequence_length",)),
    "QwenImageEditPlusModularPipeline": ModularRecipe(standard="QwenImageEditPlusPipeline",
                                                      drop=GUIDER_SCALES + ("max_sequence_length",)),
    "QwenImageLayeredModularPipeline": ModularRecipe(standard="QwenImageLayeredPipeline", drop=GUIDER_SCALES),
    # its guider's default scale is 1 (no guidance)
    "QwenImage21ModularPipeline": ModularRecipe(standard="QwenImage21Pipeline", drop=GUIDER_SCALES,
                                                guider=dict(guidance_scale=4.0)),
    "StableDiffusion3ModularPipeline": ModularRecipe(standard="StableDiffusion3Pipeline", drop=GUIDER_SCALES),
    # its guider is disabled by default (Z-Image Turbo); its size check reads the default image processor's factor
    # (16), whatever the VAE's
    "ZImageModularPipeline": ModularRecipe(standard="ZImagePipeline", drop=GUIDER_SCALES,
                                           call=dict(height=48, width=64),
                                           guider=dict(enabled=True, guidance_scale=5.0)),
    "ErnieImageModularPipeline": ModularRecipe(standard="ErnieImagePipeline", drop=GUIDER_SCALES + ("use_pe",)),
    # asymmetric CFG through a second transformer, no guider: CFG parallelism refuses it (plans/pipelines.py); its
    # guidance scale is a schedule, one per step
    "Ideogram4ModularPipeline": ModularRecipe(standard="Ideogram4Pipeline", drop=GUIDER_SCALES,
                                              call=dict(guidance_schedule=[3.0, 3.0])),
    # its guider: ClassifierFreeGuidance at 4.5
    "Krea2ModularPipeline": ModularRecipe(build=krea2, call=dict(
        prompt="a small red fox running through the snow", negative_prompt="blurry, low quality", height=32,
        width=32, num_inference_steps=2, max_sequence_length=16, output_type="np")),
    "WanModularPipeline": ModularRecipe(standard="WanPipeline", drop=GUIDER_SCALES, output="videos"),
    "Krea2TurboModularPipeline": ModularRecipe(build=krea2_turbo, call=dict(
        prompt="a small red fox running through the snow", height=32, width=32, num_inference_steps=2,
        max_sequence_length=16, output_type="np")),
}
