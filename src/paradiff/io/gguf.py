"""GGUF single files read slice by slice.

A GGUF file (llama.cpp's format, v2 / v3, little-endian) is: the magic "GGUF", a version, the tensor and key-value
counts, the key-values (`general.alignment` among them), one info record per tensor (name, dimensions innermost
first, ggml type, offset) and, from the next alignment boundary, the data. A ggml tensor is row-major over its
torch-order shape; a quantized type packs each run of `block` consecutive elements of the last dimension into
`type_size` bytes, block by block, every block self-contained. So a slice of whole rows (any dimension but the last)
is a set of byte runs, and so is a slice of the last dimension whose pieces start and end on block boundaries: the
bytes of those blocks in every row. Reading with `os.preadv`, a rank fetches exactly those bytes; the header is
checked against the file size before any data is read.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from paradiff.errors import CheckpointError
from paradiff.tensor_parallel.styles import ShardSpec

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_HEADER_BYTES = 512 * 1024 * 1024
# the value types of GGUF key-values: fixed-size scalars by struct code; 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# ggml types torch reads as plain tensors (as diffusers' loader does); every other type is held packed
PLAIN_DTYPES = {"F32": torch.float32, "F16": torch.float16}


def supported_types() -> dict[int, str]:
    """ggml type id -> name, for every type paradiff can hold: F32 / F16 as tensors, and each type diffusers'
    GGUF linear can dequantize (BF16, Q4_0 ... Q8_0, the K-quants, IQ4)."""
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES
    import gguf

    types = [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, *SUPPORTED_GGUF_QUANT_TYPES]
    return {int(t): t.name for t in types}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_id: int
    type_name: str
    shape: tuple[int, ...]  # torch order (outermost first), in elements
    block: int  # elements per block of the last dimension (1: not blocked)
    type_size: int  # bytes per block
    begin: int  # absolute byte offset in the file

    @property
    def quantized(self) -> bool:
        """Held packed (GGUFParameter bytes) rather than as a torch tensor of its dtype."""
        return self.type_name not in PLAIN_DTYPES

    @property
    def byte_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-1], self.shape[-1] // self.block * self.type_size) if self.shape else ()

    @property
    def nbytes(self) -> int:
        return _numel(self.byte_shape) if self.shape else self.type_size

    def local_nbytes(self, spec: ShardSpec | None) -> int:
        if spec is None:
            return self.nbytes
        shape = spec.local_shape(self.shape)
        return _numel(shape[:-1]) * (shape[-1] // self.block * self.type_size)

    def cut_pieces(self, spec: ShardSpec | None) -> list[tuple[int, int]]:
        """The pieces of `spec` that would cut a block (a split of the last dimension off block boundaries)."""
        if spec is None or self.block == 1 or spec.dim != len(self.shape) - 1:
            return []
        return [(start, length) for start, length in spec.pieces if start % self.block or length % self.block]


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


class _Header:
    """Sequential reader of the header bytes, refusing anything that runs past the file."""

    def __init__(self, path: Path, handle, size: int) -> None:
        self.path, self.handle, self.size, self.position = path, handle, size, 0

    def take(self, count: int) -> bytes:
        if count < 0 or self.position + count > min(self.size, MAX_HEADER_BYTES):
            raise CheckpointError(
                f"{self.path}: the GGUF header runs past the end of the file ({self.size} bytes) at byte "
                f"{self.position}; the file is truncated or not GGUF."
            )
        data = self.handle.read(count)
        self.position += count
        return data

    def unpack(self, code: str):
        return struct.unpack("<" + code, self.take(struct.calcsize(code)))[0]

    def string(self) -> str:
        raw = self.take(self.unpack("Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{self.path}: a GGUF header string is not UTF-8 ({exc}); the file is corrupt.") \
                from exc

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, count = self.unpack("I"), self.unpack("Q")
            return [self.value(inner) for _ in range(count)]
        raise CheckpointError(f"{self.path}: unknown GGUF value type {kind} at byte {self.position}; corrupt header.")


def read_gguf_header(path: Path) -> tuple[dict[str, object], dict[str, GGUFTensor], int]:
    """(key-values, tensors by name, header bytes read). Every tensor's type must be one paradiff holds and its
    bytes must lie inside the file."""
    import gguf

    types = supported_types()
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            header = _Header(path, handle, size)
            if header.take(4) != MAGIC:
                raise CheckpointError(f"{path}: not a GGUF file (no 'GGUF' magic).")
            version = header.unpack("I")
            if version not in (2, 3):
                raise CheckpointError(
                    f"{path}: GGUF version {version} (a big-endian or unknown file); paradiff reads little-endian "
                    "GGUF v2 / v3."
                )
            tensor_count, kv_count = header.unpack("Q"), header.unpack("Q")
            metadata = {}
            for _ in range(kv_count):
                key = header.string()
                metadata[key] = header.value(header.unpack("I"))
            infos = []
            for _ in range(tensor_count):
                name = header.string()
                dims = [header.unpack("Q") for _ in range(header.unpack("I"))]
                infos.append((name, tuple(reversed(dims)), header.unpack("I"), header.unpack("Q")))
            read = header.position
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror}).") from exc
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-read // alignment) * alignment
    tensors = {}
    for name, shape, type_id, offset in infos:
        if type_id not in types:
            known = gguf.GGMLQuantizationType(type_id).name if type_id in gguf.GGMLQuantizationType._value2member_map_ \
                else f"type id {type_id}"
            raise CheckpointError(
                f"{path}: tensor {name!r} is stored as {known}, which paradiff cannot hold or slice; supported GGUF "
                f"types: {sorted(types.values())}."
            )
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
        if shape and shape[-1] % block:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({types[type_id]}) has {shape[-1]} elements per row, not a multiple of its "
                f"block of {block}; the header is corrupt."
            )
        info = GGUFTensor(name, type_id, types[type_id], shape, block, type_size, data_start + offset)
        if info.begin + info.nbytes > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {info.begin + info.nbytes} but the file has {size} bytes "
                "(truncated)."
            )
        tensors[name] = info
    return metadata, tensors, read


class GGUFFile:
    """One GGUF file: its tensors by name, read whole or by a slice of rows or of whole blocks of columns."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.metadata, self.tensors, self.header_bytes = read_gguf_header(self.path)
        self.bytes_read = 0  # tensor bytes read so far (the header's are `header_bytes`)
        self._fd: int | None = None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, name: str, rows: tuple[int, int] | None = None, spec: ShardSpec | None = None) -> torch.Tensor:
        """Rows [start, start + length) of the tensor (all rows: None), and of those only the slice `spec` names
        (in the tensor's own coordinates, rows counted from `start`). F32 / F16 come back as tensors of that dtype,
        every other type as its packed bytes, uint8 of shape (..., blocks x type_size)."""
        info = self.tensors[name]
        cut = info.cut_pieces(spec)
        if cut:  # checked at prepare; kept here so that no caller can read a piece of a block
            raise CheckpointError(f"{self.path}: tensor {name!r} ({info.type_name}) pieces {cut} cut a block of "
                                  f"{info.block}.")
        shape = list(info.shape) if info.shape else [1]
        begin = info.begin
        if rows is not None:
            start, length = rows
            if len(shape) == 1:  # the rows of a 1-D tensor are its elements: whole blocks only
                if start % info.block or length % info.block:
                    raise CheckpointError(f"{self.path}: elements {rows} of 1-D tensor {name!r} ({info.type_name}) "
                                          f"cut a block of {info.block}.")
                begin += start // info.block * info.type_size
            else:
                begin += start * _numel(info.byte_shape[1:])
            shape[0] = length
        byte_shape = [*shape[:-1], shape[-1] // info.block * info.type_size]
        byte_spec = None
        if spec is not None:
            pieces = spec.pieces
            if spec.dim == len(shape) - 1:
                pieces = tuple((s // info.block * info.type_size, n // info.block * info.type_size) for s, n in pieces)
            byte_spec = ShardSpec(dim=spec.dim, pieces=pieces)
        out_shape = byte_shape if byte_spec is None else list(byte_spec.local_shape(byte_shape))
        out = torch.empty(out_shape, dtype=torch.uint8)
        if out.numel():
            buffer = memoryview(out.reshape(-1).numpy()).cast("B")
            position = 0
            for offset, length in _byte_runs(begin, byte_shape, byte_spec):
                self._pread(buffer[position:position + length], offset, name)
                position += length
            self.bytes_read += position
        if not info.shape:
            out = out.reshape(())
        if not info.quantized:
            dtype = PLAIN_DTYPES[info.type_name]
            element = torch.empty((), dtype=dtype).element_size()
            out = out.view(dtype).reshape(*out_shape[:-1], out_shape[-1] // element) if info.shape else \
                out.reshape(-1).view(dtype).reshape(())
        return out

    def _pread(self, view: memoryview, offset: int, name: str) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        got = 0
        while got < len(view):
            count = os.preadv(self._fd, [view[got:]], offset + got)
            if count <= 0:
                raise CheckpointError(f"{self.path}: unexpected end of file reading tensor {name!r} (truncated).")
            got += count


def _byte_runs(begin: int, byte_shape: Sequence[int], spec: ShardSpec | None) -> Iterator[tuple[int, int]]:
    """(file offset, length) runs covering `spec` of a row-major uint8 array at `begin`, merged where contiguous."""
    if spec is None:
        yield begin, _numel(byte_shape)
        return
    inner = _numel(byte_shape[spec.dim + 1:])
    outer = _numel(byte_shape[:spec.dim])
    row = byte_shape[spec.dim] * inner
    pending_start, pending_len = -1, 0
    for index in range(outer):
        base = begin + index * row
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
