"""Tiny random-weight VAEs of every class paradiff splits by rows, and inputs for them.

Each factory gives the same weights for the same seed (every parameter is perturbed, so no norm is a plain
identity and no bias is zero). Sizes are chosen so that a decode or an encode takes milliseconds on a CPU while
still going through every kind of layer: at least two downsamplings, the mid-block attention, the temporal
up/downsampling of the video VAEs (and Wan's frame-chunk cache).
"""

from __future__ import annotations

import torch

# name -> (diffusers class, config)
CONFIGS: dict[str, tuple[str, dict]] = {
    "kl": ("AutoencoderKL", dict(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=32)),
    "flux2": ("AutoencoderKLFlux2", dict(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=32, patch_size=(2, 2))),
    "qwenimage": ("AutoencoderKLQwenImage", dict(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[False, True])),
    "wan": ("AutoencoderKLWan", dict(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[False, True],
        scale_factor_temporal=2, scale_factor_spatial=4)),
    # Wan 2.2: residual up/down blocks with space-to-depth shortcuts, patchified input
    "wan22": ("AutoencoderKLWan", dict(
        base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[],
        temperal_downsample=[False, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
        scale_factor_temporal=2, scale_factor_spatial=8)),
    "hunyuanvideo": ("AutoencoderKLHunyuanVideo", dict(
        in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3, block_out_channels=(8, 8, 16), layers_per_block=1,
        norm_num_groups=4, spatial_compression_ratio=4, temporal_compression_ratio=4)),
    # LTX-Video 0.9.5 layout: space-to-depth downsamplers, residual depth-to-space upsamplers, timestep conditioning
    "ltxvideo": ("AutoencoderKLLTXVideo", dict(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16),
        down_block_types=("LTXVideo095DownBlock3D",) * 2, decoder_block_out_channels=(8, 16),
        layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, False),
        decoder_spatio_temporal_scaling=(False, True), decoder_inject_noise=(False, False, False),
        # the decoder reads its per-block tuples from the last block to the first
        downsample_type=("spatiotemporal", "spatial"), upsample_residual=(False, True), upsample_factor=(1, 2),
        timestep_conditioning=True, patch_size=2, patch_size_t=1, encoder_causal=True, decoder_causal=False)),
}
# LTX-Video 0.9.1 layout: noise injected after the decoder's convolutions (drawn from the global generator)
CONFIGS["ltxvideo-noise"] = ("AutoencoderKLLTXVideo", dict(CONFIGS["ltxvideo"][1], decoder_inject_noise=(True,) * 3))
CONFIGS.update({
    # Sana's DC-AE layout: stride-2 conv downsampling, nearest upsampling, linear attention in the last stage (head
    # size 8: a band of 1 latent row x 6 holds 6 tokens, the model's quadratic form there, 30 tokens in all)
    "dc": ("AutoencoderDC", dict(
        in_channels=3, latent_channels=4, attention_head_dim=8,
        encoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 16, 16), decoder_block_out_channels=(8, 16, 16),
        encoder_layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        encoder_qkv_multiscales=((), (), (5,)), decoder_qkv_multiscales=((), (), (5,)),
        downsample_block_type="Conv", upsample_block_type="interpolate",
        decoder_norm_types=("batch_norm", "rms_norm", "rms_norm"), decoder_act_fns=("relu", "silu", "silu"))),
    # pixel (un)shuffle up/downsampling and a first stage without layers (DCDownBlock2d / DCUpBlock2d at the ends)
    "dc-shuffle": ("AutoencoderDC", dict(
        in_channels=3, latent_channels=4, attention_head_dim=8,
        encoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 16, 16), decoder_block_out_channels=(8, 16, 16),
        encoder_layers_per_block=(0, 1, 1), decoder_layers_per_block=(0, 1, 1),
        encoder_qkv_multiscales=((), (), (3,)), decoder_qkv_multiscales=((), (), (3,)),
        downsample_block_type="pixel_unshuffle", upsample_block_type="pixel_shuffle")),
    "cogvideox": ("AutoencoderKLCogVideoX", dict(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 3,
        up_block_types=("CogVideoXUpBlock3D",) * 3, block_out_channels=(8, 8, 16), latent_channels=4,
        layers_per_block=1, norm_num_groups=4, temporal_compression_ratio=4)),
    # Mochi's attention has out_channels // 32 heads and its group norms 32 groups: 32 channels at least
    "mochi": ("AutoencoderKLMochi", dict(
        in_channels=15, out_channels=3, latent_channels=4, encoder_block_out_channels=(32,) * 4,
        decoder_block_out_channels=(32,) * 4, layers_per_block=(1,) * 5)),
    "allegro": ("AutoencoderKLAllegro", dict(
        block_out_channels=(8, 8, 16, 16), latent_channels=4, layers_per_block=1, norm_num_groups=4)),
    "magvit": ("AutoencoderKLMagvit", dict(
        block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=4,
        spatial_group_norm=False)),
    "cosmos": ("AutoencoderKLCosmos", dict(
        in_channels=3, out_channels=3, latent_channels=4, encoder_block_out_channels=(8, 8, 8, 8),
        decode_block_out_channels=(8, 8, 8, 8), attention_resolutions=(8,), resolution=64, num_layers=1,
        patch_size=4, patch_type="haar", spatial_compression_ratio=4, temporal_compression_ratio=4)),
    # GroupNorms of 32 groups: 32 channels at least
    "hunyuanimage": ("AutoencoderKLHunyuanImage", dict(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 32, 64, 64), layers_per_block=1,
        spatial_compression_ratio=8, sample_size=128)),
    "hunyuanimage-refiner": ("AutoencoderKLHunyuanImageRefiner", dict(
        latent_channels=4, block_out_channels=(8, 8, 16, 16), layers_per_block=1, spatial_compression_ratio=8,
        temporal_compression_ratio=4)),
    "hunyuanvideo15": ("AutoencoderKLHunyuanVideo15", dict(
        latent_channels=4, block_out_channels=(8, 8, 16, 16), layers_per_block=1, spatial_compression_ratio=8,
        temporal_compression_ratio=4)),
    # Qwen-Image 2.1: Wan 2.2's residual layout specialised to single images (patchified input)
    "qwenimage21": ("AutoencoderKLQwenImage21", dict(
        base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
        scale_factor_temporal=2, scale_factor_spatial=8, latents_mean=[0.0] * 4, latents_std=[1.0] * 4)),
    # LTX-2 with its released padding: zeros in the encoder, reflection in the decoder; noise injected in decoding
    "ltx2video": ("AutoencoderKLLTX2Video", dict(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(16, 32, 64), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1), spatio_temporal_scaling=(True, True, True, True),
        decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(False, True, False, True),
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        upsample_residual=(True, True, True), upsample_factor=(2, 2, 2), timestep_conditioning=False,
        patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False,
        encoder_spatial_padding_mode="zeros", decoder_spatial_padding_mode="reflect")),
    "kandinsky6-sr": ("Kandinsky6SRVAE", dict(
        latent_channels=4, encoder_block_out_channels=(8, 8, 16), decoder_block_out_channels=(8, 8, 16),
        layers_per_block=1, temporal_compression_ratio=2, temporal_compression_start_level=1)),
})
VAE_NAMES = tuple(CONFIGS)
VIDEO = {"wan", "wan22", "hunyuanvideo", "ltxvideo", "ltxvideo-noise", "cogvideox", "mochi", "allegro", "magvit",
         "cosmos", "hunyuanimage-refiner", "hunyuanvideo15", "qwenimage21", "ltx2video", "kandinsky6-sr"}
# Allegro decodes and encodes only through its tiles (24 frames x 320 pixels, batch 1): tiles of 8 frames x 40 x 48
# pixels here, each tile one split call
_ALLEGRO_TILES = dict(kernel=(8, 40, 48), stride=(8, 40, 48))


def build_vae(name: str, seed: int = 0, config: dict | None = None):
    """The tiny VAE `name`, with `config` entries overriding its tiny config."""
    import diffusers

    if name not in CONFIGS:
        raise ValueError(f"unknown tiny VAE {name!r}; known: {VAE_NAMES}")
    class_name, base = CONFIGS[name]
    config = {**base, **(config or {})}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = getattr(diffusers, class_name)(**config)
        with torch.no_grad():
            for param in vae.parameters():
                param.add_(torch.randn_like(param) * 0.05)
    if class_name == "AutoencoderKLAllegro":
        vae.enable_tiling()
        vae.kernel, vae.stride = _ALLEGRO_TILES["kernel"], _ALLEGRO_TILES["stride"]
    return vae.eval()


def latent_channels(vae) -> int:
    config = vae.config
    return config.get("latent_channels") or config.get("z_dim")


def image_channels(vae) -> int:
    if type(vae).__name__ == "AutoencoderKLMochi":  # its in_channels count the Fourier features of 3 colours
        return vae.config.out_channels
    patchified = type(vae).__name__ in ("AutoencoderKLWan", "AutoencoderKLQwenImage21")
    patch = vae.config.get("patch_size") if patchified else None
    return vae.config.get("in_channels", 3) // (patch or 1) ** 2


def sample_input(name: str, vae, kind: str, height: int, width: int, frames: int = 1, batch: int | None = None,
                 seed: int = 1) -> torch.Tensor:
    """A random latent (kind "decode", height x width latent rows) or image/video (kind "encode", in pixels)."""
    generator = torch.Generator().manual_seed(seed)
    if batch is None:  # Allegro's tiles hold one sample; HunyuanVideo 1.5's (batch, tokens, tokens) causal mask
        # broadcasts against its (batch, 1 head, tokens, dim) queries for one sample only
        batch = 1 if CONFIGS[name][0] in ("AutoencoderKLAllegro", "AutoencoderKLHunyuanVideo15") else 2
    channels = latent_channels(vae) if kind == "decode" else image_channels(vae)
    five_d = name in VIDEO or name == "qwenimage"
    shape = (batch, channels, frames, height, width) if five_d else (batch, channels, height, width)
    return torch.randn(shape, generator=generator)


def run_vae(vae, kind: str, sample: torch.Tensor) -> torch.Tensor:
    """decode(z).sample or the encoder's posterior mode (its mean; DC-AE's latent), the call a pipeline makes. The
    global generator is seeded first, for VAEs that draw noise while decoding."""
    torch.manual_seed(0)
    with torch.no_grad():
        if kind == "decode":
            if type(vae).__name__ == "AutoencoderKLLTXVideo" and vae.config.timestep_conditioning:
                temb = torch.linspace(0.02, 0.05, sample.shape[0])
                return vae.decode(sample, temb).sample
            return vae.decode(sample).sample
        encoded = vae.encode(sample)
        return encoded.latent if hasattr(encoded, "latent") else encoded.latent_dist.mode()
