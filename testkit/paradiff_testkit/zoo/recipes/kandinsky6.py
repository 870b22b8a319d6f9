"""Kandinsky 6 TI2VA without its audio branch (no audio VAE, `sample_audio=False`): Kandinsky 5's text encoders
(Qwen2.5-VL behind a Qwen2-VL processor, CLIP's pooled output), the HunyuanVideo VAE (factor 4 in space and time:
5 frames -> 2 latent frames of 4 x 6 tokens at 32 x 48 pixels), two transformer calls a step."""

from paradiff_testkit.zoo import Recipe, TinyFamily
from paradiff_testkit.zoo.recipes.kandinsky5 import video_components

FAMILIES = {
    "kandinsky6": TinyFamily(
        transformer_class="Kandinsky6Transformer3DModel",
        transformer=dict(in_visual_dim=4, out_visual_dim=4, in_text_dim=32, in_text_dim2=16, time_dim=32,
                         patch_size=(1, 2, 2), model_dim=64, ff_dim=128, num_text_blocks=1, num_visual_blocks=2,
                         axes_dims=(4, 6, 6), in_audio_dim=6, out_audio_dim=6, model_dim_a=32, time_dim_a=24,
                         ff_dim_a=64, ca_rope=True, cross_gates=True, fix_modulation=True, text_token_padding=True,
                         visual_token_type_num_embeddings=2),
        components=video_components,
        call=dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                  guidance_scale=4.0, num_inference_steps=2, max_sequence_length=16, height=32, width=48,
                  num_frames=5, sample_audio=False, output_type="np")),
}

RECIPES = {"Kandinsky6TI2VAPipeline": Recipe(family="kandinsky6")}


# --- Kandinsky 6 SR ---------------------------------------------------------------------------------------------------
# Super-resolution of a video in tiles: its own VAE (three levels: factor 4 in space and time), the latent upscaler
# bank, a transformer on [latents | anchor | anchor mask] of a tile (NABLA sparse attention over 8 x 8 token tiles, so
# every tile size is a multiple of 32 pixels). A 5 x 16 x 32 video upscaled 2x: one 32 x 64 tile, two latent frames
# of 8 x 16 tokens. Never guides (one call a step, no guidance argument).
def sr_components(seed: int) -> dict:
    import diffusers

    from paradiff_testkit import pipelines as tiny

    vae = tiny.random_model(diffusers.Kandinsky6SRVAE, dict(
        latent_channels=4, encoder_block_out_channels=(4, 8, 8), decoder_block_out_channels=(4, 8, 8),
        layers_per_block=1, temporal_compression_ratio=4, temporal_compression_start_level=0), seed, 3)
    upscaler = tiny.random_model(diffusers.Kandinsky6SRLatentUpscalerBank, dict(
        in_channels=4, stage_channels=(8, 8, 4), num_pre_blocks=1, num_mid_blocks=1, num_post_blocks=1,
        num_x2_adapter_blocks=1, scales=(2, 4)), seed, 4)
    return dict(vae=vae, latent_upscaler=upscaler, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.5))


def _low_resolution_video():
    import torch

    return torch.rand((5, 3, 16, 32), generator=torch.Generator().manual_seed(5))


FAMILIES["kandinsky6_sr"] = TinyFamily(
    transformer_class="Kandinsky6SRTransformer3DModel",
    transformer=dict(in_visual_dim=4, out_visual_dim=4, time_dim=16, patch_size=(1, 1, 1), model_dim=32, ff_dim=64,
                     num_visual_blocks=2, axes_dims=(4, 6, 6), tile_sizes=((32, 32), (32, 64), (64, 32))),
    components=sr_components,
    call=dict(video=_low_resolution_video(), resolution_scale=2, num_inference_steps=2, min_overlap=0.2,
              tiles_batch_size=4, output_type="np"))

RECIPES["Kandinsky6SRPipeline"] = Recipe(family="kandinsky6_sr")
