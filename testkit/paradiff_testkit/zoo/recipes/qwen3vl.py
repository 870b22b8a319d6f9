"""Pipelines on a Qwen3-VL text encoder with a Qwen3VLProcessor (NucleusMoE-Image, ...): the processor is
`TinyQwen3VLProcessor` (zoo/processors.py: no video processor, which transformers cannot build without torchvision;
Qwen-VL's chat template), the tokenizer the Qwen2 BPE of paradiff_testkit.pipelines learnt locally.

- NucleusMoE-Image: a mixture-of-experts image transformer (expert-choice routing, a dense first block), the text
  encoder's hidden states `return_index` layers from the top; true CFG as two calls (the prompt's, then the negative
  prompt's). A one-level Qwen-Image VAE (factor 2) and 2 x 2 patches: 44 x 36 pixels are 11 x 9 = 99 tokens.
- Qwen-Image 2.1: the pipeline fixes the VAE's factor at 16 (one token a 16 x 16 tile): a three-level
  AutoencoderKLQwenImage21 on 2 x 2 patchified pixels; true CFG as two calls. Sizes are multiples of 32: 160 x 128
  pixels are 10 x 8 = 80 image tokens after the prompt's (97 and 93 joint tokens with the two prompts). Its default
  KV cache is refused under context parallelism (the recipe runs without it).
"""

import torch

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Recipe, TinyFamily

TEXT_WIDTH = 32
PROMPT = "a small red fox running through the snow"


def qwen3vl_encoder(seed: int, tokenizer, layers: int = 4, width: int = TEXT_WIDTH):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    with tiny._seeded(seed, 1):
        return Qwen3VLForConditionalGeneration(Qwen3VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=32,
                             num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             max_position_embeddings=4096,
                             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                              "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
            vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=width,
                               patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                               deepstack_visual_indexes=[0]),
            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))).eval()


def qwen3vl_processor(tokenizer, patch: int = 4, merge: int = 2):
    from transformers import Qwen2VLImageProcessor

    from paradiff_testkit.zoo.processors import TinyQwen3VLProcessor

    side = patch * merge
    images = Qwen2VLImageProcessor(patch_size=patch, temporal_patch_size=2, merge_size=merge,
                                   min_pixels=(4 * side) ** 2, max_pixels=(8 * side) ** 2)
    return TinyQwen3VLProcessor(image_processor=images, tokenizer=tokenizer)


def qwen_vae(seed: int, z_dim: int = 4):
    import diffusers

    with tiny._seeded(seed, 3):
        return diffusers.AutoencoderKLQwenImage(
            base_dim=8, z_dim=z_dim, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[False],
            latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim)


def nucleus_components(seed: int) -> dict:
    import diffusers

    tokenizer = tiny._qwen2_tokenizer()
    return dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=qwen_vae(seed),
                text_encoder=qwen3vl_encoder(seed, tokenizer), processor=qwen3vl_processor(tokenizer))


def nucleus_transformer(seed: int, parts: dict, config: dict):
    import diffusers

    model = tiny.random_model(diffusers.NucleusMoEImageTransformer2DModel, config, seed, 0)
    generator = torch.Generator().manual_seed(seed * 101 + 7)
    with torch.no_grad():
        for name, param in model.named_parameters():  # the expert banks are made with torch.empty
            if ".experts." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def qwenimage21_components(seed: int) -> dict:
    import diffusers

    tokenizer = tiny._qwen2_tokenizer()
    with tiny._seeded(seed, 3):
        vae = diffusers.AutoencoderKLQwenImage21(
            base_dim=8, decoder_base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
            temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
            scale_factor_temporal=4, scale_factor_spatial=16, latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
    return dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                text_encoder=qwen3vl_encoder(seed, tokenizer), processor=qwen3vl_processor(tokenizer))


def bria_fibo2_components(seed: int) -> dict:
    import diffusers
    from diffusers.pipelines.bria_fibo2.pipeline_bria_fibo2 import TEXT_ENCODER_OUT_LAYERS

    tokenizer = tiny._qwen2_tokenizer()
    layers = max(layer for bundle in TEXT_ENCODER_OUT_LAYERS for layer in bundle)  # hidden_states[0]: embeddings
    return dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=tiny.family_components("flux2", seed)["vae"],
                text_encoder=qwen3vl_encoder(seed, tokenizer, layers=layers, width=8),
                processor=qwen3vl_processor(tokenizer))


FAMILIES = {
    # Bria FIBO 2: Z-Image-style blocks with a Perceiver over six bundles of three Qwen3-VL layers (36 layers, 8
    # wide: 24 features a bundle); CFG as two calls; the FLUX.2 VAE (factor 2) and 2 x 2 patches: 44 x 36 pixels are
    # 99 tokens. The caption's text is not rendered to images (no fonts here)
    "bria_fibo2": TinyFamily(
        transformer_class="BriaFibo2Transformer2DModel",
        transformer=dict(in_channels=4, patch_size=2, dim=64, n_layers=2, n_refiner_layers=1, n_heads=4,
                         cap_feat_dim=24, injection_layer_ids=(1,), perceiver_num_layers=1, min_num_gist_tokens=2,
                         max_num_gist_tokens=4, gist_step=1, gist_min_text_len=2, gist_max_text_len=8,
                         axes_dims=(4, 6, 6), axes_lens=(256, 64, 64)),
        components=bria_fibo2_components,
        call=dict(prompt='{"short_description": "a small red fox running through the snow"}',
                  negative_prompt="blurry", guidance_scale=4.0, num_inference_steps=2, render_text_images=False,
                  output_type="np", height=44, width=36)),
    "qwenimage21": TinyFamily(
        transformer_class="QwenImage21Transformer2DModel",
        transformer=dict(patch_size=1, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
                         num_attention_heads=4, context_in_dim=TEXT_WIDTH, mlp_ratio=3, axes_dims_rope=(4, 6, 6)),
        components=qwenimage21_components,
        call=dict(prompt=PROMPT, negative_prompt="blurry, low quality", true_cfg_scale=4.0, num_inference_steps=2,
                  output_type="np", height=160, width=128,
                  # the KV cache reuses the text's keys and values from the first step; context parallelism refuses
                  # it (the cached decode slices the target's tokens from the whole joint sequence)
                  use_kv_cache=False)),
    "nucleusmoe": TinyFamily(
        transformer_class="NucleusMoEImageTransformer2DModel",
        transformer=dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                         num_attention_heads=4, num_key_value_heads=2, joint_attention_dim=TEXT_WIDTH,
                         axes_dims_rope=(4, 6, 6), num_experts=4, moe_intermediate_dim=32,
                         dense_moe_strategy="leave_first_block_dense", capacity_factors=2.0),
        components=nucleus_components,
        call=dict(prompt=PROMPT, negative_prompt="blurry, low quality", guidance_scale=4.0, num_inference_steps=2,
                  return_index=-2, max_sequence_length=64, output_type="np", height=44, width=36)),
}

RECIPES = {
    "BriaFibo2Pipeline": Recipe(family="bria_fibo2"),
    "QwenImage21Pipeline": Recipe(family="qwenimage21"),
    "NucleusMoEImagePipeline": Recipe(family="nucleusmoe", components=dict(transformer=nucleus_transformer)),
}
