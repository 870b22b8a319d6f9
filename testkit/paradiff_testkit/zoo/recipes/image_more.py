"""Lumina-Next, Ovis-Image and CogView4: tiny families of their own, their text encoders' architectures with the
tokenizers testing.pipelines learns locally.

- Lumina-Next (`LuminaPipeline`): a Gemma text encoder (the second-to-last hidden states), Lumina 2's four-level VAE
  (scale factor 8) and 2 x 2 patches: 80 x 48 pixels are 5 x 3 = 15 image tokens; one call on [cond, uncond].
- Ovis-Image: a Qwen3 text encoder (the prompt follows a fixed 28-token system prefix the pipeline cuts off), the
  two-level VAE and 2 x 2 packing: 40 x 56 pixels are 10 x 14 = 140 tokens; two calls (cond, then uncond).
- CogView4: a GLM text encoder (the second-to-last hidden states, prompts left-padded to a multiple of 16 tokens),
  the two-level VAE and 2 x 2 patches: 32 x 48 pixels are 8 x 12 = 96 tokens; two calls (cond, then uncond).
"""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily
from paradiff_testkit.zoo.recipes.z_image import TEXT_WIDTH, qwen3_text_encoder

PROMPTS = dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality")


def lumina_components(seed: int) -> dict:
    import diffusers
    from transformers import GemmaConfig, GemmaModel

    tokenizer = tiny._gemma_tokenizer()
    with tiny._seeded(seed, 1):
        text_encoder = GemmaModel(GemmaConfig(
            vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id))
    parts = tiny._build_lumina2(seed)  # its four-level VAE and scheduler
    return dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.0),
                vae=parts["vae"], text_encoder=text_encoder, tokenizer=tokenizer)


def ovis_components(seed: int) -> dict:
    import diffusers

    tokenizer = tiny._qwen3_chat_tokenizer()
    return dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
                vae=tiny._small_vae(seed, scaling_factor=0.3611, shift_factor=0.1159),
                text_encoder=qwen3_text_encoder(seed, tokenizer), tokenizer=tokenizer)


def cogview4_components(seed: int) -> dict:
    import diffusers
    from transformers import GlmConfig, GlmModel

    tokenizer = tiny._qwen3_chat_tokenizer()
    with tiny._seeded(seed, 1):
        text_encoder = GlmModel(GlmConfig(
            vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id))
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear")
    return dict(scheduler=scheduler, vae=tiny._small_vae(seed, scaling_factor=0.18215),
                text_encoder=text_encoder, tokenizer=tokenizer)


FAMILIES = {
    "lumina_next": TinyFamily(
        transformer_class="LuminaNextDiT2DModel",
        transformer=dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=64, num_layers=2,
                         num_attention_heads=4, num_kv_heads=2, multiple_of=16, cross_attention_dim=TEXT_WIDTH),
        components=lumina_components,
        # proportional attention (the default) scales by the sequence length each processor sees: refused under
        # context parallelism, so the recipe turns it off
        call=dict(PROMPTS, guidance_scale=4.0, num_inference_steps=2, height=80, width=48, proportional_attn=False,
                  output_type="np")),
    "ovis_image": TinyFamily(
        transformer_class="OvisImageTransformer2DModel",
        transformer=dict(in_channels=16, out_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                         num_attention_heads=4, joint_attention_dim=TEXT_WIDTH, axes_dims_rope=(4, 6, 6)),
        components=ovis_components,
        call=dict(PROMPTS, guidance_scale=5.0, num_inference_steps=2, max_sequence_length=24, height=40, width=56,
                  output_type="np")),
    "cogview4": TinyFamily(
        transformer_class="CogView4Transformer2DModel",
        transformer=dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
                         num_attention_heads=4, text_embed_dim=TEXT_WIDTH, time_embed_dim=32, condition_dim=8,
                         rope_axes_dim=(16, 16)),
        components=cogview4_components,
        call=dict(PROMPTS, guidance_scale=5.0, num_inference_steps=2, max_sequence_length=32, height=32, width=48,
                  output_type="np")),
}

RECIPES = {
    "LuminaPipeline": Recipe(family="lumina_next"),
    "OvisImagePipeline": Recipe(family="ovis_image"),
    "CogView4Pipeline": Recipe(family="cogview4"),
}

# the control image's latents concatenated to the noise on the channels: twice the transformer's input channels
RECIPES["CogView4ControlPipeline"] = Recipe(extends="CogView4Pipeline", transformer=dict(in_channels=8),
                                            call=dict(control_image=Picture(32, 48, seed=11)))




def hidream_components(seed: int) -> dict:
    """HiDream-I1: two CLIPs with projections (pooled), T5 and a Llama whose every layer's hidden states the
    transformer reads."""
    import diffusers
    from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5EncoderModel

    clip, t5, llama = tiny._clip_tokenizer(), tiny._t5_tokenizer(), tiny._llama3_tokenizer()
    with tiny._seeded(seed, 4):
        text_encoder_3 = T5EncoderModel(tiny._t5_config(T5Config, t5, feed_forward_proj="gated-gelu"))
    with tiny._seeded(seed, 5):
        text_encoder_4 = LlamaForCausalLM(LlamaConfig(
            vocab_size=len(llama), hidden_size=TEXT_WIDTH, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
            bos_token_id=llama.bos_token_id, eos_token_id=llama.eos_token_id))
    return dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
                vae=tiny._small_vae(seed, scaling_factor=0.3611, shift_factor=0.1159),
                text_encoder=tiny._clip_with_projection(clip, seed, 1), tokenizer=clip,
                text_encoder_2=tiny._clip_with_projection(clip, seed, 2), tokenizer_2=clip,
                text_encoder_3=text_encoder_3, tokenizer_3=t5, text_encoder_4=text_encoder_4, tokenizer_4=llama)


# HiDream-I1: the pipeline rescales every image to 128 x 128 latents' area (its default_sample_size), 40 x 56 to
# 216 x 300 pixels (scale factor 2, 2 x 2 patches: 54 x 75 = 4050 tokens, within max_resolution's count); one call
# on [uncond, cond], the Llama states batched on their second dimension
FAMILIES["hidream"] = TinyFamily(
    transformer_class="HiDreamImageTransformer2DModel",
    transformer=dict(patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=2,
                     attention_head_dim=16, num_attention_heads=4, caption_channels=[TEXT_WIDTH, TEXT_WIDTH],
                     text_emb_dim=2 * TEXT_WIDTH, num_routed_experts=4, num_activated_experts=2,
                     axes_dims_rope=(8, 4, 4), max_resolution=(128, 128), llama_layers=[0, 1, 2]),
    components=hidream_components,
    call=dict(PROMPTS, guidance_scale=5.0, num_inference_steps=2, max_sequence_length=32, height=40, width=56,
              output_type="np"))
RECIPES["HiDreamImagePipeline"] = Recipe(family="hidream")
