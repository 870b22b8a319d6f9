"""ERNIE-Image: a Mistral 3 text model's second-to-last hidden states (the prompts unpadded, each its own length),
batch CFG on [uncond, cond] with the padded texts and their lengths batched; the FLUX.2 VAE of the flux2 family
(latents normalised by its batch-norm statistics, 2 x 2 patchified by the pipeline): 44 x 36 pixels are 11 x 9 = 99
tokens. The prompt enhancer (`pe`) is left out."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Recipe, TinyFamily


def components(seed: int) -> dict:
    import diffusers
    from transformers import Mistral3Config, Mistral3Model, MistralConfig, PixtralVisionConfig

    tokenizer = tiny._mistral_tokenizer()
    text_config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    vision_config = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=32, patch_size=4,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    with tiny._seeded(seed, 1):
        text_encoder = Mistral3Model(Mistral3Config(
            text_config=text_config, vision_config=vision_config,
            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
            multimodal_projector_bias=False))
    return dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=tiny.family_components("flux2", seed)["vae"],
                text_encoder=text_encoder, tokenizer=tokenizer, pe=None, pe_tokenizer=None)


FAMILIES = {
    "ernie_image": TinyFamily(
        transformer_class="ErnieImageTransformer2DModel",
        transformer=dict(hidden_size=64, num_attention_heads=4, num_layers=2, ffn_hidden_size=128, in_channels=16,
                         out_channels=16, patch_size=1, text_in_dim=32, rope_axes_dim=(4, 6, 6)),
        components=components,
        call=dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                  guidance_scale=4.0, num_inference_steps=2, use_pe=False, output_type="np", height=44, width=36)),
}

RECIPES = {"ErnieImagePipeline": Recipe(family="ernie_image")}
