"""Motif-Video: a T5Gemma 2 encoder (its SigLIP tower encodes the first frame for image-to-video), Wan's VAE,
`MotifVideoTransformer3DModel` (dual-stream then single-stream joint attention over [video, text]) and a guider
component (one transformer call per guidance branch).

Tiny: 9 frames through the VAE of temporal factor 4 are 3 latent frames; 48 x 48 pixels (spatial factor 8, 2 x 2
patches) 3 x 3 tokens a frame: 27 video tokens, then the 16 text tokens."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily
from paradiff_testkit.zoo.recipes.wan_video import LATENT, temporal4_vae

TEXT_WIDTH = 96  # the tiny T5Gemma 2's hidden size
VISION_WIDTH = 16  # its SigLIP tower's


def t5gemma2_encoder(seed: int, tokenizer):
    """A tiny T5Gemma 2 encoder for the zoo's T5 tokenizer: its vocabulary, then the three image tokens (which no
    prompt produces); a 16-pixel SigLIP tower of 4 x 4 patches."""
    import transformers as tf

    vocab = len(tokenizer) + 3
    config = tf.T5Gemma2EncoderConfig(
        text_config=dict(vocab_size=vocab, pad_token_id=tokenizer.pad_token_id, hidden_size=TEXT_WIDTH,
                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=6,
                         head_dim=8, dropout_rate=0.0),
        vision_config=dict(hidden_size=VISION_WIDTH, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, image_size=16, patch_size=4),
        mm_tokens_per_image=4, image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
    with tiny._seeded(seed, 1):
        return tf.T5Gemma2Encoder(config)


def motif_components(seed: int) -> dict:
    import diffusers
    from transformers import SiglipImageProcessor

    tokenizer = tiny.family_components("wan", seed)["tokenizer"]
    return dict(tokenizer=tokenizer, text_encoder=t5gemma2_encoder(seed, tokenizer), vae=temporal4_vae(seed, {}, {}),
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
                guider=diffusers.ClassifierFreeGuidance(guidance_scale=5.0),
                feature_extractor=SiglipImageProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                                       size={"height": 16, "width": 16}))


def apg_guider(seed: int, parts: dict, config: dict):
    import diffusers

    return diffusers.AdaptiveProjectedGuidance(guidance_scale=5.0)


# both pipelines put the first-frame condition's latents and mask beside the noise (zeros in text-to-video)
MOTIF = dict(in_channels=2 * LATENT + 1, out_channels=LATENT, num_attention_heads=4, attention_head_dim=16, num_layers=1,
             num_single_layers=1, patch_size=2, patch_size_t=1, qk_norm="rms_norm", text_embed_dim=TEXT_WIDTH,
             rope_axes_dim=(4, 6, 6))
CALL = dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality", height=48,
            width=48, num_frames=9, num_inference_steps=2, max_sequence_length=16, output_type="np")

FAMILIES = {"motif_video": TinyFamily(transformer_class="MotifVideoTransformer3DModel", transformer=MOTIF,
                                      components=motif_components, call=CALL)}

RECIPES = {
    "MotifVideoPipeline": Recipe(family="motif_video"),
    # adaptive projected guidance: the same two branches, combined by projection
    "MotifVideoPipeline@apg": Recipe(extends="MotifVideoPipeline", components=dict(guider=apg_guider)),
    # the first frame's latents and mask beside the noise, its SigLIP tokens before the text; text
    # cross-attention in both kinds of block and a decoder block over a second copy of the video stream
    "MotifVideoImage2VideoPipeline": Recipe(
        family="motif_video", transformer=dict(
            image_embed_dim=VISION_WIDTH, num_single_layers=2, num_decoder_layers=1,
            enable_text_cross_attention_dual=True, enable_text_cross_attention_single=True),
        call=dict(image=Picture(48, 48))),
}
