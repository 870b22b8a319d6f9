"""LongCat-Image pipelines: FLUX.1-style blocks on a Qwen2.5-VL prompt (the qwenimage family's tiny encoder and
tokenizer), true CFG as two calls (the prompt's, then the negative prompt's). The pipelines pad every prompt to 512
tokens and always make 16-channel latents, packed 2 x 2 (64 transformer channels).

- LongCatImagePipeline: a two-level VAE (scale factor 2): 44 x 36 pixels are 11 x 9 = 99 image tokens.
- LongCatImageEditPipeline: the input image is resized to a 1024 x 1024 area (and half that for the vision tower)
  whatever its size, and the output takes that size (1120 x 928 for a 48 x 40 input): a six-level VAE (factor 32)
  makes it 35 x 29 = 1015 tokens, and the reference image's 1015 tokens follow them; the Qwen2-VL processor's pixel budget keeps the vision tower's
  input small (the Qwen-Image edit recipes' processor).
"""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily
from paradiff_testkit.zoo.recipes.qwenimage import processor

LATENT_CHANNELS = 16  # the pipelines' own constant


def components(seed: int) -> dict:
    import diffusers

    parts = tiny.family_components("qwenimage", seed)
    return dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), text_encoder=parts["text_encoder"],
                tokenizer=parts["tokenizer"],
                vae=tiny._small_vae(seed, latent_channels=LATENT_CHANNELS, scaling_factor=0.3611, shift_factor=0.1159))


def text_processor(seed: int, parts: dict, config: dict):
    return processor(seed, parts, config)


def edit_vae(seed: int, parts: dict, config: dict):
    return tiny._small_vae(seed, latent_channels=LATENT_CHANNELS, scaling_factor=0.3611, shift_factor=0.1159,
                           down_block_types=("DownEncoderBlock2D",) * 6, up_block_types=("UpDecoderBlock2D",) * 6,
                           block_out_channels=(8,) * 6)


FAMILIES = {
    "longcat_image": TinyFamily(
        transformer_class="LongCatImageTransformer2DModel",
        transformer=dict(in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=1, attention_head_dim=16,
                         num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32,
                         axes_dims_rope=[4, 6, 6]),
        components=components,
        call=dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                  guidance_scale=4.5, num_inference_steps=2, output_type="np", height=44, width=36,
                  enable_prompt_rewrite=False)),  # rewriting generates text with the encoder: not the point here
}

RECIPES = {
    "LongCatImagePipeline": Recipe(family="longcat_image", components=dict(text_processor=text_processor)),
    "LongCatImageEditPipeline": Recipe(extends="LongCatImagePipeline", components=dict(vae=edit_vae),
                                       drop=("height", "width", "enable_prompt_rewrite"),
                                       call=dict(image=Picture(48, 40))),
}
