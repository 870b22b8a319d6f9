"""Whole-pipeline cases run on every rank by tests/test_pipelines.py (gloo, CPU)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import paradiff
from paradiff.runtime.wrappers import wrappers
from paradiff_testkit.pipelines import default_call_kwargs


def _pixels(output) -> np.ndarray:
    """Images (image pipelines) or frames (video pipelines) as one array."""
    return np.asarray(output.frames if hasattr(output, "frames") else output.images)


def _config(tp: int = 1, ring: int = 1, ulysses: int = 1, cfg: int = 1, dp: int = 1) -> paradiff.ParallelConfig:
    return paradiff.ParallelConfig.from_degrees(tp=tp, ring=ring, ulysses=ulysses, cfg=cfg, data=dp)


def pipeline_equivalence(family: str, folder: str, degrees: dict, expected: dict, whole_params: dict,
                         steps: int = 3) -> dict:
    """Images from the parallel pipeline equal the single-process pipeline's, same seed: `expected` holds diffusers'
    own images by seed (paradiff_testkit.pipelines.References, made once in the test process), `whole_params` its
    transformers' parameter counts."""
    torch.set_num_threads(1)
    kwargs = dict(default_call_kwargs(family), num_inference_steps=steps)
    pipeline = paradiff.load_pipeline(folder, parallel_config=_config(**degrees))
    pipeline.set_progress_bar_config(disable=True)
    calls = {}
    for name, module in pipeline.components.items():
        if name.startswith("transformer") and module is not None:
            calls[name] = 0
            module.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    diffs = {}
    for seed, pixels in expected.items():
        actual = _pixels(pipeline(**kwargs, seed=seed))
        diffs[seed] = float(np.abs(actual - pixels).max())
    splitters = pipeline._paradiff_pipeline.cfgs
    return {"rank": dist.get_rank(), "diffs": diffs, "output_rank": pipeline.is_output_rank,
            "cfg_forwards": sum(s.computed for s in splitters) if splitters else None,
            "transformer_params": {name: (sum(p.numel() for p in module.parameters()), whole_params[name])
                                   for name, module in pipeline.components.items()
                                   if name.startswith("transformer") and module is not None},
            "transformer_calls": calls, "wrappers": wrappers(pipeline.transformer)}


def data_parallel_prompts(family: str, folder: str, degrees: dict, prompts: list[str], expected: dict) -> dict:
    """Each data replica makes its share of the prompts; prompt i always uses seed 100 + i. `expected`: diffusers'
    own image of each prompt index, with that seed."""
    torch.set_num_threads(1)
    kwargs = default_call_kwargs(family)
    kwargs.pop("prompt", None)
    pipeline = paradiff.load_pipeline(folder, parallel_config=_config(**degrees))
    pipeline.set_progress_bar_config(disable=True)
    made = {}
    with paradiff.split_between_processes(list(enumerate(prompts)), pipeline) as share:
        for index, prompt in share:
            made[index] = _pixels(pipeline(prompt=prompt, seed=100 + index, **kwargs)).tolist()
    diffs = {index: float(np.abs(np.asarray(image) - expected[index]).max()) for index, image in made.items()}
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


def a_registry_of_its_own_on_every_load_path(family: str, folder: str, model_cls: str, steps: int = 3) -> dict:
    """A parallelism declared here, in a registry of the test's own (`REGISTRY.adding`), given to `from_pretrained`
    and `load_pipeline`: each phase of it runs in the registry's order (resolved, around the read, applied after
    TP and CP, before CFG), its patch is listed and removable, and its step hooks run once per denoising step of a
    cfg2 pipeline call, the images equal bit for bit to the pipeline's without it."""
    import diffusers

    from paradiff.api.parallelisms import REGISTRY
    from paradiff.distributed.parallelism import Parallelism
    from paradiff.runtime.patches import add_hook, remove_patch
    from paradiff.runtime.state import get_state
    from paradiff.runtime.wrappers import wrappers as wrapper_names

    class Probe(Parallelism):
        name, dims = "probe", ("probe",)

        def __init__(self) -> None:
            self.log: list = []
            self.hooks: list = []

        def enabled(self, config) -> bool:
            return True  # (its dimension has size 1: nothing to split, every phase still runs)

        def resolve_plan(self, config, model, plan, coordinates):
            self.log.append(("resolve", type(model).__name__))
            return "probe plan"

        def before_read(self, component, mesh, device, read):
            self.log.append(("before_read", type(component.model).__name__))

        def after_read(self, component, mesh, read):
            sharded = get_state(component.model) is None and component.resolved is not None
            self.log.append(("after_read", type(component.model).__name__))
            self.log.append(("tp swapped before", sharded and any(
                type(m).__module__.startswith("paradiff") for m in component.model.modules())))

        def apply(self, model, resolved, mesh, state):
            self.log.append(("apply", type(model).__name__, resolved, "cfg_exchange" in wrapper_names(model)))
            self.hooks.append((model, add_hook(model, lambda module, args, output: None, by=self.name).patch))

        def before_step(self, model, step):
            self.log.append(("before_step", step))

        def after_step(self, model, step):
            self.log.append(("after_step", step))

    import time

    started = time.perf_counter()
    torch.set_num_threads(1)
    world = dist.get_world_size()
    probe = Probe()
    registry = REGISTRY.adding(probe, after="cfg", apply_after="cp")
    model = paradiff.from_pretrained(getattr(diffusers, model_cls), folder, subfolder="transformer",
                                     parallel_config=_config(tp=world), registry=registry)
    loaded_model = list(probe.log)
    model_listed = _probe_patches(model)

    probe.log.clear()
    kwargs = dict(default_call_kwargs(family), num_inference_steps=steps)
    pipeline = paradiff.load_pipeline(folder, parallel_config=_config(cfg=world), registry=registry)
    pipeline.set_progress_bar_config(disable=True)
    loaded_pipeline = [entry for entry in probe.log if entry[1] == type(pipeline.transformer).__name__]
    listed = _probe_patches(pipeline.transformer)
    probe.log.clear()
    images = _pixels(pipeline(**kwargs, seed=0))
    step_log = list(probe.log)
    splitter_calls = [s.calls for s in pipeline._paradiff_pipeline.cfgs]
    for holder, patch in probe.hooks:
        remove_patch(holder, patch)
    unlisted = _probe_patches(pipeline.transformer)

    plain = paradiff.load_pipeline(folder, parallel_config=_config(cfg=world))
    plain.set_progress_bar_config(disable=True)
    return {"loaded_model": loaded_model, "model_listed": model_listed, "loaded_pipeline": loaded_pipeline,
            "listed": listed, "unlisted": unlisted, "step_log": step_log, "splitter_calls": splitter_calls,
            "steps_run": pipeline._paradiff_pipeline.steps.last_call_steps,
            "plain_steps": plain._paradiff_pipeline.steps is not None,
            "equal": bool(np.array_equal(images, _pixels(plain(**kwargs, seed=0)))),
            "seconds": time.perf_counter() - started}


def _probe_patches(model) -> list[str]:
    return [str(patch) for _, patch in paradiff.describe(model).patches if patch.by == "probe"]
