"""Pre-quantized checkpoints: a diffusers model saved quantized (`save_pretrained` of a bitsandbytes 4-bit or a
torchao int8 / float8 model). Which stored tensors make up each quantized weight, which slice of each a rank reads
for its shard, and the weight they make; every check runs on the headers and the small quant-state records, before
any weight is read.

- **bitsandbytes 4-bit** (`quant_method: bitsandbytes`, `load_in_4bit`): a weight `w` is stored as `w` (the packed
  codes, two per byte, row-major over the flattened weight, shape (n/2, 1)), `w.absmax` (one per block of
  `blocksize` elements; with double quantization uint8 codes of the absmax, themselves in blocks of 256 with
  `w.nested_absmax`, `w.nested_quant_map` and an offset), `w.quant_map` (the 16 code values) and
  `w.quant_state.bitsandbytes__nf4` (or `__fp4`: a JSON record of the shape, dtype, blocksize, quant type). A rank
  reads the bytes and absmax of the blocks of its rows, or of its whole-block columns in every row, and the small
  tables whole. A whole weight keeps its state as saved; a split one holds its absmax as float32 values (with double
  quantization: computed from the codes as bitsandbytes computes them at each product, so the product is the same).
- **torchao** (`quant_method: torchao`, safetensors with torchao's metadata): a weight `m.w` is stored as
  `m._w_qdata` (rows, columns), `m._w_scale` and (int8) `m._w_zero_point`, one per row, described by the file's
  metadata (`Int8Tensor` / `Float8Tensor`, `block_size` [1, columns]: per-row). A rank reads its rows of all three,
  or its columns of the data and the scales whole, and torchao rebuilds the tensor from them.

Anything else (bitsandbytes 8-bit, torchao per-tensor or int4 tensors, other quant methods) is refused by tensor
name and type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from paradiff.errors import CheckpointError, PlanError
from paradiff.quant.schemes import QuantScheme, _skip_list, block_cuts
from paradiff.tensor_parallel.shard import slice_tensor
from paradiff.tensor_parallel.styles import ShardSpec

BNB_STATE = "quant_state.bitsandbytes__"
TORCHAO_TYPES = {"Int8Tensor": "int8", "Float8Tensor": "fp8"}


@dataclass(frozen=True)
class StoredPiece:
    """Read stored tensor `key`, taken as `shape` (None: as stored), sliced by `spec` (None: whole)."""

    key: str
    shape: tuple[int, ...] | None = None
    spec: ShardSpec | None = None


@dataclass(frozen=True)
class SavedWeight:
    """One quantized weight of a pre-quantized checkpoint."""

    name: str  # the parameter, e.g. "transformer_blocks.0.attn.to_q.weight"
    kind: str  # "bnb4" or "torchao"
    keys: dict[str, str]  # role -> stored tensor name (bnb4: packed, absmax, quant_map[, nested_*]; torchao: qdata ...)
    shape: tuple[int, int]  # the weight's logical (full) shape
    state: dict[str, Any] = field(compare=False)  # bnb4: the quant-state record; torchao: the tensor's metadata

    @property
    def block(self) -> int | None:
        """Elements per block of the flattened weight (bnb4), or None (torchao: one scale per row)."""
        return int(self.state["blocksize"]) if self.kind == "bnb4" else None

    def local_shape(self, spec: ShardSpec | None) -> tuple[int, int]:
        return self.shape if spec is None else tuple(spec.local_shape(self.shape))

    def pieces(self, spec: ShardSpec | None) -> dict[str, StoredPiece]:
        """What this rank reads for its slice `spec` of the weight (checked by `check_saved_blocks` first)."""
        rows, cols = self.shape
        if spec is None:
            return {role: StoredPiece(key) for role, key in self.keys.items()}
        if self.kind == "torchao":
            out = {"qdata": StoredPiece(self.keys["qdata"], spec=spec)}
            for role in ("scale", "zero_point"):
                if role in self.keys:
                    out[role] = StoredPiece(self.keys[role], spec=spec if spec.dim == 0 else None)
            return out
        block = self.block
        out = {role: StoredPiece(key) for role, key in self.keys.items() if role not in ("packed", "absmax")}
        if spec.dim == 0:  # rows: a run of the flattened weight; its bytes and its blocks
            out["packed"] = StoredPiece(self.keys["packed"], (-(-rows * cols // 2),),
                                        _scaled(spec, cols, 2))
            out["absmax"] = StoredPiece(self.keys["absmax"], (-(-rows * cols // block),), _scaled(spec, cols, block))
        else:  # columns: whole blocks of every row (cols is a multiple of the block)
            out["packed"] = StoredPiece(self.keys["packed"], (rows, cols // 2), _scaled(spec, 1, 2))
            out["absmax"] = StoredPiece(self.keys["absmax"], (rows, cols // block), _scaled(spec, 1, block))
        return out

    def build(self, parts: dict[str, torch.Tensor], spec: ShardSpec | None, device: torch.device) -> Any:
        """The weight this rank holds, from the `pieces` read: torchao's tensor, or (packed, QuantState) for
        bitsandbytes (quant.apply.ReadQuantizer installs it)."""
        local = self.local_shape(spec)
        if self.kind == "torchao":
            from torchao.prototype.safetensors.safetensors_utils import object_from_dict

            data = {**self.state["_data"], **parts, "block_size": [1, local[1]]}
            return object_from_dict({**self.state, "_data": data}).to(device)
        import bitsandbytes.functional as bnb_functional

        packed = parts["packed"].reshape(-1, 1).to(device)
        record = {key: value for key, value in self.state.items()}
        if spec is None:  # whole: bitsandbytes' own state, as saved (double quantization kept)
            tables = {role: parts[role] for role in parts if role != "packed"}
            state = bnb_functional.QuantState.from_dict({**record, **tables}, device)
            return packed, state
        absmax = parts["absmax"].reshape(-1)
        if "nested_absmax" in parts:
            # bitsandbytes' dequantize_blockwise of the absmax codes (code * absmax of their block of 256), plus the
            # offset, as dequantize_4bit computes it before every product; for this rank's blocks only
            rows, cols = self.shape
            piece = self.pieces(spec)["absmax"]
            index = torch.arange(-(-rows * cols // self.block), dtype=torch.int64).reshape(piece.shape)
            blocks = slice_tensor(index, piece.spec).reshape(-1)
            nested = int(record["nested_blocksize"])
            absmax = parts["nested_quant_map"][absmax.long()] * parts["nested_absmax"][blocks // nested]
            absmax += torch.tensor(float(record["nested_offset"]), dtype=torch.float32)
        state = bnb_functional.QuantState(
            absmax=absmax.to(torch.float32).contiguous(), shape=torch.Size(local), code=parts["quant_map"],
            blocksize=self.block, quant_type=record["quant_type"], dtype=getattr(torch, record["dtype"]))
        state.to(device)
        return packed, state


def _scaled(spec: ShardSpec, unit: int, per: int) -> ShardSpec:
    """`spec`'s pieces in units of `per` stored entries, each of the spec's indices being `unit` elements."""
    return ShardSpec(dim=spec.dim if unit == 1 else 0,
                     pieces=tuple((start * unit // per, -(-(start + length) * unit // per) - start * unit // per)
                                  for start, length in spec.pieces))


def saved_quantization(config: Any) -> dict[str, Any] | None:
    """The `quantization_config` a diffusers model folder's config.json records (it was saved quantized), or None."""
    saved = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config",
                                                                                       None)
    if saved is None:
        return None
    return saved if isinstance(saved, dict) else saved.to_dict()


def saved_weights(saved: dict[str, Any], stored: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                  metadata: dict[str, str], expected: dict[str, tuple[int, ...]],
                  read_record: Callable[[str], bytes], compute_dtype: torch.dtype | None
                  ) -> tuple[QuantScheme, dict[str, SavedWeight]]:
    """The scheme of a pre-quantized checkpoint and its quantized weights by parameter name. `stored`: stored tensor
    name -> (dtype, shape); `metadata`: the files' `__metadata__`; `expected`: the model's state_dict name -> shape;
    `read_record(key)`: the bytes of a small stored record (bitsandbytes' quant state)."""
    method = str(saved.get("quant_method", ""))
    if method == "bitsandbytes" and saved.get("load_in_4bit"):
        return _bnb_weights(saved, stored, expected, read_record, compute_dtype)
    if method == "torchao":
        return _torchao_weights(saved, stored, metadata, expected)
    example = next((name for name, (dtype, _) in stored.items() if not dtype.is_floating_point), None)
    what = ("bitsandbytes 8-bit (LLM.int8: int8 weights with SCB row statistics)" if method == "bitsandbytes"
            else f"quant_method {method!r}")
    tensor = f" (e.g. tensor {example!r}, {stored[example][0]})" if example is not None else ""
    raise CheckpointError(
        f"the checkpoint was saved quantized with {what}{tensor}, which paradiff cannot slice; it reads pre-quantized "
        "bitsandbytes 4-bit (nf4 / fp4) and torchao per-row int8 / float8 checkpoints. Load the unquantized weights "
        "with a quantization_config instead (each rank quantizes its slice on read).")


def _bnb_weights(saved, stored, expected, read_record, compute_dtype) -> tuple[QuantScheme, dict[str, SavedWeight]]:
    weights: dict[str, SavedWeight] = {}
    for key in stored:
        if BNB_STATE not in key:
            continue
        name, _, kind = key.partition("." + BNB_STATE)
        if name not in expected or len(expected[name]) != 2:
            raise CheckpointError(f"tensor {key!r}: a bitsandbytes 4-bit state for {name!r}, which is not a 2-D "
                                  "weight of the model.")
        try:
            record = json.loads(read_record(key).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"tensor {key!r}: not a bitsandbytes quant-state record ({exc}).") from None
        roles = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
        keys = {"packed": name, **{role: f"{name}.{role}" for role in roles if f"{name}.{role}" in stored}}
        weight = SavedWeight(name, "bnb4", keys, tuple(expected[name]), record)
        _check_bnb(weight, kind, stored)
        weights[name] = weight
    blocks = {weight.block for weight in weights.values()}
    kinds = {weight.state["quant_type"] for weight in weights.values()}
    if len(blocks) > 1 or len(kinds) > 1:
        raise CheckpointError(f"the bitsandbytes 4-bit weights mix block sizes {sorted(blocks)} / quant types "
                              f"{sorted(kinds)}; paradiff holds one kind per model.")
    dtype = saved.get("bnb_4bit_compute_dtype")
    compute = compute_dtype if compute_dtype is not None else getattr(torch, str(dtype).replace("torch.", ""), None) \
        if dtype is not None else None
    skip = _skip_list(saved.get("llm_int8_skip_modules"), [])
    scheme = QuantScheme(kinds.pop() if kinds else "nf4", skip=skip, compute_dtype=compute,
                         block=blocks.pop() if blocks else None, saved="bitsandbytes 4-bit")
    return scheme, weights


def _check_bnb(weight: SavedWeight, kind: str, stored) -> None:
    record, name = weight.state, weight.name
    rows, cols = weight.shape
    numel = rows * cols

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"tensor {name!r} (bitsandbytes 4-bit, {kind}): {why}; the checkpoint does not match "
                               "the model or was not written by bitsandbytes' Linear4bit.")

    if record.get("quant_type") not in ("nf4", "fp4") or kind != record.get("quant_type"):
        raise refuse(f"quant_type {record.get('quant_type')!r}")
    if tuple(record.get("shape") or ()) != weight.shape:
        raise refuse(f"its quant state records shape {record.get('shape')}, the model's weight is {list(weight.shape)}")
    if record.get("dtype") not in ("float32", "float16", "bfloat16"):
        raise refuse(f"its quant state records dtype {record.get('dtype')!r}")
    block = int(record.get("blocksize", 0))
    if block not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        raise refuse(f"block size {block}")
    dtype, shape = stored[name]
    if dtype != torch.uint8 or _count(shape) != -(-numel // 2):
        raise refuse(f"the packed weight is {dtype} of shape {list(shape)}, not uint8 with {-(-numel // 2)} bytes "
                     "(quant_storage other than uint8 is not read)")
    for role in ("absmax", "quant_map"):
        if role not in weight.keys:
            raise refuse(f"{name}.{role} is missing")
    nested = "nested_absmax" in weight.keys
    if nested != ("nested_quant_map" in weight.keys) or nested != ("nested_offset" in record):
        raise refuse("its double-quantization tensors are incomplete")
    absmax_dtype, absmax_shape = stored[weight.keys["absmax"]]
    if _count(absmax_shape) != -(-numel // block) or absmax_dtype != (torch.uint8 if nested else torch.float32):
        raise refuse(f"{name}.absmax is {absmax_dtype} of shape {list(absmax_shape)}")


def _torchao_weights(saved, stored, metadata, expected) -> tuple[QuantScheme, dict[str, SavedWeight]]:
    if "tensor_names" not in metadata:
        raise CheckpointError(
            "the checkpoint was saved with torchao but its safetensors files carry no torchao metadata "
            "('tensor_names'); paradiff reads torchao checkpoints saved with safetensors by diffusers >= 0.36 and "
            "torchao >= 0.16 (a pickled .bin checkpoint is not read).")
    weights: dict[str, SavedWeight] = {}
    kinds = set()
    for name in json.loads(metadata["tensor_names"]):
        record = json.loads(metadata.get(name, "{}"))
        kind = record.get("_type")
        if kind in ("Tensor", "torch.Tensor"):
            continue
        module, _, leaf = name.rpartition(".")
        data = record.get("_data") or {}
        shape = tuple(expected.get(name, ()))
        block = list(data.get("block_size") or [])
        if kind not in TORCHAO_TYPES or len(shape) != 2 or block != [1, shape[1]] or data.get("act_quant_kwargs"):
            raise CheckpointError(
                f"tensor {name!r} is stored as torchao {kind} (block_size {block}, activation quantization "
                f"{data.get('act_quant_kwargs')!r}), which paradiff cannot slice; it reads per-row weight-only "
                "Int8Tensor / Float8Tensor weights (block_size [1, in_features]).")
        keys = {role: f"{module}._{leaf}_{role}" for role in record.get("_tensor_data_names") or []}
        missing = [key for key in keys.values() if key not in stored]
        if missing or "qdata" not in keys or tuple(stored[keys["qdata"]][1]) != shape:
            raise CheckpointError(f"tensor {name!r} (torchao {kind}): stored parts {sorted(keys.values())} do not "
                                  f"match the model's weight of shape {list(shape)} (missing: {missing}).")
        for role in ("scale", "zero_point"):
            if role in keys and tuple(stored[keys[role]][1]) != (shape[0], 1):
                raise CheckpointError(f"tensor {keys[role]!r} has shape {list(stored[keys[role]][1])}, not one per "
                                      f"row of {name!r} ({[shape[0], 1]}).")
        unknown = set(keys) - {"qdata", "scale", "zero_point"}
        if unknown:
            raise CheckpointError(f"tensor {name!r} (torchao {kind}) has parts {sorted(unknown)} paradiff does not "
                                  "slice.")
        weights[name] = SavedWeight(name, "torchao", keys, shape, record)
        kinds.add(TORCHAO_TYPES[kind])
    if len(kinds) > 1:
        raise CheckpointError(f"the torchao checkpoint mixes {sorted(kinds)} weights; paradiff holds one kind per "
                              "model.")
    skip = _skip_list(saved.get("modules_to_not_convert"), [])
    return QuantScheme(kinds.pop() if kinds else "int8", skip=skip, saved="torchao"), weights


def _count(shape) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def check_saved_blocks(weights: dict[str, SavedWeight], resolved: Any) -> None:
    """Refuse, by parameter, a planned slice of a saved 4-bit weight that would cut one of its blocks (the same rule
    as for quantizing on read, `schemes.check_block_boundaries`), before any read."""
    if resolved is None:
        return
    for name, weight in weights.items():
        spec = resolved.spec_for(name)
        if spec is None or weight.block is None:
            continue
        rows, cols = weight.shape
        cut = block_cuts(spec, rows, cols, weight.block)
        if cut:
            raise PlanError(
                f"{name}: the checkpoint stores it as bitsandbytes 4-bit in blocks of {weight.block} elements of the "
                f"flattened weight {(rows, cols)}, and this rank's {'rows' if spec.dim == 0 else 'columns'} "
                f"{cut} (start, length) would cut a block, so its shard cannot be read as whole blocks. Choose a "
                f"tp_degree whose slices of {name} are multiples of {weight.block} elements.")

