"""The weight sources: what each rank reads into a model built on the meta device, and again after a staged run freed
it. `WeightSource` reads a safetensors folder (this rank's slice of every planned tensor, the whole of the others;
FSDP's rows; pre-quantized pieces; each weight handed to a read-time quantizer as soon as it is read);
`GGUFWeightSource` reads the runs of stored rows of a GGUF file, quantized weights kept packed. Built by the load
sequence's prepare step (`api/model.py`, `api/single_file.py`), which has checked everything they will read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from paradiff.errors import CheckpointError
from paradiff.fsdp.apply import is_sharded, local_rows
from paradiff.fsdp.packed import PackedLinear, packed_weight_names
from paradiff.fsdp.shard import read_plan
from paradiff.io.checkpoint import Checkpoint
from paradiff.io.gguf import GGUFFile
from paradiff.io.single_file import Run
from paradiff.runtime.progress import byte_progress
from paradiff.tensor_parallel.lora import adapter_layout, weights_dropped
from paradiff.tensor_parallel.plan import ResolvedPlan
from paradiff.tensor_parallel.styles import ShardSpec


def target_dtype(name: str, dtype: torch.dtype, keep_fp32: list[str] | None) -> torch.dtype:
    if keep_fp32 and dtype in (torch.float16, torch.bfloat16):
        parts = name.split(".")
        if any(pattern in parts for pattern in keep_fp32):
            return torch.float32
    return dtype


@dataclass
class WeightSource:
    """Where a model's weights come from and which slice of each this rank holds: everything needed to read them
    (again, after staged execution freed them) into the model built by `prepare_model`."""

    folder: Path
    keys: dict[str, str]  # state_dict name -> checkpoint tensor name
    shapes: dict[str, tuple[int, ...]]  # checkpoint tensor name -> full shape, as validated
    resolved: ResolvedPlan | None
    dtype: torch.dtype
    device: torch.device
    keep_fp32: list[str] = field(default_factory=list)
    # weights stored quantized (a pre-quantized checkpoint, quant/saved.py): parameter name -> how they are stored
    saved: dict[str, Any] = field(default_factory=dict)

    def spec(self, name: str) -> ShardSpec | None:
        return self.resolved.spec_for(name) if self.resolved else None

    def open(self) -> Checkpoint:
        """The checkpoint again, refusing it if a tensor changed shape since it was validated."""
        checkpoint = Checkpoint(self.folder)
        for key, shape in self.shapes.items():
            info = checkpoint.tensors.get(key)
            if info is None or tuple(info.shape) != tuple(shape):
                checkpoint.close()
                found = "missing" if info is None else f"shape {list(info.shape)}"
                raise CheckpointError(
                    f"{self.folder}: tensor {key!r} is {found} now but was {list(shape)} when the pipeline was loaded; "
                    "the checkpoint changed on disk."
                )
        return checkpoint

    def read(self, model: nn.Module, checkpoint: Checkpoint, progress: bool | None = None,
             parameters: bool = True, buffers: bool = True, quantizer: Any = None) -> None:
        """Read every parameter (this rank's slice of planned ones) and/or persistent buffer into place. Tensors tied
        in the model (stored once) are read once and shared. LoRA adapters' factors are not in the checkpoint and
        stay as they are; the base layers they wrap are read under their own names. `quantizer`
        (quant.apply.ReadQuantizer): each weight it covers is handed to it as soon as it is read, and the model keeps
        a meta placeholder until its `install`."""
        resident, renamed = adapter_layout(model)
        packed = packed_weight_names(model)  # FSDP's quantized linears: their parts are read as the weight's rows
        wanted = [n for n in model.state_dict().keys()
                  if n not in resident and (parameters if n in packed or _is_parameter(model, n) else buffers)]
        wanted = list(dict.fromkeys(packed.get(name, name) for name in wanted))
        source = {name: renamed.get(name, name) for name in wanted}  # the name the checkpoint and plan know
        first_of: dict[tuple, str] = {}
        for name in wanted:
            first_of.setdefault((self.keys[source[name]], self.spec(source[name])), source[name])
        total = sum(self._nbytes(name, checkpoint) for name in first_of.values())
        shared: dict[tuple, torch.Tensor] = {}
        with byte_progress(total, "paradiff: loading", progress) as advance:
            for name in wanted:
                key = self.keys[source[name]]
                info = checkpoint.tensors[key]
                spec = self.spec(source[name])
                module_name, _, leaf = name.rpartition(".")
                module = model.get_submodule(module_name) if module_name else model
                if source[name] in self.saved:  # stored quantized: this rank's part of each stored tensor, held as read
                    weight = self.saved[source[name]]
                    parts = {role: checkpoint.read(piece.key, piece.spec, shape=piece.shape)
                             for role, piece in weight.pieces(spec).items()}
                    advance(sum(part.numel() * part.element_size() for part in parts.values()))
                    placeholder = quantizer.hold(name, weight.build(parts, spec, self.device), weight.local_shape(spec),
                                                 self.dtype)
                    module._parameters[leaf] = nn.Parameter(placeholder, requires_grad=False)
                    continue
                if isinstance(module, PackedLinear) and leaf == "weight":  # its rows, quantized into its parts
                    start, length = local_rows(getattr(module, module.part_names[0]))
                    tensor = checkpoint.read(key, spec, rows=(start, length))
                    advance(tensor.numel() * tensor.element_size())
                    dtype = target_dtype(source[name], self.dtype, self.keep_fp32)
                    module.fill(quantizer.quantize_rows(tensor.to(device=self.device, dtype=dtype)))
                    continue
                if leaf in module._parameters:
                    dtype = info.dtype
                    if info.dtype.is_floating_point:
                        dtype = target_dtype(source[name], self.dtype, self.keep_fp32)
                    if is_sharded(module._parameters[leaf]):  # FSDP: only this rank's rows of its (TP) slice
                        local = module._parameters[leaf].to_local()
                        read_spec, rows = read_plan(spec, *local_rows(module._parameters[leaf]))
                        tensor = checkpoint.read(key, read_spec, rows=rows)
                        advance(tensor.numel() * tensor.element_size())
                        with torch.no_grad():
                            local.copy_(tensor)
                        continue
                    if quantizer is not None and quantizer.covers(model, name):
                        tensor = checkpoint.read(key, spec)
                        advance(tensor.numel() * tensor.element_size())
                        tensor = tensor.to(device=self.device, dtype=dtype)
                        module._parameters[leaf] = nn.Parameter(quantizer.quantize(name, tensor), requires_grad=False)
                        del tensor  # the next weight's read reuses its memory: one weight in the load dtype at a time
                        continue
                    cache_key = (key, spec, dtype)
                    if cache_key not in shared:
                        tensor = checkpoint.read(key, spec)
                        advance(tensor.numel() * tensor.element_size())
                        shared[cache_key] = tensor.to(device=self.device, dtype=dtype)
                    module._parameters[leaf] = nn.Parameter(shared[cache_key], requires_grad=False)
                else:  # a persistent buffer (a BatchNorm's running statistics): in the load dtype, as diffusers does
                    tensor = checkpoint.read(key, spec)
                    advance(tensor.numel() * tensor.element_size())
                    dtype = target_dtype(source[name], self.dtype, self.keep_fp32) \
                        if info.dtype.is_floating_point and self.dtype is not None else info.dtype
                    module._buffers[leaf] = tensor.to(device=self.device, dtype=dtype)
        if buffers:
            for module in model.modules():
                for leaf, buffer in list(module._buffers.items()):
                    if buffer is not None and buffer.device != self.device:
                        module._buffers[leaf] = buffer.to(self.device)
        if not parameters:
            self._placeholders_in_load_dtype(model, checkpoint, resident, renamed)

    def _placeholders_in_load_dtype(self, model: nn.Module, checkpoint: Checkpoint, resident: set[str],
                                    renamed: dict[str, str]) -> None:
        """The parameters left unread (a staged component's, read at its stage) get the dtype their read will give
        them: a diffusers model is built in float32, and its placeholders must not say so until its stage, since
        pipelines read `.dtype` before it (e.g. FLUX's latents are made in the transformer's dtype)."""
        cast: dict[int, nn.Parameter] = {}  # tied parameters stay one
        for name, param in list(model.named_parameters(remove_duplicate=False)):
            source = renamed.get(name, name)
            key = self.keys.get(source)
            if name in resident or param.device.type != "meta" or key is None or source in self.saved:
                continue
            stored = checkpoint.tensors[key].dtype
            dtype = target_dtype(source, self.dtype, self.keep_fp32) if stored.is_floating_point else stored
            if dtype is not None and dtype != param.dtype:
                module_name, _, leaf = name.rpartition(".")
                module = model.get_submodule(module_name) if module_name else model
                if id(param) not in cast:
                    cast[id(param)] = nn.Parameter(param.to(dtype), requires_grad=False)
                module._parameters[leaf] = cast[id(param)]

    def read_in_rows(self, checkpoint: Checkpoint, name: str, max_bytes: int = 8 << 20) -> Iterator[torch.Tensor]:
        """This rank's slice of parameter `name`, in the load dtype on its device, as consecutive pieces of its rows
        of at most about `max_bytes` in the file: the slice is never held whole (a pass over a weight's values
        before the read that keeps it)."""
        key = self.keys[name]
        info = checkpoint.tensors[key]
        spec = self.spec(name)
        local = info.shape if spec is None else spec.local_shape(info.shape)
        row_bytes = max(1, _numel(local[1:]) * torch.empty((), dtype=info.dtype).element_size())
        step = max(1, max_bytes // row_bytes)
        dtype = target_dtype(name, self.dtype, self.keep_fp32)
        for start in range(0, info.shape[0], step):
            piece = checkpoint.read(key, spec, rows=(start, min(step, info.shape[0] - start)))
            yield piece.to(device=self.device, dtype=dtype)

    def _nbytes(self, name: str, checkpoint: Checkpoint) -> int:
        if name in self.saved:
            total = 0
            for piece in self.saved[name].pieces(self.spec(name)).values():
                info = checkpoint.tensors[piece.key]
                shape = piece.shape or info.shape
                shape = shape if piece.spec is None else piece.spec.local_shape(shape)
                total += _numel(shape) * torch.empty((), dtype=info.dtype).element_size()
            return total
        info = checkpoint.tensors[self.keys[name]]
        spec = self.spec(name)
        shape = info.shape if spec is None else spec.local_shape(info.shape)
        return _numel(shape) * torch.empty((), dtype=info.dtype).element_size()


def free_parameters(model: nn.Module, device: torch.device) -> None:
    """Drop every parameter's storage. Each is replaced by an empty tensor of its dtype on `device`, so the module
    tree, its hooks, attributes and buffers stay, and so do `.dtype` and `.device`, which pipelines read (e.g. to move
    latents to the VAE) before the stage that reads the weights again. LoRA adapters' factors stay: they are not in
    the checkpoint the stage reads again (docs/lora.md, 'Staged pipelines')."""
    resident, _ = adapter_layout(model)
    keep = {id(tensor) for name, tensor in model.named_parameters(remove_duplicate=False) if name in resident}
    weights_dropped(model)
    for module in model.modules():
        for leaf, param in list(module._parameters.items()):
            if param is not None and id(param) not in keep:
                placeholder = torch.empty(0, dtype=param.dtype, device=device)
                module._parameters[leaf] = nn.Parameter(placeholder, requires_grad=False)


def _is_parameter(model: nn.Module, name: str) -> bool:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return leaf in module._parameters


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def not_converted(name: str, skip: tuple[str, ...]) -> bool:
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
    scheme: Any  # quant.schemes.QuantScheme: which tensors stay packed, the compute dtype
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
                keep_fp32 = not_converted(name, tuple(self.keep_fp32))
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
