"""PRX pipelines: batch CFG, one transformer call on [uncond, cond] (noise, text, text mask and time batched).

PRX (latent): a T5Gemma encoder (transformers' bare `T5GemmaEncoder`, Gemma's tokenizer learnt locally), the tiny
AutoencoderKL (scale factor 2) and 2 x 2 patches: 44 x 36 pixels are 11 x 9 = 99 image tokens, which 2 and 4 ranks
do not divide. PRX Pixel: no VAE, the transformer denoises RGB pixels through its bottleneck patch embedding with a
resolution embedding, a Qwen3 text encoder; 42 x 38 pixels in 2 x 2 patches are 21 x 19 = 399 tokens. Both calls
turn resolution binning off (its buckets start at 256 pixels) and cap the prompt at 16 tokens."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Recipe, TinyFamily
from paradiff_testkit.zoo.recipes.z_image import qwen3_text_encoder

TEXT_WIDTH = 32
_CALL = dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
             guidance_scale=4.0, num_inference_steps=2, use_resolution_binning=False, output_type="np")


def t5gemma_encoder(seed: int, tokenizer):
    """transformers' bare `T5GemmaEncoder` (model_index.json: ["transformers", "T5GemmaEncoder"], which diffusers'
    PRX package resolves to its wrapper loading the encoder part of an encoder-decoder config), saved as PRX ships
    it: the encoder-decoder config beside the encoder's weights."""
    from transformers import T5GemmaConfig, T5GemmaModuleConfig
    from transformers.models.t5gemma.modeling_t5gemma import T5GemmaEncoder

    module = T5GemmaModuleConfig(
        vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512, sliding_window=512,
        layer_types=["full_attention", "full_attention"], pad_token_id=tokenizer.pad_token_id)
    config = T5GemmaConfig(encoder=module.to_dict(), decoder=module.to_dict(), is_encoder_decoder=False,
                           vocab_size=len(tokenizer))
    with tiny._seeded(seed, 1):
        encoder = T5GemmaEncoder(config.encoder)
    encoder.config = config
    return encoder


def prx_components(seed: int) -> dict:
    import diffusers

    tokenizer = tiny._gemma_tokenizer()
    vae = tiny._small_vae(seed, scaling_factor=0.3611, shift_factor=0.1159)
    return dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
                text_encoder=t5gemma_encoder(seed, tokenizer), tokenizer=tokenizer)


def prx_pixel_components(seed: int) -> dict:
    import diffusers

    tokenizer = tiny._qwen3_chat_tokenizer()
    return dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
                text_encoder=qwen3_text_encoder(seed, tokenizer), tokenizer=tokenizer)


_TRANSFORMER = dict(in_channels=4, patch_size=2, context_in_dim=TEXT_WIDTH, hidden_size=64, mlp_ratio=3.5,
                    num_heads=4, depth=2, axes_dim=[8, 8])

FAMILIES = {
    "prx": TinyFamily(transformer_class="PRXTransformer2DModel", transformer=_TRANSFORMER,
                      components=prx_components,
                      call=dict(_CALL, height=44, width=36, tokenizer_max_length=16)),
    "prx_pixel": TinyFamily(transformer_class="PRXTransformer2DModel",
                            transformer=dict(_TRANSFORMER, in_channels=3, bottleneck_size=24, resolution_embeds=True),
                            components=prx_pixel_components, call=dict(_CALL, height=42, width=38)),
}

RECIPES = {
    "PRXPipeline": Recipe(family="prx"),
    "PRXPixelPipeline": Recipe(family="prx_pixel", init=dict(prompt_max_tokens=16)),
}
