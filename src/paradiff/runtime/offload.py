"""diffusers' offloading on a model or pipeline paradiff has already split: each rank offloads its own shards.

diffusers' group offloading names each group's file after the group (`group_<hash>.safetensors`) and reuses a file
that already exists. Ranks given one `offload_to_disk_path` would therefore write the same files with different
shards, and a rank could read another rank's slice back, silently. paradiff shadows `enable_group_offload` on
the instances it parallelises (as it shadows `load_lora_adapter`): the path becomes `<path>/paradiff-rank<r>`, one
folder per rank, with a note of what was written there so that a folder left by another split is refused rather
than read. diffusers' hooks replace `forward` inside nn.Module's call, so paradiff's forward pre-hooks (CP input
splitting), its wrapper registry and its sharded layers run around and inside them unchanged.

Offloading enabled before paradiff splits the model stays refused (`api/parallelize.check_shardable`): the hooks
would keep the full weights they captured.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paradiff.runtime.patches import set_attribute
from paradiff.distributed.agreement import fingerprint
from paradiff.errors import ParallelConfigError

logger = logging.getLogger(__name__)

RANK_FOLDER = "paradiff-rank{rank}"
NOTE = "paradiff-offload.json"


def rank_offload_path(path: str | os.PathLike | None, model: nn.Module | None = None) -> str | None:
    """This rank's own folder under `path` (unchanged when it already is one; None stays None). With `model`, the
    folder is checked against, or marked with, the shards this rank holds."""
    if path is None:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    folder = os.fspath(path)
    own = RANK_FOLDER.format(rank=rank)
    if own not in os.path.normpath(folder).split(os.sep):
        folder = os.path.join(folder, own)
    if model is not None:
        _check_folder(folder, model, rank)
    return folder


def _layout(model: nn.Module, rank: int) -> dict[str, Any]:
    from paradiff.runtime.state import get_state

    state = get_state(model)
    layout = {
        "rank": rank,
        "model class": type(model).__name__,
        "degrees": state.mesh.config.degrees() if state is not None else None,
        "parameters": fingerprint([(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]),
    }
    return json.loads(json.dumps(layout, default=repr))  # as read back from the note


def _check_folder(folder: str, model: nn.Module, rank: int) -> None:
    """diffusers reads back any group file it finds: refuse a folder written for other shards."""
    layout = _layout(model, rank)
    note = os.path.join(folder, NOTE)
    groups = [name for name in os.listdir(folder) if name.startswith("group_")] if os.path.isdir(folder) else []
    if os.path.exists(note):
        with open(note) as handle:
            written = json.load(handle).get(type(model).__name__)
        if written is not None and written != layout:
            raise ParallelConfigError(
                f"offload_to_disk_path: {folder} holds offloaded shards of another split of {type(model).__name__} "
                f"({written}); diffusers would read them back as this rank's weights. Give an empty folder."
            )
    elif groups:
        raise ParallelConfigError(
            f"offload_to_disk_path: {folder} already holds {len(groups)} group files paradiff did not write; "
            "diffusers would read them back as this rank's weights. Give an empty folder."
        )
    os.makedirs(folder, exist_ok=True)
    notes = {}
    if os.path.exists(note):
        with open(note) as handle:
            notes = json.load(handle)
    notes[type(model).__name__] = layout
    with open(note, "w") as handle:
        json.dump(notes, handle)


def _check_devices(onload_device: Any, device: torch.device, what: str) -> None:
    onload = torch.device(onload_device)
    if onload.type != device.type or (onload.index is not None and device.index is not None
                                      and onload.index != device.index):
        raise ParallelConfigError(
            f"{what}(onload_device={onload_device!r}): this rank computes on {device}; its shards must come back "
            f"there. Pass onload_device={str(device)!r} (each rank its own device)."
        )


def install_offload_support(model: nn.Module) -> None:
    """Shadow diffusers' `enable_group_offload` on this parallelised instance (a no-op for a class without it)."""
    original = getattr(type(model), "enable_group_offload", None)
    if original is None:
        return

    def enable_group_offload(onload_device, *args: Any, offload_to_disk_path: Any = None, **kwargs: Any) -> None:
        _refuse_fsdp(model)
        parameter = next(model.parameters(), None)
        if parameter is not None:
            _check_devices(onload_device, parameter.device, "enable_group_offload")
        path = rank_offload_path(offload_to_disk_path, model)
        return original(model, onload_device, *args, offload_to_disk_path=path, **kwargs)

    enable_group_offload.__doc__ = original.__doc__
    set_attribute(model, "enable_group_offload", enable_group_offload, by="offload")


def pipeline_group_offload(pipeline: Any, onload_device: Any, kwargs: dict[str, Any]) -> None:
    """diffusers' `pipe.enable_group_offload` on a paradiff pipeline: every component offloads to its own folder
    under this rank's (`<path>/paradiff-rank<r>/<component>`: two transformers of one class, Wan 2.2 A14B's, name
    their groups alike)."""
    from diffusers.hooks import apply_group_offloading

    runner = _checked_runner(pipeline, "enable_group_offload")
    for component in pipeline.components.values():
        if isinstance(component, nn.Module):
            _refuse_fsdp(component)
    _check_devices(onload_device, runner.device, "enable_group_offload")
    exclude = kwargs.pop("exclude_modules", None) or []
    exclude = [exclude] if isinstance(exclude, str) else list(exclude)
    path = kwargs.pop("offload_to_disk_path", None)
    root = rank_offload_path(path)
    from paradiff.vae.apply import get_vae_runtime

    for name, component in pipeline.components.items():
        if name in exclude or not isinstance(component, nn.Module):
            continue
        if get_vae_runtime(component) is not None:
            # the row-split VAE's decode gives NaN under group offloading (not yet understood): it stays resident
            logger.warning("%s is split across ranks by paradiff and stays resident (group offloading of a split "
                           "VAE is not supported yet; load with parallel_vae=False to offload it)", name)
            continue
        own = None if root is None else os.path.join(root, name)
        if own is not None:
            _check_folder(own, component, dist.get_rank() if dist.is_initialized() else 0)
        if hasattr(component, "enable_group_offload"):
            component.enable_group_offload(onload_device, offload_to_disk_path=own, **kwargs)
        else:
            apply_group_offloading(component, onload_device=onload_device, offload_to_disk_path=own, **kwargs)


def _refuse_fsdp(model: nn.Module) -> None:
    """Group offloading of an FSDP-sharded model is refused (fsdp/refusals.py: fsdp_refusal), before any hook is placed."""
    from paradiff.fsdp.refusals import fsdp_refusal
    from paradiff.runtime.state import get_state

    state = get_state(model)
    if state is not None and state.fsdp_blocks:
        config = state.mesh.config
        raise ParallelConfigError(fsdp_refusal(config.fsdp_degree, config.tp_degree, group_offload=True))


def _checked_runner(pipeline: Any, what: str) -> Any:
    runner = pipeline._paradiff_pipeline.stages
    if runner.staged:
        raise ParallelConfigError(
            f"{what} on a pipeline loaded with stages=True: paradiff already reads each component at its stage and "
            "frees it after; load without stages to offload."
        )
    return runner


def pipeline_model_cpu_offload(pipeline: Any, original: Any, gpu_id: Any, device: Any) -> None:
    """diffusers' `pipe.enable_model_cpu_offload` on a paradiff pipeline: each rank moves its own components (its
    shards) between the CPU and its own device, which is the default here (diffusers' default is accelerator 0 on
    every rank). On a CPU rank the moves are no-ops: the hooks are installed and the outputs unchanged."""
    runner = _checked_runner(pipeline, "enable_model_cpu_offload")
    if gpu_id is not None:
        raise ParallelConfigError(
            f"enable_model_cpu_offload(gpu_id={gpu_id!r}): on a paradiff pipeline each rank offloads to its own "
            f"device ({runner.device} here); leave gpu_id out (or pass device=...)."
        )
    if device is not None:
        _check_devices(device, runner.device, "enable_model_cpu_offload")
    return original(pipeline, device=runner.device if device is None else device)
