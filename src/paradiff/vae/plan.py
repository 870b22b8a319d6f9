"""Declarative description of how a VAE is split by rows (the per-model entries live in `plans/vae.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn


@dataclass(frozen=True)
class PrePadded:
    """A convolution whose input the model pads itself just before calling it (`F.pad`, `nn.ZeroPad2d`, a causal
    pad), found at `conv` below an owner module ("" when the owner is the convolution).

    `rows(owner)` gives the (top, bottom) rows added along the height, or None when this owner adds none;
    `mode(owner)` the `F.pad` mode of those rows ("constant" zeros or "replicate"). Two owners padding one
    convolution (a block pads, then the convolution pads again) add up.
    """

    conv: str
    rows: Callable[[nn.Module], tuple[int, int] | None]
    mode: Callable[[nn.Module], str] = lambda _owner: "constant"


@dataclass(frozen=True)
class FramePieces:
    """A convolution whose forward runs over its input's frames in overlapping pieces, as many as `count(conv,
    shape)` gives for an input of that shape (a memory device: CogVideoX's per-2-GiB pieces), each piece after the
    first starting `overlap(conv)` frames into the one before it. A rank holds only its rows, so its own count could
    differ from another rank's (and so would the number of halo exchanges): while split, every rank cuts the pieces
    the whole input would get, which are also those one device cuts."""

    count: Callable[[nn.Module, tuple[int, ...]], int]
    overlap: Callable[[nn.Module], int]


@dataclass(frozen=True)
class VaePlan:
    """Per-VAE knowledge, by module class name.

    - `regions`: submodule -> rows per unit of its input split (the encoder's total downsampling, so every rank's
      rows start on a multiple of each stride and space-to-depth factor; 1 for decoders). A region may return a
      tuple (CogVideoX's and Mochi's `(sample, conv_cache)`): its first element is gathered, the rest (per-rank
      state of the rank's own rows, fed back by the next call) is returned as each rank has it.
    - `row_local`: classes whose forward treats every row alike apart from the convolutions, group norms,
      attention and pads this plan declares (reviewed by hand). Any other class inside a region is refused.
    - `eval_only`: row-local classes only in eval mode (batch norms with running statistics); a split call with one
      of them in training mode is refused.
    - `prepadded`: owner class -> the convolution it pads before calling.
    - `attention`: module or processor class -> "tokens" (an attention module: SDPA over the rank's tokens, keys
      from every rank), "causal_frames" (a block whose attention modules see tokens ordered frame by frame, a query
      the keys of its own and earlier frames; the block's input gives the frame count) or "linear" (ReLU linear
      attention computed by the module's `apply_linear_attention` / `apply_quadratic_attention` over (batch, heads,
      dim, tokens), as DC-AE's multiscale attention: the token sums of every rank).
    - `processors`: the attention processor classes reviewed for this VAE; a module using another is refused.
    - `frame_noise`: classes that draw `torch.randn((rows, columns))` for the output of the convolution they just
      ran (noise injection); each rank draws the whole frame and keeps its rows.
    - `frame_pieces`: convolution classes that run their frames in pieces whose count depends on the input size.
    """

    regions: dict[str, Callable[[nn.Module], int]]
    row_local: tuple[str, ...]
    eval_only: tuple[str, ...] = ()
    prepadded: dict[str, PrePadded] = field(default_factory=dict)
    attention: dict[str, str] = field(default_factory=dict)
    processors: tuple[str, ...] = ("AttnProcessor2_0",)
    frame_noise: tuple[str, ...] = ()
    frame_pieces: dict[str, FramePieces] = field(default_factory=dict)
