"""`--compare`: the same generation by diffusers' own pipeline in this one process, as the reference."""

from __future__ import annotations

import numpy as np
import torch

from .outputs import first_output


def compare_single_process(model: str, dtype: torch.dtype, kwargs: dict, seed: int, index: int, prompt: str,
                           array: np.ndarray, cache=None) -> dict:
    """Differences between `array` (prompt `index`'s image or video) and diffusers' single-process result, with the
    same step cache (`cache`, a diffusers cache config) when one is given.

    Returns {"max_abs_diff": float} and, for a video, "max_abs_diff_per_frame" (every frame is compared).
    """
    from diffusers import DiffusionPipeline

    import paradiff

    reference = DiffusionPipeline.from_pretrained(model, dtype=dtype)
    reference.set_progress_bar_config(disable=True)
    if cache is not None:
        paradiff.enable_cache(reference.transformer, cache)  # one process: no reduction, the same decisions
    result = reference(prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed + index), **kwargs)
    kind, expected = first_output(result)
    if expected.shape != array.shape:
        raise RuntimeError(f"--compare: the single-process {kind} has shape {expected.shape}, the parallel one "
                           f"{array.shape}")
    difference = np.abs(expected.astype(np.float64) - array.astype(np.float64))
    summary = {"max_abs_diff": float(difference.max())}
    if kind == "video":
        summary["max_abs_diff_per_frame"] = [float(frame.max()) for frame in difference]
    return summary
