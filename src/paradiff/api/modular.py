"""Modular Diffusers pipelines on the paradiff mesh: the pipeline's blocks and component specs come from
diffusers (`ModularPipeline.from_pretrained`, no weight read), the components paradiff splits are loaded by the one
load sequence and registered into it, and diffusers' `load_components` loads the others.

A modular pipeline is saved as a folder with a modular_model_index.json (each component's class and where to load
it from: this folder, another folder or a Hub repository) and, for custom blocks, their code; its call runs the
blocks (`pipe(prompt=..., output="images")`). Guidance runs through a guider component (ClassifierFreeGuidance,
SkipLayerGuidance, ...), which CFG parallelism splits by branch (runtime/cfg.py, "Guider style"); the guider
helpers here serve the standard pipelines that guide through a guider too (HunyuanVideo 1.5, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paradiff.errors import ParallelConfigError
from paradiff.runtime.cfg import (GuidedBranches, attach_guider, guider_branch_count, install_guided_branches,
                                  is_guider_component)

# load_pipeline's keyword arguments that build the modular pipeline (its blocks and specs); the Hub ones go to
# load_components too, every other one only there (dtype, variant, device_map ...)
_SKELETON_ONLY = ("trust_remote_code", "components_manager", "collection", "workflow")
_HUB = ("revision", "cache_dir", "force_download", "proxies", "token", "local_files_only")


def is_modular_class(pipeline_cls: type | None) -> bool:
    if pipeline_cls is None:
        return False
    from diffusers import ModularPipeline

    return isinstance(pipeline_cls, type) and issubclass(pipeline_cls, ModularPipeline)


def modular_skeleton(pipeline_cls: type | None, folder, kwargs: dict) -> tuple[Any, dict]:
    """The modular pipeline of `folder` (its class from modular_model_index.json, or `pipeline_cls`) with its blocks
    and component specs and no component loaded; and the keyword arguments left for load_components."""
    skeleton_kwargs = {key: kwargs[key] for key in (*_SKELETON_ONLY, *_HUB) if key in kwargs}
    rest = {key: value for key, value in kwargs.items() if key not in _SKELETON_ONLY}
    return modular_pipeline_object(pipeline_cls, folder, **skeleton_kwargs), rest


def modular_pipeline_object(pipeline_cls: type | None, folder, **kwargs: Any):
    """diffusers' modular pipeline of `folder`, no component loaded: `ModularPipeline.from_pretrained` (the class
    its modular_model_index.json names, or `pipeline_cls`; a standard folder maps to its modular class), except for a
    given modular class on a standard folder, which diffusers' from_pretrained does not resolve: that class is built
    on the folder directly, with its default blocks."""
    from diffusers import ModularPipeline

    from paradiff.io.folders import MODULAR_INDEX

    folder = str(folder)
    if pipeline_cls is None or pipeline_cls is ModularPipeline or (Path(folder) / MODULAR_INDEX).is_file():
        return (pipeline_cls or ModularPipeline).from_pretrained(folder, **kwargs)
    return pipeline_cls(pretrained_model_name_or_path=folder,
                        **{key: value for key, value in kwargs.items() if key != "trust_remote_code"})


def pretrained_names(pipeline) -> set[str]:
    """The components the pipeline's blocks load from weights or a saved config (its from_pretrained specs)."""
    return {name for name, spec in pipeline._component_specs.items()
            if spec.default_creation_method == "from_pretrained"}


def fill_modular(pipeline, own: dict[str, torch.nn.Module], dtype: torch.dtype | None, kwargs: dict) -> None:
    """Register the components paradiff loaded, then let diffusers load every other one the index names."""
    pipeline.register_components(**own)
    for name, module in own.items():
        if getattr(pipeline, name) is not module:
            raise RuntimeError(f"{type(pipeline).__name__} did not take the paradiff-loaded {name}.")
    rest = [name for name in pretrained_names(pipeline)
            if name not in own and getattr(pipeline, name, None) is None
            and pipeline._component_specs[name].pretrained_model_name_or_path]
    if rest:
        pipeline.load_components(names=sorted(rest), **({"dtype": dtype} if dtype is not None else {}), **kwargs)


def guider_names(pipeline) -> list[str]:
    """The pipeline's guider components (runtime.cfg.is_guider_component)."""
    return sorted(name for name in pipeline.components if is_guider_component(name))


def install_guided_cfg(transformers: list[torch.nn.Module], group: dist.ProcessGroup) -> GuidedBranches:
    """CFG parallelism on a pipeline that guides through guider components (every modular pipeline, and the
    standard ones whose PipelineSpec says `guider`): every transformer's calls inside a guider step run as branches
    of one GuidedBranches; the guiders are attached at each call (the user may have replaced them)."""
    branches = GuidedBranches(group=group, cfg_rank=dist.get_rank(group), cfg_degree=dist.get_world_size(group))
    for model in transformers:
        install_guided_branches(model, branches)
    return branches


def check_guided_call(pipeline, branches: GuidedBranches, pipeline_name: str) -> None:
    """Before a call with cfg_degree > 1: every guider runs at least cfg_degree branches (else some cfg ranks would
    have no branch to compute), and each is attached to `branches`."""
    from diffusers.guiders.guider_utils import BaseGuidance

    degree = branches.cfg_degree
    guiders = {name: getattr(pipeline, name, None) for name in guider_names(pipeline)}
    present = {name: guider for name, guider in guiders.items() if isinstance(guider, BaseGuidance)}
    if not present:
        raise ParallelConfigError(
            f"cfg_degree={degree} splits the guidance branches of {pipeline_name}'s guider, but its guider is "
            f"{next(iter(guiders.values()), None)!r}; give it one (pipe.update_components(guider="
            "ClassifierFreeGuidance(guidance_scale=...))) or use cfg_degree=1.")
    for name, guider in present.items():
        count = guider_branch_count(guider)
        if count is not None and count < degree:
            if count == 1:
                fix = "give it guidance (e.g. guidance_scale > 1)"
            else:
                fix = "use a guider with more branches (SkipLayerGuidance runs 3)"
            raise ParallelConfigError(
                f"cfg_degree={degree} needs {degree} guidance branches per step, one per cfg rank, but "
                f"{pipeline_name}'s {name} ({type(guider).__name__}, {_settings(guider)}) runs "
                f"{'no guidance (one branch)' if count == 1 else f'{count} branches'}; {fix}, or use "
                f"{'cfg_degree=1' if count == 1 else f'a cfg_degree of at most {count}'}.")
        attach_guider(guider, branches)


def _settings(guider) -> str:
    shown = [f"{key}={value!r}" for key, value in guider.config.items()
             if key in ("guidance_scale", "enabled", "start", "stop", "skip_layer_guidance_scale",
                        "perturbed_guidance_scale")]
    return ", ".join(shown) or "default settings"
