"""`from_pretrained`: build the model on the meta device, then read each rank's shard of every tensor.

Order matters for the guarantees: every argument, the plan and the checkpoint headers are checked before any weight
is read or any collective is issued.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paradiff.distributed.agreement import config_fingerprint, fingerprint
from paradiff.io.checkpoint import Checkpoint
from paradiff.config import as_parallel_config
from paradiff.errors import CheckpointError, ParallelConfigError
from paradiff.io.folders import resolve_folder
from paradiff.io.weights import WeightSource
from paradiff.distributed.mesh import build_mesh, default_device, rank_coordinates, require_distributed
from paradiff.io.model_classes import (checkpoint_keys, construct, is_transformers_class, keep_fp32_modules,
                                       load_config)
from paradiff.plans import model_config, plan_for
from paradiff.quant.saved import check_saved_blocks, saved_quantization, saved_weights
from paradiff.quant.schemes import check_block_boundaries, gguf_scheme, scheme_from_config
from paradiff.api.building import _Prepared, parameters_on_meta, target_dtype  # noqa: F401 - public here
from paradiff.api.fsdp import check_fsdp
from paradiff.api.load_sequence import Component, Prepared, run_load_sequence
from paradiff.api.parallelisms import REGISTRY
from paradiff.distributed.parallelism import Registry
from paradiff.api.single_file import is_gguf_path, prepare_gguf_model
from paradiff.tensor_parallel.plan import as_plan, check_checkpoint_keys, resolve_plan

HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_loading_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Refuse options that would silently load the full checkpoint or place weights elsewhere."""
    if kwargs.get("device_map") is not None:
        raise ParallelConfigError(
            f"device_map={kwargs['device_map']!r} cannot be combined with paradiff loading: each rank places its own "
            "shard on its own device. Drop device_map (use it with plain diffusers for non-parallel components)."
        )
    if kwargs.get("low_cpu_mem_usage", True) is False:
        raise ParallelConfigError(
            "low_cpu_mem_usage=False would materialise the full model on every rank; paradiff always loads "
            "shard by shard. Remove the argument."
        )
    if kwargs.get("use_flashpack"):
        raise ParallelConfigError("use_flashpack=True is not supported; paradiff reads safetensors files.")
    if kwargs.get("use_safetensors") is False:
        raise CheckpointError("use_safetensors=False: paradiff reads only safetensors weights.")
    known = set(HUB_KWARGS) | {"device_map", "quantization_config", "low_cpu_mem_usage", "use_flashpack",
                               "use_safetensors", "variant"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"from_pretrained got unexpected arguments {unknown}; accepted extras: {sorted(known)}.")
    if kwargs.get("variant"):
        raise CheckpointError(f"variant={kwargs['variant']!r} is not supported yet; point to a folder without variants.")
    return {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}


def check_dtype(dtype: Any) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, dtype)
    if dtype not in FLOAT_DTYPES:
        raise ParallelConfigError(f"torch_dtype={dtype!r} is not supported; use one of {[str(d) for d in FLOAT_DTYPES]}.")
    return dtype


def check_device(device: torch.device | str | None) -> torch.device:
    """The device each rank loads onto; refuse one that is not usable here before anything is read."""
    if device is None:
        return default_device()
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ParallelConfigError(
            f"device={device!r} is not a valid torch device ({exc}); use e.g. 'cpu', 'cuda' or 'cuda:0'."
        ) from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ParallelConfigError(
                f"device={str(device)!r} but CUDA is not available in this process; use device='cpu' (with the "
                "gloo backend) or omit device to pick cuda:LOCAL_RANK when CUDA is present."
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ParallelConfigError(
                f"device={str(device)!r} but this process sees {torch.cuda.device_count()} CUDA device(s); valid "
                f"indices are 0..{torch.cuda.device_count() - 1}, or omit device to use cuda:LOCAL_RANK."
            )
    elif device.type == "meta":
        raise ParallelConfigError("device='meta' holds no data; load onto 'cpu' or a 'cuda' device.")
    return device


def from_pretrained(
    model_cls: type,
    path: str | os.PathLike,
    *,
    subfolder: str | None = None,
    torch_dtype: torch.dtype | None = None,
    parallel_config: Any = None,
    device: torch.device | str | None = None,
    plan: Any = None,
    cp_plan: Any = None,
    progress: bool | None = None,
    registry: Registry = REGISTRY,
    **kwargs: Any,
) -> nn.Module:
    """Load a diffusers model class (or a `transformers` one, e.g. a text encoder); with a parallel config, each rank
    reads only its own shard of each weight.

    `path` may also be a GGUF single file (`model.gguf`, with `quantization_config=GGUFQuantizationConfig(...)` and
    `config=` the diffusers model folder or Hub id to build it from, as in diffusers' `from_single_file`): each rank
    reads only the rows / whole-block columns of its shards, and holds them packed (`api/single_file.py`).

    Every check runs first on each rank; then the ranks agree (through the store, not a collective) that all passed
    and that they load the same thing, and only then is the mesh built and any weight read.

    `registry`: the parallelisms to apply, in its apply order (`api/parallelisms.py: REGISTRY`, or a registry of
    one's own built with `REGISTRY.adding(...)`).
    """
    def prepare() -> Prepared:
        item = _prepare(model_cls, path, subfolder, torch_dtype, parallel_config, device, plan, cp_plan, kwargs)
        blocks = None
        if item.parallel is not None and item.parallel.fsdp_degree > 1:
            try:
                blocks = check_fsdp(item.model, item.parallel, quantization=item.quantization,
                                    saved=bool(getattr(item.source, "saved", None)), single_file=is_gguf_path(path))
            except BaseException:
                item.checkpoint.close()
                raise
        component = Component(item.model, item.facts, item.resolved, item.cp_resolved, item.checkpoint, item.source,
                              quantization=item.quantization, blocks=blocks)
        return Prepared({"": component}, item.parallel, item.device, registry=registry)

    prepared, _mesh = run_load_sequence("paradiff.from_pretrained", prepare, distributed=parallel_config is not None,
                                        progress=progress)
    return prepared.components[""].model


def from_single_file(model_cls: type, path: str | os.PathLike, **kwargs: Any) -> nn.Module:
    """diffusers' spelling for a single file: `from_pretrained(model_cls, "model.gguf", config=...,
    quantization_config=GGUFQuantizationConfig(...), parallel_config=...)`. GGUF files only."""
    if not is_gguf_path(path):
        raise CheckpointError(f"paradiff.from_single_file reads GGUF files (*.gguf); got {str(path)!r}. Load a "
                              "diffusers model folder with paradiff.from_pretrained.")
    return from_pretrained(model_cls, path, **kwargs)


def _prepare(model_cls, path, subfolder, torch_dtype, parallel_config, device, plan, cp_plan, kwargs) -> _Prepared:
    """All local validation: arguments, degrees, checkpoint headers, model config, plans. Reads no weight."""
    if "dtype" in kwargs:
        torch_dtype = torch_dtype or kwargs.pop("dtype")
    quantization = kwargs.pop("quantization_config", None)
    single_file = is_gguf_path(path)
    if "config" in kwargs and not single_file:
        raise TypeError(f"from_pretrained got config={kwargs['config']!r}, which only a single .gguf file takes "
                        f"(the diffusers config to build it from); {str(path)!r} is a model folder.")
    single_file_config = kwargs.pop("config", None)
    scheme = None
    if single_file:
        scheme = gguf_scheme(quantization)
    elif quantization is not None:
        scheme = scheme_from_config(quantization)
    hub_kwargs = check_loading_kwargs(kwargs)
    dtype = None if single_file and torch_dtype is None else check_dtype(torch_dtype)
    device = check_device(device)
    parallel = None
    if parallel_config is not None:
        require_distributed()
        parallel = as_parallel_config(parallel_config, dist.get_world_size())
        if parallel.world_size != dist.get_world_size() and parallel.mesh is None:
            build_mesh(parallel, device)  # raises the degree mismatch error before any collective
    tp = parallel.tp_degree if parallel else 1
    tp_shard = None
    if tp > 1:
        tp_shard = (rank_coordinates(parallel).tp_rank, tp)
    context = parallel is not None and parallel.context_parallel_config is not None
    if single_file:
        prepared = prepare_gguf_model(model_cls, Path(path), config=single_file_config, subfolder=subfolder,
                                      hub_kwargs=hub_kwargs, dtype=dtype, device=device, tp_shard=tp_shard, plan=plan,
                                      context=context, cp_plan=cp_plan, scheme=scheme)
        prepared.parallel = parallel
        prepared.facts["parallel degrees"] = parallel.degrees() if parallel else None
        return prepared
    folder = resolve_folder(path, subfolder, hub_kwargs)
    prepared = prepare_model(model_cls, folder, dtype=dtype, device=device, tp_shard=tp_shard, plan=plan,
                             context=context, cp_plan=cp_plan, quantization=scheme)
    prepared.parallel = parallel
    prepared.facts["parallel degrees"] = parallel.degrees() if parallel else None
    return prepared


def prepare_model(
    model_cls: type,
    folder: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tp_shard: tuple[int, int] | None = None,
    plan: Any = None,
    context: bool = False,
    cp_plan: Any = None,
    quantization: Any = None,
) -> _Prepared:
    """Build `model_cls` on the meta device from `folder`, resolve its plans for TP slice `tp_shard` = (rank, size),
    and check everything against the checkpoint headers. Reads no weight; the checkpoint is left open.
    `quantization`: a quant.schemes.QuantScheme (`scheme_from_config` of the user's diffusers config), checked here
    against the model and the plan's slices; the weights are quantized on each rank's slice after the read."""
    checkpoint = Checkpoint(folder)
    try:
        raw_config = load_config(model_cls, folder)
        config = model_config(model_cls, raw_config)
        with parameters_on_meta():
            model = construct(model_cls, config, dtype)
        saved: dict[str, Any] = {}
        if saved_quantization(raw_config) is not None:
            quantization, saved = _saved_weights(model, raw_config, checkpoint, quantization)
        keys = checkpoint_keys(model, set(checkpoint.tensors))
        keys.update({name: weight.keys.get("packed") or weight.keys["qdata"] for name, weight in saved.items()})
        shapes = {name: saved[name].shape if name in saved else tuple(checkpoint.tensors[key].shape)
                  for name, key in keys.items()}
        scheme = None if quantization is None else quantization.for_model(model, is_transformers_class(model_cls))
        resolved = None
        if tp_shard is not None:
            rank, size = tp_shard
            tp_plan = as_plan(plan_for(model, plan, "tensor"))
            resolved = resolve_plan(model, tp_plan, rank, size)
            check_checkpoint_keys(resolved, set(keys), shapes)
            if saved:
                check_saved_blocks(saved, resolved)
            elif scheme is not None:
                check_block_boundaries(scheme, model, resolved)
        cp_resolved = None
        if context:
            from paradiff.context_parallel.apply import resolve_cp_plan

            cp_resolved = resolve_cp_plan(model, plan_for(model, cp_plan, "context"))
        _check_model_against_checkpoint(model, checkpoint, keys, set(saved))
    except BaseException:
        checkpoint.close()
        raise
    source = WeightSource(
        folder=Path(folder), keys=keys, shapes={keys[n]: tuple(checkpoint.tensors[keys[n]].shape) for n in keys},
        resolved=resolved, dtype=dtype, device=device, keep_fp32=keep_fp32_modules(model, dtype), saved=saved,
    )
    facts = {
        "model class": model_cls.__name__,
        "model config": config_fingerprint(getattr(model, "config", None)),
        "tensor-parallel plan": fingerprint(
            {name: (type(l.style).__name__, l.style.kind, l.full_shapes) for name, l in resolved.linears.items()}
        ) if resolved else None,
        "checkpoint": fingerprint(sorted(
            (name, list(info.shape), str(info.dtype), info.file.name, info.file.stat().st_size)
            for name, info in checkpoint.tensors.items()
        )),
        "dtype": str(dtype),
        "quantization": None if scheme is None else scheme.describe(),
    }
    return _Prepared(model, checkpoint, None, resolved, cp_resolved, dtype, device, facts, source, scheme)


def _saved_weights(model: nn.Module, raw_config: Any, checkpoint: Checkpoint, requested: Any):
    """The scheme and the quantized weights of a checkpoint saved quantized (its config.json records how), checked
    against the model; reads only the small quant-state records."""
    saved_config = saved_quantization(raw_config)
    what = saved_config.get("quant_method")
    if requested is not None:
        raise ParallelConfigError(
            f"{checkpoint.folder} was saved quantized ({what}: its config.json has a quantization_config), and "
            f"quantization_config={type(requested.config).__name__}(...) asks to quantize it again; drop "
            "quantization_config (the saved quantization is used, as diffusers does), or load the unquantized "
            "weights.")
    if is_transformers_class(type(model)):
        raise CheckpointError(
            f"{checkpoint.folder}: {type(model).__name__} was saved quantized ({what}); paradiff does not slice "
            "pre-quantized transformers checkpoints (text encoders) yet. Load the unquantized encoder.")
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    stored = {name: (info.dtype, tuple(info.shape)) for name, info in checkpoint.tensors.items()}
    return saved_weights(saved_config, stored, checkpoint.metadata, expected,
                         lambda key: checkpoint.read(key).numpy().tobytes(), compute_dtype=None)


def _check_model_against_checkpoint(model: nn.Module, checkpoint: Checkpoint, keys: dict[str, str],
                                    saved: set[str] = frozenset()) -> None:
    """Every tensor of the model is in the checkpoint with its shape (`saved`: weights stored quantized, checked by
    quant/saved.py instead)."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in saved}
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(name for name in expected if name not in keys)
    if missing:
        raise CheckpointError(
            f"{checkpoint.folder}: {len(missing)} tensor(s) of {type(model).__name__} are missing from the "
            f"checkpoint, e.g. {missing[:5]}."
        )
    for name, shape in expected.items():
        info = checkpoint.tensors[keys[name]]
        if tuple(info.shape) != shape:
            raise CheckpointError(
                f"{info.file}: tensor {info.name!r} has shape {list(info.shape)} but {type(model).__name__} expects "
                f"{list(shape)} for {name!r}."
            )
        if not info.dtype.is_floating_point and name in params:
            raise CheckpointError(
                f"{info.file}: tensor {info.name!r} is stored as {info.dtype} but {type(model).__name__} expects a "
                "floating point parameter."
            )
