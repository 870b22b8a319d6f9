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
    `mode(owner)` the `F.pad` mode of those rows ("constant" zeros or "replicate").
    """

    conv: str
    rows: Callable[[nn.Module], tuple[int, int] | None]
    mode: Callable[[nn.Module], str] = lambda _owner: "constant"


@dataclass(frozen=True)
class VaePlan:
    """Per-VAE knowledge, by module class name.

    - `regions`: submodule -> rows per unit of its input split (the encoder's total downsampling, so every rank's
      rows start on a multiple of each stride and space-to-depth factor; 1 for decoders).
    - `row_local`: classes whose forward treats every row alike apart from the convolutions, group norms,
      attention and pads this plan declares (reviewed by hand). Any other class inside a region is refused.
    - `prepadded`: owner class -> the convolution it pads before calling.
    - `attention`: class -> "tokens" (an attention module: SDPA over the rank's tokens, keys from every rank) or
      "causal_frames" (a block whose attention modules see tokens ordered frame by frame, a query the keys of its own
      and earlier frames; the block's input gives the frame count).
    - `frame_noise`: classes that draw `torch.randn((rows, columns))` for the output of the convolution they just
      ran (noise injection); each rank draws the whole frame and keeps its rows.
    """

    regions: dict[str, Callable[[nn.Module], int]]
    row_local: tuple[str, ...]
    prepadded: dict[str, PrePadded] = field(default_factory=dict)
    attention: dict[str, str] = field(default_factory=dict)
    frame_noise: tuple[str, ...] = ()
