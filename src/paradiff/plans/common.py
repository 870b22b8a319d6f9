"""Plan fragments shared by several model families, and the example-input grid every family's examples take."""

from __future__ import annotations

from dataclasses import dataclass

from paradiff.tensor_parallel.styles import PackedColwise, Style


@dataclass(frozen=True)
class Grid:
    """Token grid of one example input, after patchifying: video families use all of it, image families ignore
    `frames`, audio families use `width` as the length. The default divides by neither 2 nor 4 ranks."""

    frames: int = 3
    height: int = 3
    width: int = 5
    text: int = 7


def joint_attention(prefix: str) -> dict[str, str]:
    """Dual-stream joint attention (image and text projections) as diffusers' Flux-style attention names them:
    Q/K/V colwise (each rank gets heads / tp), both output projections rowwise."""
    return {
        **attention(prefix),
        f"{prefix}.add_q_proj": "colwise",
        f"{prefix}.add_k_proj": "colwise",
        f"{prefix}.add_v_proj": "colwise",
        f"{prefix}.to_add_out": "rowwise",
    }


def attention(prefix: str, norms_across_heads: tuple[str, ...] = ()) -> dict[str, str | Style]:
    """Self- or cross-attention with `to_q/to_k/to_v/to_out.0`: Q/K/V colwise by heads, the output rowwise. The
    named norms (e.g. "norm_q", "norm_k") normalise all heads at once and are split with them."""
    styles: dict[str, str | Style] = {
        f"{prefix}.to_q": "colwise",
        f"{prefix}.to_k": "colwise",
        f"{prefix}.to_v": "colwise",
        f"{prefix}.to_out.0": "rowwise",
    }
    styles.update({f"{prefix}.{norm}": "norm_across_heads" for norm in norms_across_heads})
    return styles


def feed_forward(prefix: str, gated: bool = False) -> dict[str, str | Style]:
    """diffusers' FeedForward (`net.0.proj` in, `net.2` out). Gated activations (GEGLU, SwiGLU) pack the value
    and the gate into one projection, each half split on its own."""
    return {f"{prefix}.net.0.proj": PackedColwise([1, 1]) if gated else "colwise", f"{prefix}.net.2": "rowwise"}


def mlp(prefix: str, first: str = "linear_1", second: str = "linear_2") -> dict[str, str]:
    """A two-layer MLP on a replicated input (timestep / text embedders): colwise in, rowwise out."""
    return {f"{prefix}.{first}": "colwise", f"{prefix}.{second}": "rowwise"}


def basic_transformer_block(prefix: str, gated: bool = False) -> dict[str, str | Style]:
    """diffusers' BasicTransformerBlock: self-attention `attn1`, cross-attention `attn2` and the feed-forward `ff`."""
    return {**attention(f"{prefix}.attn1"), **attention(f"{prefix}.attn2"), **feed_forward(f"{prefix}.ff", gated)}


def adaln_single() -> dict[str, str]:
    """PixArt's AdaLN-single: one modulation (dim -> 6 dim) for all blocks, on the replicated timestep embedding."""
    return {**mlp("adaln_single.emb.timestep_embedder"), "adaln_single.linear": "rowwise_split_input"}


def split_input(*names: str) -> dict[str, str]:
    """Linears on a replicated input whose output every rank needs whole (AdaLN modulations, embedding
    projections): rowwise, each rank multiplying its slice of the input ("rowwise_split_input")."""
    return dict.fromkeys(names, "rowwise_split_input")
