"""HunyuanVideo Framepack: the tiny HunyuanVideo components (Llama and CLIP text encoders, the factor-4 VAE) and a
SigLIP vision encoder whose image embedding joins the text tokens; the video is made section by section
(`latent_window_size` latent frames each), the clean history frames compressed into extra tokens before the noise
tokens. True CFG against the negative prompt (two calls), on top of the embedded guidance."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily

IMAGE_WIDTH = 32


def components(seed: int) -> dict:
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    parts = tiny.family_components("hunyuanvideo", seed)
    with tiny._seeded(seed, 7):
        parts["image_encoder"] = SiglipVisionModel(SiglipVisionConfig(
            hidden_size=IMAGE_WIDTH, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
            patch_size=8)).eval()
    parts["feature_extractor"] = SiglipImageProcessor(size={"height": 32, "width": 32})
    return parts


FAMILIES = {
    "hunyuanvideo_framepack": TinyFamily(
        transformer_class="HunyuanVideoFramepackTransformer3DModel",
        transformer=dict(tiny.transformer_config("hunyuanvideo"), image_condition_type=None, has_image_proj=True,
                         image_proj_dim=IMAGE_WIDTH, has_clean_x_embedder=True),
        components=components,
        # 32 x 32 pixels are 8 x 8 latents (4 in space), 2 x 2 patches: 16 tokens a latent frame; 9 frames in
        # sections of 2 latent frames
        call=dict(tiny.default_call_kwargs("hunyuanvideo"), image=Picture(32, 32),
                  negative_prompt="blurry, low quality", true_cfg_scale=2.0, num_frames=9, latent_window_size=2)),
}

RECIPES = {
    "HunyuanVideoFramepackPipeline": Recipe(family="hunyuanvideo_framepack"),
}


# --- HunyuanVideo I2V: a LLaVA text encoder reads the image with the prompt --------------------------------------

# the tiny CLIP vision tower: 32 x 32 pixels in 8 x 8 patches, 16 image features (the class token dropped)
IMAGE_TOKENS = 16


def i2v_components(seed: int) -> dict:
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration)

    parts = tiny.family_components("hunyuanvideo", seed)
    tokenizer = parts["tokenizer"]
    vocab = len(tokenizer)
    with tiny._seeded(seed, 1):
        # three Llama layers (the pipeline takes the hidden states three from the top); the image token is an id past
        # the tokenizer's vocabulary
        parts["text_encoder"] = LlavaForConditionalGeneration(LlavaConfig(
            text_config=LlamaConfig(
                vocab_size=vocab + 1, hidden_size=tiny._TEXT_WIDTH, intermediate_size=64, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}),
            vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, projection_dim=16,
                                           num_attention_heads=2, num_hidden_layers=2, image_size=32, patch_size=8),
            image_token_index=vocab, pad_token_id=tokenizer.pad_token_id)).eval()
    parts["image_processor"] = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return parts


FAMILIES["hunyuanvideo_i2v"] = TinyFamily(
    transformer_class="HunyuanVideoTransformer3DModel",
    # the image's latents and a mask channel beside the noise; guidance not embedded (the I2V checkpoint)
    transformer=dict(tiny.transformer_config("hunyuanvideo"), in_channels=2 * 4 + 1,
                     image_condition_type="latent_concat", guidance_embeds=False),
    components=i2v_components,
    # no system template: the image's features overwrite the tokens at 5 ... 21; the first latent frame (the
    # image's) is dropped before decoding: 9 frames are 3 latent frames, 5 frames out
    call=dict(tiny.default_call_kwargs("hunyuanvideo"), image=Picture(32, 32), negative_prompt="blurry, low quality",
              true_cfg_scale=2.0, guidance_scale=1.0, num_frames=9,
              prompt_template={"template": "{}", "crop_start": 0, "image_emb_len": IMAGE_TOKENS, "image_emb_start": 5,
                               "image_emb_end": 5 + IMAGE_TOKENS}))
RECIPES["HunyuanVideoImageToVideoPipeline"] = Recipe(family="hunyuanvideo_i2v")
