"""Safetensors checkpoints read slice by slice and written tensor by tensor.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, data_offsets) and the raw
row-major data. Reading it ourselves with `os.pread` lets a rank fetch exactly the byte ranges of its shard: no
full-size copy, no mmap page faults over the other ranks' slices, and the bytes read are exactly measurable.
Headers are validated against the file size before any data is read.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from paradiff.errors import CheckpointError
from paradiff.tensor_parallel.styles import ShardSpec

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024
SINGLE_FILE = "diffusion_pytorch_model.safetensors"
INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"
# what `transformers` names them (text encoders inside a pipeline folder)
TRANSFORMERS_SINGLE_FILE = "model.safetensors"
TRANSFORMERS_INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)


def _numel(shape: Iterable[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def read_header(path: Path, metadata: dict[str, str] | None = None) -> dict[str, TensorInfo]:
    """Parse and validate one file's header: every tensor's bytes must lie inside the file and match its shape.
    `metadata`: a dict the file's `__metadata__` strings are added to (pre-quantized checkpoints describe their
    tensors there)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: file is {size} bytes, too short to be safetensors (truncated?).")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{path}: header length {header_len} does not fit in a file of {size} bytes (truncated or corrupt)."
                )
            raw = handle.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror}).") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc}); the file is corrupt.") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object; the file is corrupt.")
    data_start = 8 + header_len
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if metadata is not None and isinstance(entry, dict):
                metadata.update({str(key): str(value) for key, value in entry.items()})
            continue
        try:
            dtype_name = entry["dtype"]
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{path}: tensor {name!r} has a malformed header entry {entry!r}; each entry needs \"dtype\", "
                "\"shape\" (list of ints) and \"data_offsets\" ([begin, end])."
            ) from exc
        if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {dtype_name!r}, which paradiff cannot read; supported dtypes: "
                f"{sorted(DTYPES)}."
            )
        dtype = DTYPES[dtype_name]
        if any(s < 0 for s in shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} has a negative size in shape {list(shape)}; the header is corrupt."
            )
        expected = _numel(shape) * _itemsize(dtype)
        if end - begin != expected:
            raise CheckpointError(
                f"{path}: tensor {name!r} claims shape {list(shape)} {entry['dtype']} ({expected} bytes) but its data "
                f"offsets span {end - begin} bytes; the header lies about the tensor's size."
            )
        if begin < 0:
            raise CheckpointError(
                f"{path}: tensor {name!r} has negative data offsets [{begin}, {end}]; the header is corrupt."
            )
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has {size} bytes (truncated)."
            )
        tensors[name] = TensorInfo(name=name, file=path, dtype=dtype, shape=shape, begin=data_start + begin)
    return tensors


class Checkpoint:
    """All tensors of a diffusers (or transformers) model folder, single-file or index-sharded, by name."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}  # the files' `__metadata__`, merged
        self._fds: dict[Path, int] = {}
        for index_name, single_name in ((INDEX_FILE, SINGLE_FILE), (TRANSFORMERS_INDEX_FILE, TRANSFORMERS_SINGLE_FILE)):
            index, single = self.folder / index_name, self.folder / single_name
            if index.is_file():
                self._load_index(index)
                return
            if single.is_file():
                self.tensors = read_header(single, self.metadata)
                return
        self._raise_missing()

    @classmethod
    def of_file(cls, path: Path) -> "Checkpoint":
        """One safetensors file on its own (a LoRA adapter), read like a model folder's."""
        checkpoint = cls.__new__(cls)
        checkpoint.folder, checkpoint._fds, checkpoint.metadata = Path(path).parent, {}, {}
        checkpoint.tensors = read_header(Path(path), checkpoint.metadata)
        return checkpoint

    def _load_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc}).") from exc
        headers: dict[str, dict[str, TensorInfo]] = {}
        for file_name in sorted(set(weight_map.values())):
            path = self.folder / file_name
            if not path.is_file():
                raise CheckpointError(f"{index} names {file_name!r}, which does not exist in {self.folder}.")
            headers[file_name] = read_header(path, self.metadata)
        for name, file_name in weight_map.items():
            if name not in headers[file_name]:
                raise CheckpointError(f"{index} maps tensor {name!r} to {file_name!r}, but that file has no such tensor.")
            self.tensors[name] = headers[file_name][name]

    def _raise_missing(self) -> None:
        others = sorted(p.name for p in self.folder.glob("*") if p.suffix in {".bin", ".pt", ".pth", ".ckpt", ".gguf"})
        if others:
            raise CheckpointError(
                f"{self.folder} holds {others} but no safetensors weights; paradiff reads only safetensors "
                "(convert with diffusers: Model.from_pretrained(...).save_pretrained(dir, safe_serialization=True))."
            )
        raise CheckpointError(
            f"{self.folder} has none of {SINGLE_FILE}, {INDEX_FILE}, {TRANSFORMERS_SINGLE_FILE} or "
            f"{TRANSFORMERS_INDEX_FILE}."
        )

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def read(self, name: str, spec: ShardSpec | None = None, rows: tuple[int, int] | None = None,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor, or only the slice `spec` names, read straight into a fresh CPU tensor of the file dtype.
        `rows` = (start, length): only those rows (first dimension) of it, `spec` then applying to them (a slice
        read in pieces, without holding all of it). `shape`: the stored row-major data taken as this shape (the same
        number of elements) before slicing, e.g. a packed 4-bit weight stored flat, sliced by rows of bytes."""
        info = self.tensors[name]
        if shape is not None:
            if _numel(shape) != _numel(info.shape):
                raise CheckpointError(f"{info.file}: tensor {name!r} of shape {list(info.shape)} cannot be read as "
                                      f"shape {list(shape)}.")
            info = replace(info, shape=tuple(shape))
        if rows is not None:
            start, length = rows
            if not info.shape or start < 0 or length < 0 or start + length > info.shape[0]:
                raise CheckpointError(f"{info.file}: rows {rows} of tensor {name!r} of shape {list(info.shape)}.")
            if spec is not None and spec.dim == 0:
                raise CheckpointError(f"{info.file}: rows {rows} of tensor {name!r} with a slice of its rows.")
            row_bytes = _numel(info.shape[1:]) * _itemsize(info.dtype)
            info = replace(info, shape=(length, *info.shape[1:]), begin=info.begin + start * row_bytes)
        shape = info.shape if spec is None else spec.local_shape(info.shape)
        out = torch.empty(shape, dtype=info.dtype)
        if out.numel() == 0:
            return out
        buffer = memoryview(out.view(torch.uint8).numpy()).cast("B") if out.dim() else memoryview(
            out.reshape(1).view(torch.uint8).numpy()
        ).cast("B")
        fd = self._fd(info.file)
        position = 0
        for offset, length in _byte_ranges(info, spec):
            view = buffer[position : position + length]
            got = 0
            while got < length:
                count = os.preadv(fd, [view[got:]], offset + got)
                if count <= 0:
                    raise CheckpointError(f"{info.file}: unexpected end of file reading tensor {name!r} (truncated).")
                got += count
            position += length
        return out


def _byte_ranges(info: TensorInfo, spec: ShardSpec | None) -> Iterator[tuple[int, int]]:
    """(file offset, length) runs covering the requested slice in row-major order, merged where contiguous."""
    if spec is None:
        yield info.begin, info.nbytes
        return
    shape = info.shape
    itemsize = _itemsize(info.dtype)
    inner = _numel(shape[spec.dim + 1 :]) * itemsize
    outer = _numel(shape[: spec.dim])
    row = shape[spec.dim] * inner
    pending_start, pending_len = -1, 0
    for index in range(outer):
        base = info.begin + index * row
        for start, length in spec.pieces:
            offset, size = base + start * inner, length * inner
            if pending_start + pending_len == offset:
                pending_len += size
                continue
            if pending_len:
                yield pending_start, pending_len
            pending_start, pending_len = offset, size
    if pending_len:
        yield pending_start, pending_len


class SafetensorsWriter:
    """Writes one safetensors file whose header is known up front, then the tensors one at a time, in order."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        self.expected: list[tuple[str, torch.dtype, int]] = []
        for name, dtype, shape in entries:
            if dtype not in DTYPE_NAMES:
                raise CheckpointError(
                    f"{path}: tensor {name!r} has dtype {dtype}, which safetensors cannot store here; supported: "
                    f"{sorted(str(d) for d in DTYPE_NAMES)}."
                )
            nbytes = _numel(shape) * _itemsize(dtype)
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.expected.append((name, dtype, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep data 8-byte aligned, as the reference writer does
        self.handle = open(path, "wb")
        self.handle.write(struct.pack("<Q", len(raw)))
        self.handle.write(raw)
        self.position = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.position >= len(self.expected):
            raise RuntimeError(
                f"{self.handle.name}: all {len(self.expected)} tensors of the header are written; got an extra "
                f"{name!r}."
            )
        expected_name, expected_dtype, nbytes = self.expected[self.position]
        data = tensor.detach().to("cpu").contiguous()
        got = data.numel() * data.element_size()
        if name != expected_name or got != nbytes or data.dtype != expected_dtype:
            raise RuntimeError(
                f"{self.handle.name}: writer expected tensor {expected_name!r} ({expected_dtype}, {nbytes} bytes) "
                f"next, got {name!r} ({got} bytes, {data.dtype}, shape {list(data.shape)}); tensors must come in "
                "header order with the declared dtype and shape."
            )
        self.handle.write(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        self.position += 1

    def close(self) -> None:
        self.handle.close()


def write_checkpoint(
    folder: Path,
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
    produce: Callable[[str], torch.Tensor | None],
    max_shard_bytes: int,
    write: bool,
) -> None:
    """Write `entries` as diffusers-style safetensors (index-sharded above `max_shard_bytes`).

    `produce(name)` is called for every entry on every rank (it may run collectives); only `write=True` writes.
    """
    shards: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
    size = 0
    for entry in entries:
        nbytes = _numel(entry[2]) * _itemsize(entry[1])
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    if write:
        folder.mkdir(parents=True, exist_ok=True)
    for file_name, shard in zip(names, shards):
        writer = SafetensorsWriter(folder / file_name, shard) if write else None
        for name, _, _ in shard:
            tensor = produce(name)
            if writer is not None:
                writer.write(name, tensor)
        if writer is not None:
            writer.close()
    if write and len(shards) > 1:
        total = sum(_numel(shape) * _itemsize(dtype) for _, dtype, shape in entries)
        weight_map = {name: file_name for file_name, shard in zip(names, shards) for name, _, _ in shard}
        (folder / INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
        )
