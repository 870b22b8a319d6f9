"""`--compare`: the same generation by diffusers' own pipeline in this one process, as the reference."""

from __future__ import annotations

import numpy as np
import torch

from .outputs import Output, first_output


def compare_single_process(model: str, dtype: torch.dtype, kwargs: dict, seed: int, index: int, prompt: str,
                           output: Output, cache=None) -> dict:
    """Differences between `output` (prompt `index`'s image, video or sound) and diffusers' single-process result,
    with the same step cache (`cache`, a diffusers cache config) when one is given.

    Returns {"max_abs_diff": float}; for a video also "max_abs_diff_per_frame" (every frame is compared), and
    "max_abs_diff_audio" when it has a soundtrack.
    """
    from diffusers import DiffusionPipeline

    import paradiff

    reference = DiffusionPipeline.from_pretrained(model, dtype=dtype)
    reference.set_progress_bar_config(disable=True)
    if cache is not None:
        paradiff.enable_cache(reference.transformer, cache)  # one process: no reduction, the same decisions
    result = reference(prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed + index), **kwargs)
    expected = first_output(result)
    summary = {"max_abs_diff": _max_difference(expected.array, output.array, expected.kind)}
    if expected.kind == "video":
        difference = np.abs(expected.array.astype(np.float64) - output.array.astype(np.float64))
        summary["max_abs_diff_per_frame"] = [float(frame.max()) for frame in difference]
    if expected.audio is not None and output.audio is not None:
        summary["max_abs_diff_audio"] = _max_difference(expected.audio, output.audio, "soundtrack")
    return summary


def _max_difference(expected: np.ndarray, actual: np.ndarray, kind: str) -> float:
    if expected.shape != actual.shape:
        raise RuntimeError(f"--compare: the single-process {kind} has shape {expected.shape}, the parallel one "
                           f"{actual.shape}")
    return float(np.abs(expected.astype(np.float64) - actual.astype(np.float64)).max())
