"""How each covered pipeline's latents look between denoising steps, for previews (runtime/previews.py).

A preview needs two pieces of per-pipeline knowledge: how the latents the pipeline hands its step callback become a
grid (batch, channels, rows, columns) with one cell per patch of `cell` x `cell` image pixels, and how such a grid
becomes the input of the VAE's decoder (what the pipeline does after its last step). Read from each pipeline's
`__call__` (diffusers 0.42) before being listed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class PreviewLayout:
    cell: Callable  # pipeline -> image pixels per grid cell side
    grid: Callable  # (latents from the step callback, rows, columns) -> (batch, channels, rows, columns)
    decoder_input: Callable  # (grid, vae) -> the tensor the pipeline hands vae.decode


def _flux2_decoder_input(grid: torch.Tensor, vae) -> torch.Tensor:
    # Flux2Pipeline: undo the VAE's batch norm on the patchified latents, then unpatchify 2 x 2 (a pixel shuffle)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(grid)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(grid)
    return torch.nn.functional.pixel_shuffle(grid * std + mean, 2)


# Flux2Pipeline packs its latents as tokens in row-major order, (batch, rows * columns, channels * 2 * 2)
FLUX2 = PreviewLayout(
    cell=lambda pipeline: pipeline.vae_scale_factor * 2,
    grid=lambda latents, rows, columns: latents.transpose(1, 2).reshape(latents.shape[0], -1, rows, columns),
    decoder_input=_flux2_decoder_input,
)

LAYOUTS = {"Flux2Pipeline": FLUX2}


def preview_layout(pipeline) -> PreviewLayout | None:
    """The layout of `pipeline`'s latents (its diffusers class, before paradiff's mixins), None when not covered."""
    for cls in type(pipeline).__mro__:
        if cls.__name__ in LAYOUTS:
            return LAYOUTS[cls.__name__]
    return None


def covered_pipelines() -> list[str]:
    return sorted(LAYOUTS)
