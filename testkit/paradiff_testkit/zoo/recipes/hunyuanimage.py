"""HunyuanImage 2.1: Qwen2.5-VL (the hidden states two layers from the top, its system prompt's first 34 tokens
dropped, prompts padded to 1000 tokens) and a ByT5 encoder for the quoted text of a prompt (a glyph prompt:
"... says \"paradiff\""), the HunyuanImage VAE (factor 8, 32 x 48 pixels: 4 x 6 tokens of 1 x 1 patches; the
pipeline takes multiples of 16 pixels only, so the token counts are even), guidance through its guider components
(AdaptiveProjectedMixGuidance: one transformer call per branch; the prompt's quoted text selects `ocr_guider`)."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily


def byt5_encoder(seed: int):
    from transformers import T5Config, T5EncoderModel

    with tiny._seeded(seed, 2):
        return T5EncoderModel(T5Config(
            d_model=24, d_kv=8, d_ff=48, num_layers=2, num_heads=2, relative_attention_num_buckets=8,
            relative_attention_max_distance=32, vocab_size=384, feed_forward_proj="gated-gelu",
            dense_act_fn="gelu_new", is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False))


def components(seed: int) -> dict:
    import diffusers
    from transformers import ByT5Tokenizer

    qwen = tiny.family_components("qwenimage", seed)
    vae = tiny.random_model(diffusers.AutoencoderKLHunyuanImage, dict(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 32, 64, 64), layers_per_block=1,
        scaling_factor=0.476986, spatial_compression_ratio=8, sample_size=128), seed, 3)
    return dict(text_encoder=qwen["text_encoder"], tokenizer=qwen["tokenizer"], text_encoder_2=byt5_encoder(seed),
                tokenizer_2=ByT5Tokenizer(), vae=vae, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
                guider=diffusers.AdaptiveProjectedMixGuidance(guidance_scale=3.5,
                                                              adaptive_projected_guidance_start_step=1),
                ocr_guider=diffusers.AdaptiveProjectedMixGuidance(guidance_scale=3.5,
                                                                  adaptive_projected_guidance_start_step=1))


FAMILIES = {
    "hunyuanimage": TinyFamily(
        transformer_class="HunyuanImageTransformer2DModel",
        transformer=dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=1,
                         num_single_layers=2, num_refiner_layers=1, patch_size=(1, 1), text_embed_dim=32,
                         text_embed_2_dim=24, rope_axes_dim=(8, 8)),
        components=components,
        call=dict(prompt='a small red fox holding a sign that says "paradiff"', negative_prompt="blurry, low quality",
                  height=32, width=48, num_inference_steps=3, distilled_guidance_scale=None, output_type="np")),
}

RECIPES = {"HunyuanImagePipeline": Recipe(family="hunyuanimage")}


# --- the refiner ------------------------------------------------------------------------------------------------------
# Its own 3-D VAE (factor 8 in space; the image is encoded as a frame repeated, two latent frames folded into twice
# the channels: 8), the noise latents beside the image's (16 transformer input channels, 1 x 1 x 1 patches),
# guidance-distilled (`distilled_guidance_scale`) and guided through its guider too, Qwen2.5-VL only (prompts padded
# to 256 tokens).
def refiner_components(seed: int) -> dict:
    import diffusers

    parts = components(seed)
    vae = tiny.random_model(diffusers.AutoencoderKLHunyuanImageRefiner, dict(
        latent_channels=4, block_out_channels=(8, 8, 16, 16), layers_per_block=1, spatial_compression_ratio=8,
        temporal_compression_ratio=4), seed, 3)
    return dict(text_encoder=parts["text_encoder"], tokenizer=parts["tokenizer"], vae=vae,
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=1.0), guider=parts["guider"])


FAMILIES["hunyuanimage_refiner"] = TinyFamily(
    transformer_class="HunyuanImageTransformer2DModel",
    transformer=dict(in_channels=16, out_channels=8, num_attention_heads=4, attention_head_dim=16, num_layers=1,
                     num_single_layers=2, num_refiner_layers=1, patch_size=(1, 1, 1), text_embed_dim=32,
                     guidance_embeds=True, rope_axes_dim=(4, 6, 6)),
    components=refiner_components,
    call=dict(prompt="a small red fox in the snow", negative_prompt="blurry, low quality", image=Picture(32, 48),
              height=32, width=48, num_inference_steps=2, distilled_guidance_scale=3.25, output_type="np"))

RECIPES["HunyuanImageRefinerPipeline"] = Recipe(family="hunyuanimage_refiner")
