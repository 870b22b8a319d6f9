"""Tiny families for the T5-conditioned video DiTs testing.pipelines has none for: Allegro, Latte and Mochi. Each
takes the tiny T5 encoder and tokenizer (32 wide) of testing.pipelines, a VAE of its own class and batch CFG (one
transformer call on [uncond, cond])."""

import torch

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Recipe, TinyFamily

TEXT_WIDTH = 32
PROMPT = dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality")


def _t5(seed: int) -> dict:
    from transformers import T5Config, T5EncoderModel

    tokenizer = tiny._t5_tokenizer()
    with tiny._seeded(seed, 1):
        text_encoder = T5EncoderModel(tiny._t5_config(T5Config, tokenizer, feed_forward_proj="gated-gelu"))
    return dict(text_encoder=text_encoder, tokenizer=tokenizer)


def allegro_components(seed: int) -> dict:
    import diffusers

    with tiny._seeded(seed, 3):
        # 8 in space, 4 in time
        vae = diffusers.AutoencoderKLAllegro(
            in_channels=3, out_channels=3, down_block_types=("AllegroDownBlock3D",) * 4,
            up_block_types=("AllegroUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
            layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4)
    return dict(_t5(seed), vae=vae, scheduler=diffusers.DDIMScheduler())


def latte_components(seed: int) -> dict:
    import diffusers

    # a 2-D VAE over the frames: scale factor 2
    return dict(_t5(seed), vae=tiny._small_vae(seed, scaling_factor=0.18215), scheduler=diffusers.DDIMScheduler())


def mochi_components(seed: int) -> dict:
    import diffusers

    with tiny._seeded(seed, 3):
        # 8 in space, 6 in time (7 frames are 2 latent frames); its GroupNorms take 32 groups; the pipeline
        # reads 12 latent channels
        stats = torch.Generator().manual_seed(seed + 17)
        vae = diffusers.AutoencoderKLMochi(
            latent_channels=12, out_channels=3, encoder_block_out_channels=(32,) * 4,
            decoder_block_out_channels=(32,) * 4, layers_per_block=(1,) * 5, add_attention_block=(False,) * 5,
            latents_mean=tuple(round(float(v), 4) for v in (torch.rand(12, generator=stats) - 0.5) * 0.2),
            latents_std=tuple(round(float(v), 4) for v in 1 + (torch.rand(12, generator=stats) - 0.5) * 0.2))
    return dict(_t5(seed), vae=vae, scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


FAMILIES = {
    # 48 x 32 pixels are 6 x 4 latents, 2 x 2 patches: 3 x 2 tokens a frame, 9 frames 3 latent frames (18 tokens)
    "allegro": TinyFamily(
        transformer_class="AllegroTransformer3DModel",
        transformer=dict(patch_size=2, patch_size_t=1, num_attention_heads=4, attention_head_dim=24, in_channels=4,
                         out_channels=4, num_layers=2, cross_attention_dim=96, sample_height=4, sample_width=6,
                         sample_frames=9, caption_channels=TEXT_WIDTH),
        components=allegro_components,
        # the Allegro VAE decodes only with tiling, which a loaded pipeline does not turn on: the latents compare.
        # Unbounded, they carry float32 noise amplified by 2 x guidance - 1: at guidance 6 it reaches 1e-5 in every
        # mode alike (tp2 included), at 2 it stays clear of the tolerance
        call=dict(PROMPT, guidance_scale=2.0, num_inference_steps=2, height=48, width=32, num_frames=9,
                  max_sequence_length=16, clean_caption=False, output_type="latent")),
    # 32 x 32 pixels are 16 x 16 latents, 2 x 2 patches: 64 tokens a frame, 3 frames
    "latte": TinyFamily(
        transformer_class="LatteTransformer3DModel",
        transformer=dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
                         cross_attention_dim=64, sample_size=16, patch_size=2, attention_bias=True,
                         activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
                         norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=TEXT_WIDTH, video_length=3),
        components=latte_components,
        call=dict(PROMPT, guidance_scale=5.0, num_inference_steps=2, height=32, width=32, video_length=3,
                  clean_caption=False, output_type="np")),
    # 48 x 32 pixels are 6 x 4 latents, 2 x 2 patches: 6 tokens a frame, 2 latent frames
    "mochi": TinyFamily(
        transformer_class="MochiTransformer3DModel",
        transformer=dict(patch_size=2, num_attention_heads=4, attention_head_dim=24, num_layers=2,
                         pooled_projection_dim=48, in_channels=12, text_embed_dim=TEXT_WIDTH, time_embed_dim=32,
                         max_sequence_length=16),
        components=mochi_components,
        call=dict(PROMPT, guidance_scale=4.5, num_inference_steps=2, height=48, width=32, num_frames=7,
                  max_sequence_length=16, output_type="np")),
}

RECIPES = {
    "AllegroPipeline": Recipe(family="allegro"),
    "LattePipeline": Recipe(family="latte"),
    "MochiPipeline": Recipe(family="mochi"),
}
