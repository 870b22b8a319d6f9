"""`--compare`: the same generation by diffusers' own pipeline in this one process, as the reference."""

from __future__ import annotations

import numpy as np
import torch


def compare_single_process(model: str, dtype: torch.dtype, kwargs: dict, seed: int, first_output) -> float:
    """Max |difference| between `first_output` (index, prompt, array) and diffusers' single-process result."""
    from diffusers import DiffusionPipeline

    index, prompt, array = first_output
    reference = DiffusionPipeline.from_pretrained(model, dtype=dtype)
    reference.set_progress_bar_config(disable=True)
    expected = reference(prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed + index), **kwargs).images[0]
    return float(np.abs(np.asarray(expected) - array).max())
