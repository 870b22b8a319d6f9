"""Modular Diffusers pipelines on the mesh, run on every rank by tests/test_modular.py (gloo, CPU)."""

from __future__ import annotations

import torch

import paradiff
from paradiff_testkit import zoo


def modular_refusals(folders: dict[str, str]) -> list[str]:
    """Every bad request on a modular pipeline, each as "ErrorType: message" (every rank raises the same)."""
    from diffusers.guiders import ClassifierFreeGuidance

    torch.set_num_threads(1)
    messages = []

    def attempt(action) -> None:
        try:
            action()
        except Exception as exc:  # noqa: BLE001
            messages.append(f"{type(exc).__name__}: {exc}")
        else:
            messages.append("no error")

    cfg2 = paradiff.ParallelConfig.from_degrees(cfg=2)
    # a guidance-distilled modular pipeline (no guider): refused at load, before any weight is read
    attempt(lambda: paradiff.load_pipeline(folders["Krea2TurboModularPipeline"], parallel_config=cfg2))
    pipeline = paradiff.load_pipeline(folders["QwenImageModularPipeline"], parallel_config=cfg2)
    pipeline.set_progress_bar_config(disable=True)
    kwargs = dict(zoo.call_kwargs("QwenImageModularPipeline"), num_inference_steps=1)
    # another seed on rank 1: the ranks refuse before the first collective of the generation
    attempt(lambda: pipeline(**kwargs, seed=torch.distributed.get_rank(), output="images"))
    # a guider that does not guide (scale 1): one branch per step, nothing for the second cfg rank
    pipeline.update_components(guider=ClassifierFreeGuidance(guidance_scale=1.0))
    attempt(lambda: pipeline(**kwargs, output="images"))
    # no guider at all
    pipeline.update_components(guider=None)
    attempt(lambda: pipeline(**kwargs, output="images"))
    return messages


def modular_cfg_too_wide(folder: str) -> str:
    """cfg_degree=3 (this pool's size) with the pipeline's own 2-branch CFG guider: refused at the call."""
    torch.set_num_threads(1)
    pipeline = paradiff.load_pipeline(folder, parallel_config=paradiff.ParallelConfig.from_degrees(cfg=3))
    try:
        pipeline(**dict(zoo.call_kwargs("WanModularPipeline"), num_inference_steps=1), output="videos")
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def guided_standard_equivalence(folder: str, modes: dict[str, dict]) -> dict:
    """HunyuanVideo15Pipeline, a standard pipeline guiding through its `guider` component: diffusers' single-process
    call, then paradiff's in each mode, same seed."""
    import numpy as np
    import torch.distributed as dist
    from diffusers import DiffusionPipeline

    from paradiff_testkit.guiders import guided_call_kwargs, shorten_text

    torch.set_num_threads(1)
    kwargs = guided_call_kwargs()
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    shorten_text(reference)
    expected = np.asarray(reference(**kwargs, generator=torch.Generator().manual_seed(0)).frames)
    results = {}
    for mode, degrees in modes.items():
        pipeline = paradiff.load_pipeline(folder, parallel_config=paradiff.ParallelConfig.from_degrees(**degrees))
        pipeline.set_progress_bar_config(disable=True)
        shorten_text(pipeline)
        actual = np.asarray(pipeline(**kwargs, seed=0).frames)
        branches = pipeline._paradiff_pipeline.cfgs
        results[mode] = {"max_abs_diff": float(np.abs(actual - expected).max()),
                         "scale": float(np.abs(expected).max()),
                         "branch_counts": branches[0].branch_counts if branches else None,
                         "computed": branches[0].computed if branches else None}
    return {"rank": dist.get_rank(), "modes": results}
