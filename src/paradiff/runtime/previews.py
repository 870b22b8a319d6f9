"""Previews of images while they are denoised: the model's prediction of the clean latents (x0) at a step, decoded
cheaply, on the one rank that makes a replica's outputs.

x0 comes from two consecutive latents. A flow-matching Euler step is x_next = x + (sigma_next - sigma) * v, and the
flow's clean end is x0 = x - sigma * v (v = noise - x0 is what the model predicts), so
v = (x_next - x) / (sigma_next - sigma) and x0 = x_next - sigma_next * v: exact, no extra model call, from the
latents the step callback sees. Schedulers other than a deterministic flow-matching Euler step (DDIM, DPM-Solver,
stochastic sampling) give no such x0 here: `x0_unavailable` names why, and no preview is made.

x0 is decoded either by a linear map from a latent cell's channels to its mean RGB, fitted by least squares to the
pipeline's own VAE (a few decodes of random latents, cached per VAE under a folder), then scaled up to the image's
size; or by the VAE itself (exact, a decoder call per preview). How a pipeline's latents form a grid and reach its
decoder is per-pipeline knowledge, handed in as a layout (plans/previews.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

EULER_FLOW_SCHEDULERS = ("FlowMatchEulerDiscreteScheduler",)
FIT_SAMPLES = 6  # random latents decoded for a fit (the last one held out to measure the fit's error)
FIT_CELLS = 8  # rows and columns of each random latent grid
FIT_SEED = 0


def x0_unavailable(scheduler: Any) -> str | None:
    """Why x0 cannot be derived from consecutive latents under `scheduler` (None when it can)."""
    name = type(scheduler).__name__
    if name not in EULER_FLOW_SCHEDULERS:
        return (f"the scheduler {name} is not a flow-matching Euler scheduler ({', '.join(EULER_FLOW_SCHEDULERS)}); "
                "its x0 is not derived here")
    config = scheduler.config
    if config.get("stochastic_sampling", False):
        return f"the scheduler {name} samples stochastically (fresh noise at each step): x0 is not derived here"
    if config.get("invert_sigmas", False):
        return f"the scheduler {name} inverts its sigmas: x0 is not derived here"
    return None


def predicted_x0(previous: torch.Tensor, current: torch.Tensor, sigma_previous: float,
                 sigma_current: float) -> torch.Tensor:
    """x0 after an Euler flow-matching step from `previous` (at sigma_previous) to `current` (at sigma_current)."""
    velocity = (current.float() - previous.float()) / (sigma_current - sigma_previous)
    return current.float() - sigma_current * velocity


@dataclass(frozen=True)
class LinearMap:
    """RGB in [0, 1] of a latent cell = weight @ channels + bias; `fit_error`: the RMS error (0 to 1 scale) on a
    held-out random latent against its VAE decode averaged over each cell."""

    weight: torch.Tensor  # (3, channels)
    bias: torch.Tensor  # (3,)
    fit_error: float

    def __call__(self, grid: torch.Tensor) -> torch.Tensor:
        return torch.einsum("rc,bchw->brhw", self.weight.to(grid), grid) + self.bias.to(grid).view(1, 3, 1, 1)

    def to_json(self) -> dict:
        return {"weight": self.weight.tolist(), "bias": self.bias.tolist(), "fit_error": self.fit_error}

    @classmethod
    def from_json(cls, data: dict) -> "LinearMap":
        return cls(torch.tensor(data["weight"], dtype=torch.float32), torch.tensor(data["bias"], dtype=torch.float32),
                   float(data["fit_error"]))


def vae_fingerprint(vae: torch.nn.Module) -> str:
    """Names the VAE a fitted map belongs to: its class, config and a checksum of each weight (sums, not bytes: a
    cache key, read at every start)."""
    sums = {name: [round(float(t.double().sum()), 6), round(float(t.double().abs().sum()), 6)]
            for name, t in vae.state_dict().items() if t.is_floating_point()}
    config = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
    text = json.dumps([type(vae).__name__, config, sums], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _decode(vae, layout, grid: torch.Tensor) -> torch.Tensor:
    """RGB in [0, 1], (batch, 3, height, width), of a latent grid, through the VAE as the pipeline decodes."""
    parameter = next(vae.parameters())
    decoded = vae.decode(layout.decoder_input(grid.to(parameter.device, parameter.dtype), vae), return_dict=False)[0]
    return ((decoded.float() + 1) / 2).clamp(0, 1)


@torch.no_grad()
def fit_linear_map(pipeline, layout, cache_dir: Path | None = None) -> LinearMap:
    """The least-squares linear map of `pipeline`'s VAE (read from `cache_dir` when fitted before). Random latents
    with structure at two scales (as denoised latents have), drawn from a generator of its own: the pipeline's
    random state is untouched, so outputs do not depend on whether previews were fitted."""
    vae = pipeline.vae
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"linear-{vae_fingerprint(vae)}.json"
        if path.is_file():
            return LinearMap.from_json(json.loads(path.read_text()))
    cell = layout.cell(pipeline)
    channels = _grid_channels(pipeline, layout)
    generator = torch.Generator("cpu").manual_seed(FIT_SEED)
    coarse = torch.randn(FIT_SAMPLES, channels, FIT_CELLS // 2, FIT_CELLS // 2, generator=generator)
    grid = F.interpolate(coarse, scale_factor=2, mode="bilinear", align_corners=False)
    grid = grid + 0.5 * torch.randn(grid.shape, generator=generator)
    rgb = F.avg_pool2d(_decode(vae, layout, grid).cpu(), cell)  # each cell's mean colour
    features = grid.permute(0, 2, 3, 1).reshape(FIT_SAMPLES, -1, channels)
    targets = rgb.permute(0, 2, 3, 1).reshape(FIT_SAMPLES, -1, 3)
    train_x = torch.cat([features[:-1].reshape(-1, channels), torch.ones(features[:-1].numel() // channels, 1)], 1)
    solution = torch.linalg.lstsq(train_x.double(), targets[:-1].reshape(-1, 3).double()).solution.float()
    fitted = LinearMap(solution[:channels].T.contiguous(), solution[channels], 0.0)
    held_out = fitted(grid[-1:]).clamp(0, 1)
    error = float(((held_out - rgb[-1:]) ** 2).mean().sqrt())
    fitted = LinearMap(fitted.weight, fitted.bias, round(error, 5))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")  # two output ranks may write it at once
        partial.write_text(json.dumps(fitted.to_json()))
        os.replace(partial, path)
    return fitted


def _grid_channels(pipeline, layout) -> int:
    """Channels of the pipeline's latent grid: the transformer's input channels (packed latents) or the VAE's."""
    transformer = getattr(pipeline, "transformer", None)
    channels = getattr(getattr(transformer, "config", None), "in_channels", None)
    return int(channels if channels is not None else pipeline.vae.config.latent_channels)


class PreviewMaker:
    """x0 previews of one pipeline call: `observe(latents)` at every step end; `render(...)` at the steps that get a
    preview. `mode`: "linear" (a fitted LinearMap, `linear` given) or "vae" (a decoder call per preview)."""

    def __init__(self, pipeline, layout, mode: str = "linear", linear: LinearMap | None = None) -> None:
        if mode not in ("linear", "vae"):
            raise ValueError(f"preview mode {mode!r}: expected 'linear' or 'vae'")
        if mode == "linear" and linear is None:
            raise ValueError("preview mode 'linear' needs a fitted LinearMap (fit_linear_map)")
        self.pipeline, self.layout, self.mode, self.linear = pipeline, layout, mode, linear
        self._previous: torch.Tensor | None = None

    def reset(self) -> None:
        """A new pipeline call starts: the previous latents are of another call."""
        self._previous = None

    def observe(self, latents: torch.Tensor) -> None:
        self._previous = latents.detach().clone()

    def can_render(self) -> bool:
        """Whether the step just ended has a predecessor (x0 needs two consecutive latents: not after step 1)."""
        return self._previous is not None

    @torch.no_grad()
    def render(self, latents: torch.Tensor, height: int, width: int) -> list[np.ndarray]:
        """The x0 preview of each image in the batch, (height, width, 3) uint8, at the step that produced `latents`
        (call before `observe(latents)`)."""
        scheduler = self.pipeline.scheduler
        index = int(scheduler.step_index)
        sigmas = scheduler.sigmas
        x0 = predicted_x0(self._previous, latents, float(sigmas[index - 1]), float(sigmas[index]))
        cell = self.layout.cell(self.pipeline)
        grid = self.layout.grid(x0, height // cell, width // cell)
        if self.mode == "linear":
            rgb = self.linear(grid).clamp(0, 1)
            rgb = F.interpolate(rgb, size=(height, width), mode="bilinear", align_corners=False)
        else:
            rgb = _decode(self.pipeline.vae, self.layout, grid)
        pixels = (rgb.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        return list(pixels)
