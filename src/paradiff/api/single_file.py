"""GGUF single files under `from_pretrained`: each rank reads only the rows / whole-block columns of its shards.

What diffusers' `from_single_file(..., quantization_config=GGUFQuantizationConfig(...))` builds, sliced: the model
from a diffusers config (`config=`, a folder or Hub id, or the one diffusers infers from the file's names), the
file's tensors mapped to the model's names by diffusers' own converter (`io/single_file.py`), quantized weights kept
packed in their ggml type (GGUFParameter, dequantized at each forward), F32 / F16 tensors cast to the load dtype,
`modules_to_not_convert` dequantized at read. Every check (types, names, shapes, the plan's slices against the
blocks) runs before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paradiff.distributed.agreement import config_fingerprint, fingerprint
from paradiff.errors import CheckpointError, ParallelConfigError, PlanError
from paradiff.fsdp.apply import is_sharded, local_rows
from paradiff.fsdp.packed import PackedLinear, packed_weight_names
from paradiff.io.gguf import GGUFFile, GGUFTensor
from paradiff.io.model_classes import construct, load_config
from paradiff.io.single_file import Run, parameter_runs
from paradiff.plans import model_config, plan_for
from paradiff.quant.schemes import QuantScheme
from paradiff.runtime.progress import byte_progress
from paradiff.api.building import _Prepared, parameters_on_meta
from paradiff.tensor_parallel.plan import ResolvedPlan, as_plan, resolve_plan
from paradiff.tensor_parallel.styles import ShardSpec


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


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    """diffusers' GGUF rule: a module named in modules_to_not_convert is any component of the parameter's path."""
    return any(key in name.split(".") for key in skip)


@dataclass
class GGUFWeightSource:
    """Where each parameter's bytes are in the file (runs of stored rows) and which slice of it this rank holds."""

    path: Path
    runs: dict[str, list[Run]]
    types: dict[str, str]  # stored tensor -> ggml type name, as validated
    resolved: ResolvedPlan | None
    dtype: torch.dtype
    device: torch.device
    scheme: QuantScheme
    keep_fp32: list[str] = field(default_factory=list)

    def spec(self, name: str) -> ShardSpec | None:
        return self.resolved.spec_for(name) if self.resolved else None

    def open(self) -> GGUFFile:
        gguf_file = GGUFFile(self.path)
        changed = [name for name, kind in self.types.items()
                   if name not in gguf_file.tensors or gguf_file.tensors[name].type_name != kind]
        if changed:
            gguf_file.close()
            raise CheckpointError(f"{self.path}: tensor {changed[0]!r} changed since the model was loaded.")
        return gguf_file

    def _local_nbytes(self, name: str, gguf_file: GGUFFile) -> int:
        total = 0
        for run, rows, spec in self._pieces(name):
            info = gguf_file.tensors[run.source]
            shape = (rows[1], *info.shape[1:]) if info.shape else ()
            local = spec.local_shape(shape) if spec is not None else shape
            total += (_numel(local[:-1]) * (local[-1] // info.block * info.type_size)) if local else info.type_size
        return total

    def _pieces(self, name: str, rows: tuple[int, int] | None = None
                ) -> list[tuple[Run, tuple[int, int], ShardSpec | None]]:
        """(run, stored rows (start, length), slice of those rows' other dimensions or None) to read, in order.
        `rows`: only these rows of the parameter (an FSDP shard; quantized FSDP composes with no TP)."""
        spec = self.spec(name) if rows is None else ShardSpec(dim=0, pieces=(rows,))
        runs = self.runs[name]
        if spec is None or spec.dim > 0:
            return [(run, (run.start, run.length), spec) for run in runs]
        out = []
        for start, length in spec.pieces:
            for run in runs:
                low, high = max(start, run.at), min(start + length, run.at + run.length)
                if low < high:
                    out.append((run, (run.start + low - run.at, high - low), None))
        return out

    def read(self, model: nn.Module, gguf_file: GGUFFile, progress: bool | None = None,
             parameters: bool = True, buffers: bool = True) -> None:
        """Read this rank's slice of every parameter (and the whole of every persistent buffer) into place."""
        from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor
        import gguf

        packed_parts = packed_weight_names(model)  # FSDP's packed linears: their rows of the packed weight
        state_names = list(dict.fromkeys(packed_parts.get(name, name) for name in model.state_dict().keys()))
        total = sum(self._local_nbytes(name, gguf_file) for name in state_names if name in self.runs)
        with byte_progress(total, "paradiff: loading", progress) as advance:
            for name in state_names:
                module_name, _, leaf = name.rpartition(".")
                module = model.get_submodule(module_name) if module_name else model
                packed_rows = isinstance(module, PackedLinear) and leaf == "weight"
                is_parameter = packed_rows or leaf in module._parameters
                if not (parameters if is_parameter else buffers):
                    continue
                held = getattr(module, module.part_names[0]) if packed_rows else module._parameters.get(leaf)
                rows = local_rows(held) if held is not None and is_sharded(held) else None
                parts = [gguf_file.read(run.source, piece_rows, spec)
                         for run, piece_rows, spec in self._pieces(name, rows)]
                tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
                advance(tensor.numel() * tensor.element_size())
                if packed_rows:
                    module.fill({"packed": tensor})
                    continue
                info = gguf_file.tensors[self.runs[name][0].source]
                keep_fp32 = _skipped(name, tuple(self.keep_fp32))
                if name in self.scheme.packed:  # held packed, wrapped as GGUFParameter after the swap
                    tensor = tensor.to(device=self.device)
                elif info.quantized:  # in modules_to_not_convert: dequantized (its slice), as diffusers does
                    packed = GGUFParameter(tensor, quant_type=gguf.GGMLQuantizationType(info.type_id))
                    tensor = dequantize_gguf_tensor(packed).to(
                        device=self.device, dtype=torch.float32 if keep_fp32 else self.scheme.compute_dtype)
                else:
                    tensor = tensor.to(device=self.device, dtype=torch.float32 if keep_fp32 else self.dtype)
                if rows is not None:  # FSDP: its rows, in place
                    with torch.no_grad():
                        held.to_local().copy_(tensor)
                elif is_parameter:
                    module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
                else:
                    module._buffers[leaf] = tensor
        if buffers:
            for module in model.modules():
                for leaf, buffer in list(module._buffers.items()):
                    if buffer is not None and buffer.device != self.device:
                        module._buffers[leaf] = buffer.to(self.device)


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


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
        if _skipped(name, skip):
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
