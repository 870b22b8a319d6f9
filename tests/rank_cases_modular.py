"""Modular Diffusers pipelines on the mesh, run on every rank by tests/test_modular.py (gloo, CPU)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import paradiff
from paradiff.distributed.comm import all_gather_object
from paradiff.runtime.wrappers import wrappers
from paradiff.testing.families import wrong_slices
from paradiff.testing.modular import OUTPUTS, modular_call_kwargs


def skip_layer_guider(family: str):
    """A 3-branch guider: CFG plus skip-layer guidance (the second block skipped), from the second step on (diffusers'
    SkipLayerGuidance starts strictly after the start step)."""
    from diffusers.guiders import SkipLayerGuidance
    from diffusers.hooks import LayerSkipConfig

    # an explicit fqn: "auto" picks from a set, whose order differs between processes
    blocks = "blocks" if family == "wan" else "transformer_blocks"
    return SkipLayerGuidance(guidance_scale=4.0, skip_layer_guidance_scale=2.0, skip_layer_guidance_start=0.0,
                             skip_layer_guidance_stop=1.0, skip_layer_config=LayerSkipConfig(indices=[1], fqn=blocks))


def _first_block(transformer) -> torch.nn.Module:
    for name in ("transformer_blocks", "blocks"):
        if getattr(transformer, name, None) is not None:
            return getattr(transformer, name)[0]
    raise AttributeError(f"{type(transformer).__name__} has no transformer_blocks / blocks")


def _tokens_seen(transformer, into: list) -> None:
    _first_block(transformer).register_forward_pre_hook(
        lambda _m, args, kw: into.append(int(kw.get("hidden_states", args[0] if args else None).shape[1])),
        with_kwargs=True)


def modular_equivalence(family: str, folder: str, modes: dict[str, dict], guider: str | None = None,
                        steps: int = 2) -> dict:
    """diffusers' single-process modular call, then paradiff's load_pipeline of the same folder in each mode (a
    ParallelConfig.from_degrees dict), same seed: the output, what each rank holds and what its first block saw."""
    from diffusers import ModularPipeline

    torch.set_num_threads(1)
    kwargs = dict(modular_call_kwargs(family), num_inference_steps=steps)
    output = OUTPUTS[family]
    reference = ModularPipeline.from_pretrained(folder)
    reference.load_components(dtype=torch.float32)
    if guider == "skip_layer":
        reference.update_components(guider=skip_layer_guider(family))
    seen: list[int] = []
    _tokens_seen(reference.transformer, seen)
    expected = np.asarray(reference(**kwargs, generator=torch.Generator().manual_seed(0), output=output))
    whole = sum(p.numel() for p in reference.transformer.parameters())
    results = {}
    for mode, degrees in modes.items():
        pipeline = paradiff.load_pipeline(folder, parallel_config=paradiff.ParallelConfig.from_degrees(**degrees))
        if guider == "skip_layer":
            pipeline.update_components(guider=skip_layer_guider(family))
        local: list[int] = []
        _tokens_seen(pipeline.transformer, local)
        actual = np.asarray(pipeline(**kwargs, seed=0, output=output))
        branches = pipeline._paradiff_pipeline.cfgs
        results[mode] = {
            "type": type(pipeline).__name__,
            "max_abs_diff": float(np.abs(actual - expected).max()), "scale": float(np.abs(expected).max()),
            "wrong_slices": wrong_slices(pipeline.transformer, reference.transformer),
            "param_share": sum(p.numel() for p in pipeline.transformer.parameters()) / whole,
            "tokens": local[0], "token_shares": all_gather_object(local[0]),
            "computed": branches[0].computed if branches else None,
            "branch_counts": branches[0].branch_counts if branches else None,
            "wrappers": wrappers(pipeline.transformer),
        }
        del pipeline
    return {"rank": dist.get_rank(), "tokens": seen[0], "shape": list(expected.shape), "modes": results}


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
    attempt(lambda: paradiff.load_pipeline(folders["krea2-turbo"], parallel_config=cfg2))
    pipeline = paradiff.load_pipeline(folders["qwenimage"], parallel_config=cfg2)
    pipeline.set_progress_bar_config(disable=True)
    kwargs = dict(modular_call_kwargs("qwenimage"), num_inference_steps=1)
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
        pipeline(**dict(modular_call_kwargs("wan"), num_inference_steps=1), output="videos")
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"
