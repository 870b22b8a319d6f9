"""Whole-pipeline cases run on every rank by tests/test_pipelines.py (gloo, CPU)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from diffusers import DiffusionPipeline

import paradiff
from paradiff.runtime.wrappers import wrappers
from paradiff_testkit.pipelines import default_call_kwargs


def _pixels(output) -> np.ndarray:
    """Images (image pipelines) or frames (video pipelines) as one array."""
    return np.asarray(output.frames if hasattr(output, "frames") else output.images)


def _config(tp: int = 1, ring: int = 1, ulysses: int = 1, cfg: int = 1, dp: int = 1) -> paradiff.ParallelConfig:
    return paradiff.ParallelConfig.from_degrees(tp=tp, ring=ring, ulysses=ulysses, cfg=cfg, data=dp)


def pipeline_equivalence(family: str, folder: str, degrees: dict, seeds=(0,), steps: int = 3) -> dict:
    """Images from the parallel pipeline equal the single-process pipeline's, same seed."""
    torch.set_num_threads(1)
    kwargs = dict(default_call_kwargs(family), num_inference_steps=steps)
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    pipeline = paradiff.load_pipeline(folder, parallel_config=_config(**degrees))
    pipeline.set_progress_bar_config(disable=True)
    calls = {}
    for name, module in pipeline.components.items():
        if name.startswith("transformer") and module is not None:
            calls[name] = 0
            module.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    diffs = {}
    for seed in seeds:
        expected = _pixels(reference(**kwargs, generator=torch.Generator().manual_seed(seed)))
        actual = _pixels(pipeline(**kwargs, seed=seed))
        diffs[seed] = float(np.abs(actual - expected).max())
    splitters = pipeline._paradiff_pipeline.cfgs
    return {"rank": dist.get_rank(), "diffs": diffs, "output_rank": pipeline.is_output_rank,
            "cfg_forwards": sum(s.computed for s in splitters) if splitters else None,
            "transformer_params": {name: (sum(p.numel() for p in module.parameters()),
                                          sum(p.numel() for p in getattr(reference, name).parameters()))
                                   for name, module in pipeline.components.items()
                                   if name.startswith("transformer") and module is not None},
            "transformer_calls": calls, "wrappers": wrappers(pipeline.transformer)}


def data_parallel_prompts(family: str, folder: str, degrees: dict, prompts: list[str]) -> dict:
    """Each data replica makes its share of the prompts; prompt i always uses seed 100 + i."""
    torch.set_num_threads(1)
    kwargs = default_call_kwargs(family)
    kwargs.pop("prompt", None)
    pipeline = paradiff.load_pipeline(folder, parallel_config=_config(**degrees))
    pipeline.set_progress_bar_config(disable=True)
    made = {}
    with paradiff.split_between_processes(list(enumerate(prompts)), pipeline) as share:
        for index, prompt in share:
            made[index] = _pixels(pipeline(prompt=prompt, seed=100 + index, **kwargs)).tolist()
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    diffs = {}
    for index, image in made.items():
        expected = _pixels(reference(prompt=prompts[index], generator=torch.Generator().manual_seed(100 + index),
                                     **kwargs))
        diffs[index] = float(np.abs(np.asarray(image) - expected).max())
    return {"rank": dist.get_rank(), "indices": sorted(made), "diffs": diffs, "output_rank": pipeline.is_output_rank}


def cfg_without_guidance(family: str, folder: str) -> str:
    pipeline = paradiff.load_pipeline(folder, parallel_config=_config(cfg=2, tp=dist.get_world_size() // 2))
    kwargs = dict(default_call_kwargs(family))
    kwargs.pop("negative_prompt", None)
    kwargs["true_cfg_scale"] = 1.0
    try:
        pipeline(**kwargs)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def mismatched_seed(family: str, folder: str) -> str:
    """Rank 1 asks for another seed: the ranks must refuse before the first collective of the generation."""
    pipeline = paradiff.load_pipeline(folder, parallel_config=_config(ulysses=dist.get_world_size()))
    pipeline.set_progress_bar_config(disable=True)
    try:
        pipeline(**default_call_kwargs(family), seed=1 if dist.get_rank() == 1 else 0)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"
