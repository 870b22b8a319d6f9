"""How each covered VAE splits by rows: its split regions, the pads it makes itself, its attention.

Every class listed in `row_local` was read for operations that mix rows (pads, interpolation, reshapes of the
height, norms, attention) before being listed; see paradiff/vae/__init__.py for the mechanism.
"""

from __future__ import annotations

from paradiff.vae.plan import PrePadded, VaePlan


def _downsamplings(count: int):
    return lambda vae: 2 ** count(vae.config)


_DECODER = lambda vae: 1  # noqa: E731 - decoders upsample only, any split works

# Encoder / Decoder of diffusers' vae.py, shared by AutoencoderKL (FLUX.1, SD3, ...) and AutoencoderKLFlux2.
KL = VaePlan(
    regions={"encoder": _downsamplings(lambda c: len(c.block_out_channels) - 1), "decoder": _DECODER},
    row_local=("Encoder", "Decoder", "DownEncoderBlock2D", "UpDecoderBlock2D", "UNetMidBlock2D", "ResnetBlock2D",
               "Downsample2D", "Upsample2D", "Attention"),
    # Downsample2D(padding=0) pads one zero row at the bottom (and column at the right) before its stride-2 conv
    prepadded={"Downsample2D": PrePadded("conv", lambda m: (0, 1) if m.use_conv and m.padding == 0 else None)},
    attention={"Attention": "tokens"},
)


def _wan_like(prefix: str, extra: tuple[str, ...] = ()) -> VaePlan:
    """Wan 2.x and Qwen-Image: causal 3-D convs that pad themselves; downsampling pads a zero row at the bottom."""
    return VaePlan(
        regions={"encoder": _downsamplings(lambda c: len(c.dim_mult) - 1), "decoder": _DECODER},
        row_local=tuple(f"{prefix}{name}" for name in (
            "Encoder3d", "Decoder3d", "CausalConv3d", "RMS_norm", "Upsample", "Resample", "ResidualBlock",
            "AttentionBlock", "MidBlock", "UpBlock")) + extra + ("ZeroPad2d",),  # ZeroPad2d: see prepadded
        prepadded={
            f"{prefix}CausalConv3d": PrePadded("", lambda m: (m._padding[2], m._padding[3])),
            f"{prefix}Resample": PrePadded("resample.1", lambda m: (0, 1) if m.mode.startswith("down") else None),
        },
        attention={f"{prefix}AttentionBlock": "tokens"},  # per frame, over the frame's rows
    )


HUNYUAN_VIDEO = VaePlan(
    regions={"encoder": lambda vae: vae.config.spatial_compression_ratio, "decoder": _DECODER},
    row_local=("HunyuanVideoEncoder3D", "HunyuanVideoDecoder3D", "HunyuanVideoCausalConv3d",
               "HunyuanVideoUpsampleCausal3D", "HunyuanVideoDownsampleCausal3D", "HunyuanVideoResnetBlockCausal3D",
               "HunyuanVideoMidBlock3D", "HunyuanVideoDownBlock3D", "HunyuanVideoUpBlock3D", "Attention"),
    # replicate-pads one row on each side (kernel 3), then its inner Conv3d may add zero padding of its own
    prepadded={"HunyuanVideoCausalConv3d": PrePadded(
        "conv", lambda m: (m.time_causal_padding[2], m.time_causal_padding[3]), lambda m: m.pad_mode)},
    # the mid block's attention masks keys of later frames; its tokens are (frame, row, column) in that order
    attention={"HunyuanVideoMidBlock3D": "causal_frames"},
)

LTX_VIDEO = VaePlan(
    # space-to-depth patching and downsamplers need whole patches per rank: split on the total spatial factor
    regions={"encoder": lambda vae: vae.spatial_compression_ratio, "decoder": _DECODER},
    row_local=("LTXVideoEncoder3d", "LTXVideoDecoder3d", "LTXVideoCausalConv3d", "LTXVideoResnetBlock3d",
               "LTXVideoDownsampler3d", "LTXVideoUpsampler3d", "LTXVideoDownBlock3D", "LTXVideo095DownBlock3D",
               "LTXVideoMidBlock3d", "LTXVideoUpBlock3d", "RMSNorm", "LayerNorm",  # both over channels only
               "PixArtAlphaCombinedTimestepSizeEmbeddings", "Timesteps", "TimestepEmbedding"),
    # decoder_inject_noise: spatial noise added right after conv1 and conv2
    frame_noise=("LTXVideoResnetBlock3d",),
)

VAE_PLANS = {
    "AutoencoderKL": KL,
    "AutoencoderKLFlux2": KL,
    "AutoencoderKLQwenImage": _wan_like("QwenImage"),
    "AutoencoderKLWan": _wan_like("Wan", extra=("WanResidualDownBlock", "AvgDown3D", "WanResidualUpBlock", "DupUp3D")),
    "AutoencoderKLHunyuanVideo": HUNYUAN_VIDEO,
    "AutoencoderKLLTXVideo": LTX_VIDEO,
}


def vae_plan(vae) -> VaePlan | None:
    return VAE_PLANS.get(type(vae).__name__)
