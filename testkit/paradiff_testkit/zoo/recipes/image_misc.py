"""DiT, Bria 3.x, Krea 2 and VisualCloze pipelines: tiny families of their own (the T5, CLIP, Qwen tokenizers and
encoders of paradiff_testkit.pipelines, the transformer configs of the plans' examples).

- DiT: class-conditional, batch CFG on [cond, uncond] (the null class 1000 second), learned sigma (8 output
  channels); a 10 x 10 latent of 2 x 2 patches is 25 tokens, which two ranks do not divide; two class labels.
- Bria 3.x: FLUX.1's blocks on a T5 prompt, batch CFG on [uncond, cond]. Its pipeline takes the VAE's scale factor
  as 2 ** (number of levels), twice the real one, and packs 2 x 2 latents: with a one-level VAE (as in diffusers'
  own test) 42 x 38 pixels are 21 x 19 = 399 tokens (the pipeline warns that 42 and 38 are not multiples of 4 and
  keeps them).
- Krea 2: a Qwen3-VL text encoder's stacked layers, true CFG as two calls (the prompt's, then the negative
  prompt's); a one-level Qwen-Image VAE (factor 2) and 2 x 2 patches: 44 x 36 pixels are 11 x 9 = 99 tokens.
- VisualCloze: FLUX.1 with in-context example rows concatenated into one grid image (not split yet: see its
  recipe).
"""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily

PROMPT = "a small red fox running through the snow"


def dit_components(seed: int) -> dict:
    import diffusers

    vae = tiny._small_vae(seed, scaling_factor=0.18215)
    return dict(vae=vae, scheduler=diffusers.DDIMScheduler())


def bria_components(seed: int) -> dict:
    import diffusers
    from transformers import T5Config, T5EncoderModel

    tokenizer = tiny._t5_tokenizer()
    with tiny._seeded(seed, 1):
        text_encoder = T5EncoderModel(tiny._t5_config(T5Config, tokenizer, feed_forward_proj="gated-gelu"))
    vae = tiny._small_vae(seed, down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                          block_out_channels=(8,), scaling_factor=0.13025, shift_factor=0.0)
    return dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                tokenizer=tokenizer, image_encoder=None, feature_extractor=None)


KREA2_TEXT_LAYERS = 3


def krea2_text_encoder(seed: int, tokenizer, layers: int):
    """Krea 2's Qwen3-VL text encoder at the sizes of diffusers' own tests, `layers` deep (the pipeline stacks the
    hidden states of chosen layers: the standard recipe's 3, the modular text step's fixed ones)."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    ids = tokenizer.convert_tokens_to_ids
    with tiny._seeded(seed, 1):
        return Qwen3VLModel(Qwen3VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16,
                             num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=8, max_position_embeddings=1024,
                             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                              "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
            vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=16,
                               patch_size=2, spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16,
                               deepstack_visual_indexes=[0]),
            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))).eval()


def krea2_components(seed: int) -> dict:
    import diffusers

    tokenizer = tiny._qwen2_tokenizer()
    text_encoder = krea2_text_encoder(seed, tokenizer, KREA2_TEXT_LAYERS - 1)
    with tiny._seeded(seed, 3):
        vae = diffusers.AutoencoderKLQwenImage(
            base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[False],
            latents_mean=tiny._latent_stats(seed, 0.0), latents_std=tiny._latent_stats(seed, 1.0))
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400)
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                text_encoder_select_layers=tuple(range(KREA2_TEXT_LAYERS)))


SIZE = dict(height=44, width=36)

FAMILIES = {
    "dit": TinyFamily(
        transformer_class="DiTTransformer2DModel",
        transformer=dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
                         sample_size=10, patch_size=2, num_embeds_ada_norm=1000, norm_type="ada_norm_zero",
                         norm_elementwise_affine=False, attention_bias=True, activation_fn="gelu-approximate"),
        components=dit_components,
        call=dict(class_labels=[1, 3], guidance_scale=4.0, num_inference_steps=2, output_type="np")),
    "bria": TinyFamily(
        transformer_class="BriaTransformer2DModel",
        transformer=dict(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                         num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=None,
                         axes_dims_rope=[4, 6, 6]),
        components=bria_components,
        call=dict(prompt=PROMPT, negative_prompt="blurry, low quality", guidance_scale=5.0, num_inference_steps=2,
                  max_sequence_length=32, output_type="np", height=42, width=38)),
    "krea2": TinyFamily(
        transformer_class="Krea2Transformer2DModel",
        transformer=dict(in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=96, timestep_embed_dim=32, text_hidden_dim=16,
                         num_text_layers=KREA2_TEXT_LAYERS, text_num_attention_heads=2, text_num_key_value_heads=1,
                         text_intermediate_size=16, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
                         axes_dims_rope=(4, 6, 6), rope_theta=1000.0),
        components=krea2_components,
        call=dict(prompt=PROMPT, negative_prompt="blurry, low quality", guidance_scale=3.0, num_inference_steps=2,
                  max_sequence_length=16, output_type="np", **SIZE)),
}

def cloze_vae(seed: int, parts: dict, config: dict):
    # one level (scale factor 1) and one latent channel, as in diffusers' own test: the transformer's input is the
    # packed latents, the packed condition latents and the packed mask (4 + 4 + 4 channels)
    return tiny._small_vae(seed, down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                           block_out_channels=(8,), latent_channels=1, scaling_factor=1.5035, shift_factor=0.0609)


# one in-context example (two images) and the query (its first image; the second is generated): a 2 x 2 grid of
# 16 x 16 images, 4 x 64 tokens
CLOZE_IMAGES = [[Picture(16, 16, seed=1), Picture(16, 16, seed=2)], [Picture(16, 16, seed=3), None]]
CLOZE_CALL = dict(task_prompt="Each row outlines a logical process, from [IMAGE1] a depth map to [IMAGE2] a photo.",
                  content_prompt=PROMPT, image=CLOZE_IMAGES, num_inference_steps=2, guidance_scale=30.0,
                  max_sequence_length=32, output_type="np")

RECIPES = {
    "VisualClozeGenerationPipeline": Recipe(
        family="flux", components=dict(vae=cloze_vae), transformer=dict(in_channels=12, out_channels=4),
        init=dict(resolution=16), drop=("prompt", "height", "width"), call=CLOZE_CALL),
    # the generation, then the generated image upsampled (SDEdit with FLUX Fill's inputs) to 24 x 20 pixels
    "VisualClozePipeline": Recipe(extends="VisualClozeGenerationPipeline", call=dict(
        upsampling_height=24, upsampling_width=20, upsampling_strength=0.6, num_inference_steps=4)),
    "DiTPipeline": Recipe(family="dit"),
    "BriaPipeline": Recipe(family="bria"),
    "Krea2Pipeline": Recipe(family="krea2"),
}
