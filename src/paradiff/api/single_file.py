"""GGUF single files under `from_pretrained`: each rank reads only the rows / whole-block columns of its shards.

What diffusers' `from_single_file(..., quantization_config=GGUFQuantizationConfig(...))` builds, sliced: the model
from a diffusers config (`config=`, a folder or Hub id, or the one diffusers infers from the file's names), the
file's tensors mapped to the model's names by diffusers' own converter (`io/single_file.py`), quantized weights kept
packed in their ggml type (GGUFParameter, dequantized at each forward), F32 / F16 tensors cast to the load dtype,
`modules_to_not_convert` dequantized at read. Every check (types, names, shapes, the plan's slices against the
blocks) runs before any weight is read.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paradiff.distributed.agreement import config_fingerprint, fingerprint
from paradiff.errors import CheckpointError, ParallelConfigError, PlanError
from paradiff.io.gguf import GGUFFile, GGUFTensor
from paradiff.io.model_classes import construct, load_config
from paradiff.io.single_file import Run, parameter_runs
from paradiff.plans import model_config, plan_for
from paradiff.quant.schemes import QuantScheme
from paradiff.api.building import _Prepared, parameters_on_meta
from paradiff.io.weights import GGUFWeightSource, not_converted
from paradiff.tensor_parallel.plan import ResolvedPlan, as_plan, resolve_plan


def is_gguf_path(path: Any) -> bool:
    return str(path).lower().endswith(".gguf")


def config_folder(model_cls: type, gguf_file: GGUFFile, config: Any, subfolder: str | None,
                  hub_kwargs: dict[str, Any]) -> Path:
    """The folder holding the model's config.json: `config` (a local folder, or a Hub id whose config.json alone is
    fetched), or, as diffusers does without `config`, the repository its single-file loader infers from the file's
    tensor names and shapes (with that class's default subfolder)."""
    if config is None:
        from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES, \
            _get_single_file_loadable_mapping_class
        from diffusers.loaders.single_file_utils import fetch_diffusers_config

        shapes = {name: torch.empty(info.shape, device="meta") for name, info in gguf_file.tensors.items()}
        try:
            inferred = fetch_diffusers_config(shapes)
        except Exception as exc:  # noqa: BLE001 - diffusers' inference knows only the published layouts
            raise CheckpointError(
                f"{gguf_file.path}: diffusers could not tell which model the file holds ({type(exc).__name__}: {exc});"
                " pass config=<the diffusers model folder or Hub id> (and subfolder=...)."
            ) from None
        config = inferred["pretrained_model_name_or_path"]
        mapping = SINGLE_FILE_LOADABLE_CLASSES.get(_get_single_file_loadable_mapping_class(model_cls) or "", {})
        subfolder = subfolder or mapping.get("default_subfolder") or inferred.get("subfolder")
    local = Path(str(config))
    if local.is_dir():
        folder = local / subfolder if subfolder else local
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"config={str(config)!r} (subfolder={subfolder!r}): {folder} has no config.json.")
        return folder
    if str(config).count("/") != 1:
        raise CheckpointError(f"config={str(config)!r} is neither a local folder nor a Hub id of the form 'owner/name'.")
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(str(config), "config.json", subfolder=subfolder, **hub_kwargs)).parent


def prepare_gguf_model(model_cls: type, path: Path, *, config: Any, subfolder: str | None,
                       hub_kwargs: dict[str, Any], dtype: torch.dtype | None, device: torch.device,
                       tp_shard: tuple[int, int] | None, plan: Any, context: bool, cp_plan: Any,
                       scheme: QuantScheme):
    """`prepare_model` for a GGUF file: build the model on the meta device, map and check every tensor, resolve
    the plans and check their slices against the blocks. Reads no weight; the file is left open."""
    if not path.is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a local file; paradiff reads a GGUF file from disk (download it first, e.g. "
            "huggingface_hub.hf_hub_download(repo, filename))."
        )
    gguf_file = GGUFFile(path)
    try:
        folder = config_folder(model_cls, gguf_file, config, subfolder, hub_kwargs)
        raw_config = load_config(model_cls, folder)
        built_config = model_config(model_cls, raw_config)
        dtype = scheme.compute_dtype if dtype is None else dtype
        if dtype is None:
            dtype = torch.float32
        with parameters_on_meta():
            model = construct(model_cls, built_config, dtype)
        expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
        stored = {name: info.shape for name, info in gguf_file.tensors.items()}
        runs = parameter_runs(model_cls, dict(raw_config), stored, expected)
        keep = list(getattr(model_cls, "_keep_in_fp32_modules", None) or [])
        skip = tuple(dict.fromkeys([*scheme.skip, *keep]))
        packed = _check_types(model, runs, gguf_file.tensors, skip)
        scheme = replace(scheme, skip=skip, packed=packed)
        resolved = None
        if tp_shard is not None:
            rank, size = tp_shard
            resolved = resolve_plan(model, as_plan(plan_for(model, plan, "tensor")), rank, size)
            _check_blocks(resolved, runs, gguf_file.tensors)
        cp_resolved = None
        if context:
            from paradiff.context_parallel.apply import resolve_cp_plan

            cp_resolved = resolve_cp_plan(model, plan_for(model, cp_plan, "context"))
    except BaseException:
        gguf_file.close()
        raise
    source = GGUFWeightSource(path=path, runs=runs, types={n: i.type_name for n, i in gguf_file.tensors.items()},
                              resolved=resolved, dtype=dtype, device=device, scheme=scheme, keep_fp32=keep)
    facts = {
        "model class": model_cls.__name__,
        "model config": config_fingerprint(getattr(model, "config", None)),
        "tensor-parallel plan": fingerprint(
            {name: (type(l.style).__name__, l.style.kind, l.full_shapes) for name, l in resolved.linears.items()}
        ) if resolved else None,
        "checkpoint": fingerprint(sorted(
            (name, list(info.shape), info.type_name, info.begin) for name, info in gguf_file.tensors.items()
        ) + [path.name, path.stat().st_size]),
        "dtype": str(dtype),
        "quantization": scheme.describe(),
    }
    return _Prepared(model, gguf_file, None, resolved, cp_resolved, dtype, device, facts, source, scheme)


def _check_types(model: nn.Module, runs: dict[str, list[Run]], tensors: dict[str, GGUFTensor],
                 skip: tuple[str, ...]) -> dict[str, int]:
    """Parameter name -> ggml type id of every weight held packed. A quantized tensor is held only as a Linear's
    weight (diffusers' GGUF linear is the only module that computes with one); a parameter made of tensors of
    different types has no single packed form; both are refused by name."""
    packed = {}
    for name, pieces in runs.items():
        kinds = {tensors[run.source].type_name for run in pieces}
        if len(kinds) > 1:
            raise CheckpointError(
                f"{name}: diffusers' converter builds it from stored tensors of different types {sorted(kinds)} "
                f"({sorted({run.source for run in pieces})}); paradiff holds one type per weight."
            )
        info = tensors[pieces[0].source]
        if not info.quantized:
            continue
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        if not_converted(name, skip):
            continue
        if not (isinstance(module, nn.Linear) and leaf == "weight"):
            raise CheckpointError(
                f"{name} is stored as {info.type_name} (GGUF tensor {info.name!r}) but is not a Linear weight "
                f"({type(module).__name__}.{leaf}); diffusers computes with quantized GGUF tensors only in "
                "Linear layers. Name the module in GGUFQuantizationConfig(modules_to_not_convert=[...]) to "
                "dequantize it at load."
            )
        packed[name] = info.type_id
    return packed


def _check_blocks(resolved: ResolvedPlan, runs: dict[str, list[Run]], tensors: dict[str, GGUFTensor]) -> None:
    """Refuse, by parameter and GGUF tensor, a planned slice of the last dimension that would cut a block."""
    for module_name, linear in resolved.linears.items():
        for leaf, spec in linear.specs.items():
            name = f"{module_name}.{leaf}" if module_name else leaf
            if spec is None or name not in runs:
                continue
            for run in runs[name]:
                info = tensors[run.source]
                cut = info.cut_pieces(spec)
                if cut:
                    raise PlanError(
                        f"{name} (GGUF tensor {info.name!r}, {info.type_name}, shape {list(info.shape)}): this "
                        f"rank's columns {cut} (start, length) would cut a {info.type_name} block of {info.block} "
                        f"elements, so its shard could not be read as whole blocks. Choose a tp_degree whose slices "
                        f"of {name} are multiples of {info.block} elements, or use a file that stores it in a type "
                        "with smaller blocks (Q8_0 / Q4_0: 32, F16 / BF16: 1)."
                    )
                if info.quantized and spec.dim == 0 and len(info.shape) == 1:
                    raise PlanError(f"{name} (GGUF tensor {info.name!r}, {info.type_name}): a split 1-D quantized "
                                    "tensor is not supported.")
