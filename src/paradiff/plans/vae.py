"""How each covered VAE splits by rows: its split regions, the pads it makes itself, its attention.

Every class listed in `row_local` was read for operations that mix rows (pads, interpolation, reshapes of the
height, norms, attention) before being listed; see paradiff/vae/__init__.py for the mechanism.
"""

from __future__ import annotations

import math

from paradiff.vae.plan import FramePieces, PrePadded, VaePlan


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

# Sana's DC-AE: ReLU linear attention (token sums over every rank), channel <-> space reshapes that keep a row's
# pixels in its rows (pixel (un)shuffle, nearest upsampling, channel means / repeats), norms over channels only
DC = VaePlan(
    regions={"encoder": lambda vae: vae.spatial_compression_ratio, "decoder": _DECODER},
    row_local=("Encoder", "Decoder", "ResBlock", "EfficientViTBlock", "GLUMBConv", "DCDownBlock2d", "DCUpBlock2d",
               "SanaMultiscaleAttentionProjection", "RMSNorm", "LayerNorm", "BatchNorm2d"),
    eval_only=("BatchNorm2d",),  # "batch_norm" blocks: per-channel running statistics in eval mode
    attention={"SanaMultiscaleLinearAttention": "linear"},
    processors=("SanaMultiscaleAttnProcessor2_0",),
)


def _safe_conv_pieces(conv, shape) -> int:
    """CogVideoXSafeConv3d: above 2 GiB of input (counted at 2 bytes a value), int(GiB / 2) + 1 frame pieces."""
    gib = math.prod(shape) * 2 / 1024**3
    return int(gib / 2) + 1 if gib > 2 else 1


_SAFE_CONV = FramePieces(count=_safe_conv_pieces, overlap=lambda conv: conv.kernel_size[0] - 1)
# CogVideoXCausalConv3d: "replicate" pads every side itself (Mochi); other modes leave the rows to the conv's zeros
_CAUSAL_CONV = PrePadded("conv", lambda m: (m.height_pad, m.height_pad) if m.pad_mode == "replicate" else None,
                         lambda m: m.pad_mode)

# CogVideoX: causal 3-D convs with a frame cache (each rank keeps its rows'), frame batches, spatial norms that
# upsample the latent band by powers of 2 (nearest: a row's own rows), frames pooled per pixel
COGVIDEOX = VaePlan(
    regions={"encoder": _downsamplings(lambda c: len(c.block_out_channels) - 1), "decoder": _DECODER},
    row_local=("CogVideoXEncoder3D", "CogVideoXDecoder3D", "CogVideoXCausalConv3d", "CogVideoXDownBlock3D",
               "CogVideoXUpBlock3D", "CogVideoXMidBlock3D", "CogVideoXResnetBlock3D", "CogVideoXSpatialNorm3D",
               "CogVideoXDownsample3D", "CogVideoXUpsample3D"),
    prepadded={"CogVideoXCausalConv3d": _CAUSAL_CONV,
               # pads one zero row at the bottom (and column at the right) before its stride-2 conv
               "CogVideoXDownsample3D": PrePadded("conv", lambda m: (0, 1))},
    frame_pieces={"CogVideoXSafeConv3d": _SAFE_CONV},
)

# Mochi: CogVideoX's causal convs in replicate mode, per-frame group norms, depth-to-space upsampling through a
# linear layer; the encoder's attention runs over the frames of each pixel (row-local)
MOCHI = VaePlan(
    regions={"encoder": lambda vae: vae.spatial_compression_ratio, "decoder": _DECODER},
    row_local=("MochiEncoder3D", "MochiDecoder3D", "MochiMidBlock3D", "MochiDownBlock3D", "MochiUpBlock3D",
               "MochiResnetBlock3D", "MochiChunkedGroupNorm3D", "CogVideoXCausalConv3d", "FourierFeatures",
               "Attention", "LpNorm"),
    processors=("MochiVaeAttnProcessor2_0",),
    prepadded={"CogVideoXCausalConv3d": _CAUSAL_CONV},
    frame_pieces={"CogVideoXSafeConv3d": _SAFE_CONV},
)

# Allegro: 2-D blocks over frames folded into the batch, temporal convs (kernel 1 along the height, or 3 with zero
# padding in the up/down layers); decodes and encodes only through its tiles, each tile split by rows
ALLEGRO = VaePlan(
    regions={"encoder": _downsamplings(lambda c: len(c.block_out_channels) - 1), "decoder": _DECODER},
    row_local=("AllegroEncoder3D", "AllegroDecoder3D", "AllegroDownBlock3D", "AllegroUpBlock3D",
               "AllegroMidBlock3DConv", "AllegroTemporalConvLayer", "ResnetBlock2D", "Downsample2D", "Upsample2D",
               "Attention"),
    prepadded=KL.prepadded,
    attention={"Attention": "tokens"},  # per frame, over the frame's rows
)

# EasyAnimate's MagVit: causal 3-D convs run one output frame at a time (with a per-module frame cache: each rank
# keeps its rows'), downsamplers that pad a zero row at the bottom, nearest / per-frame upsampling
MAGVIT = VaePlan(
    regions={"encoder": lambda vae: vae.spatial_compression_ratio, "decoder": _DECODER},
    row_local=("EasyAnimateEncoder", "EasyAnimateDecoder", "EasyAnimateCausalConv3d", "EasyAnimateResidualBlock3D",
               "EasyAnimateDownBlock3D", "EasyAnimateUpBlock3d", "EasyAnimateMidBlock3d", "EasyAnimateDownsampler3D",
               "EasyAnimateUpsampler3D"),
    prepadded={"EasyAnimateDownsampler3D": PrePadded("conv", lambda m: (0, 1))},
)

# Cosmos: Haar wavelet patching (stride-2 row pairs, whole on each rank at the encoder's alignment), causal convs
# that zero-pad themselves, spatial attention per frame over its rows, temporal attention per pixel (row-local)
COSMOS = VaePlan(
    regions={"encoder": lambda vae: vae.config.spatial_compression_ratio, "decoder": _DECODER},
    row_local=("CosmosEncoder3d", "CosmosDecoder3d", "CosmosPatchEmbed3d", "CosmosUnpatcher3d",
               "CosmosConvProjection3d", "CosmosCausalConv3d", "CosmosResnetBlock3d", "CosmosCausalGroupNorm",
               "CosmosDownBlock3d", "CosmosUpBlock3d", "CosmosMidBlock3d", "CosmosDownsample3d", "CosmosUpsample3d",
               "CosmosCausalAttention"),
    prepadded={
        "CosmosCausalConv3d": PrePadded("", lambda m: (m.spatial_pad[2], m.spatial_pad[3]), lambda m: m.pad_mode),
        # pads one zero row at the bottom before its stride-2 conv (which pads nothing more) and its 2 x 2 pooling
        "CosmosDownsample3d": PrePadded("conv1", lambda m: (0, 1) if m.spatial_downsample else None),
    },
    attention={"CosmosSpatialAttentionProcessor2_0": "tokens"},
    processors=("CosmosSpatialAttentionProcessor2_0", "CosmosTemporalAttentionProcessor2_0"),
)

# HunyuanImage 2.1: 2-D, space-to-depth (2 x 2) down / depth-to-space up with channel-mean / repeat shortcuts, one
# single-head attention over the image's tokens in the mid blocks
HUNYUAN_IMAGE = VaePlan(
    regions={"encoder": lambda vae: vae.config.spatial_compression_ratio, "decoder": _DECODER},
    row_local=("HunyuanImageEncoder2D", "HunyuanImageDecoder2D", "HunyuanImageResnetBlock",
               "HunyuanImageDownsample", "HunyuanImageUpsample", "HunyuanImageMidBlock"),
    attention={"HunyuanImageAttentionBlock": "tokens"},
)


def _hunyuan_dcae(prefix: str, resample: tuple[str, str], attention: str) -> VaePlan:
    """HunyuanVideo 1.5 and the HunyuanImage 2.1 refiner: causal 3-D convs that pad themselves (replicate), RMS norms
    over channels, DC-AE style space-to-depth resampling, one attention over every (frame, row, column) token."""
    return VaePlan(
        regions={"encoder": lambda vae: vae.config.spatial_compression_ratio, "decoder": _DECODER},
        row_local=tuple(f"{prefix}{name}" for name in (
            "Encoder3D", "Decoder3D", "CausalConv3d", "RMS_norm", "ResnetBlock", "MidBlock", "DownBlock3D",
            "UpBlock3D")) + resample,
        prepadded={f"{prefix}CausalConv3d": PrePadded(
            "conv", lambda m: (m.time_causal_padding[2], m.time_causal_padding[3]), lambda m: m.pad_mode)},
        attention={f"{prefix}AttnBlock": attention},
    )


# a query sees the keys of its own and earlier frames (the block builds that mask from its input)
HUNYUAN_VIDEO15 = _hunyuan_dcae("HunyuanVideo15", ("HunyuanVideo15Downsample", "HunyuanVideo15Upsample"),
                                "causal_frames")
HUNYUAN_IMAGE_REFINER = _hunyuan_dcae(
    "HunyuanImageRefiner", ("HunyuanImageRefinerDownsampleDCAE", "HunyuanImageRefinerUpsampleDCAE"), "tokens")

# LTX-2: LTX-Video's layout; the decoder pads by reflection (rebuilt from the image's own rows at its edges)
LTX2_VIDEO = VaePlan(
    regions={"encoder": lambda vae: vae.spatial_compression_ratio, "decoder": _DECODER},
    row_local=("LTX2VideoEncoder3d", "LTX2VideoDecoder3d", "LTX2VideoCausalConv3d", "LTX2VideoResnetBlock3d",
               "LTX2VideoDownsampler3d", "LTX2VideoUpsampler3d", "LTX2VideoDownBlock3D", "LTX2VideoMidBlock3d",
               "LTX2VideoUpBlock3d", "PerChannelRMSNorm", "LayerNorm",  # both over channels only
               "PixArtAlphaCombinedTimestepSizeEmbeddings", "Timesteps", "TimestepEmbedding"),
    frame_noise=("LTX2VideoResnetBlock3d",),
)


def _kandinsky_pieces(conv, shape) -> int:
    """Kandinsky6SRSafeConv3d: above 2e9 values, ceil(values / 2e9) frame pieces; where a piece would hold fewer
    frames than the kernel, the model convolves window by window, here in as many pieces as keep the kernel's frames
    (the same convolution either way)."""
    values = math.prod(shape)
    if values <= 2 * 10**9:
        return 1
    return max(1, min(math.ceil(values / (2 * 10**9)), shape[2] // conv.kernel_size[0]))


# Kandinsky 6 super-resolution K-VAE: CogVideoX-like spatial norms (nearest upsampled latent bands), causal convs
# that zero-pad themselves and carry their frame padding in a per-rank cache across segments
KANDINSKY6_SR = VaePlan(
    regions={"encoder": lambda vae: vae.spatial_compression_ratio, "decoder": _DECODER},
    row_local=("Kandinsky6SREncoder3D", "Kandinsky6SRDecoder3D", "Kandinsky6SRCausalConv3d",
               "Kandinsky6SRResnetBlock3D", "Kandinsky6VAERMSNorm", "Kandinsky6SRSpatialNorm3D",
               "Kandinsky6SRDownsample", "Kandinsky6SRUpsample", "PixelUnshuffle",
               "Module"),  # plain containers (down[i], up[i], mid)
    prepadded={"Kandinsky6SRCausalConv3d": PrePadded("conv", lambda m: (m.height_pad, m.height_pad))},
    frame_pieces={"Kandinsky6SRSafeConv3d": FramePieces(count=_kandinsky_pieces,
                                                        overlap=lambda conv: conv.kernel_size[0] - 1)},
)

VAE_PLANS = {
    "AutoencoderKL": KL,
    "AutoencoderKLFlux2": KL,
    "AutoencoderKLQwenImage": _wan_like("QwenImage"),
    "AutoencoderKLWan": _wan_like("Wan", extra=("WanResidualDownBlock", "AvgDown3D", "WanResidualUpBlock", "DupUp3D")),
    "AutoencoderKLHunyuanVideo": HUNYUAN_VIDEO,
    "AutoencoderKLLTXVideo": LTX_VIDEO,
    "AutoencoderDC": DC,
    "AutoencoderKLCogVideoX": COGVIDEOX,
    "AutoencoderKLMochi": MOCHI,
    "AutoencoderKLAllegro": ALLEGRO,
    "AutoencoderKLMagvit": MAGVIT,
    "AutoencoderKLCosmos": COSMOS,
    "AutoencoderKLHunyuanImage": HUNYUAN_IMAGE,
    "AutoencoderKLHunyuanImageRefiner": HUNYUAN_IMAGE_REFINER,
    "AutoencoderKLHunyuanVideo15": HUNYUAN_VIDEO15,
    "AutoencoderKLQwenImage21": _wan_like("QwenImage21", extra=(
        "QwenImage21ResidualDownBlock", "QwenImage21AvgDown3D", "QwenImage21ResidualUpBlock", "QwenImage21DupUp3D")),
    "AutoencoderKLLTX2Video": LTX2_VIDEO,
    "Kandinsky6SRVAE": KANDINSKY6_SR,
}


# The other VAE classes of diffusers 0.42.1's DiT pipelines, with what blocks a split by rows (they decode whole on
# each rank). Any class in neither table is refused as not reviewed.
VAE_REFUSALS = {
    "AutoencoderKLMiniMaxH3": "its decoder is a ViT over every patch token plus learnt register and class tokens, "
                              "with rotary positions normalised by the whole grid's size: a band of rows would get "
                              "other positions and no shared tokens (and it tiles by default)",
    "AutoencoderOobleck": "an audio VAE (Stable Audio, ACE-Step): a 1-D waveform has no image rows to split",
    "AutoencoderSAME": "an audio VAE (Stable Audio 3): a 1-D signal has no image rows to split",
    "LongCatAudioDiTVae": "an audio VAE (LongCat audio): a 1-D waveform has no image rows to split",
    "RFD4ProteinaAutoencoder": "a protein-structure autoencoder: residues and atom coordinates, no image rows",
}


def vae_refusal(class_name: str) -> str:
    """Why paradiff does not split a VAE class (one without a plan)."""
    return VAE_REFUSALS.get(class_name, "paradiff has not reviewed its layers for operations that mix rows")


def vae_plan(vae) -> VaePlan | None:
    return VAE_PLANS.get(type(vae).__name__)
