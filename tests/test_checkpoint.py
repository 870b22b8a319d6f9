"""The safetensors reader and writer (paradiff.io.checkpoint), in one process.

Corrupt files must fail at header time with the file, the tensor and what is wrong named; slices read from disk must
equal torch slicing of the full tensor; files written must load with the reference `safetensors` library.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paradiff.io.checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint, SafetensorsWriter, read_header, write_checkpoint
from paradiff.errors import CheckpointError
from paradiff.tensor_parallel.shard import slice_tensor
from paradiff.tensor_parallel.styles import Colwise, PackedColwise, PackedRowwise, Rowwise, ShardSpec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def raw_file(path: Path, header: object, data: bytes = b"", header_bytes: bytes | None = None) -> Path:
    """A safetensors file written by hand, so its header can say anything."""
    raw = header_bytes if header_bytes is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def saved(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / SINGLE_FILE))
    return folder


def expect(match: list[str], call) -> str:
    with pytest.raises(CheckpointError) as info:
        call()
    message = str(info.value)
    missing = [fragment for fragment in match if fragment not in message]
    assert not missing, f"{missing} not in: {message}"
    return message


# ---------------------------------------------------------------------------------------------------------------
# Corrupt single files: caught by the header check, before any tensor data is read.


@pytest.fixture()
def good_file(tmp_path) -> Path:
    folder = saved(tmp_path / "good", {"a.weight": torch.randn(4, 8), "b.bias": torch.randn(8)})
    return folder / SINGLE_FILE


def test_truncated_data(good_file):
    data = good_file.read_bytes()
    good_file.write_bytes(data[:-16])  # b.bias (stored last, 32 bytes) loses its end
    message = expect([str(good_file), "'b.bias'", f"the file has {len(data) - 16} bytes", "truncated"],
                     lambda: read_header(good_file))
    assert f"ends at byte {len(data)}" in message


def test_truncated_inside_header(good_file):
    data = good_file.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    good_file.write_bytes(data[: 8 + header_len // 2])
    expect([str(good_file), f"header length {header_len}", f"file of {8 + header_len // 2} bytes", "truncated"],
           lambda: read_header(good_file))


def test_truncated_to_a_few_bytes(good_file):
    good_file.write_bytes(good_file.read_bytes()[:5])
    expect([str(good_file), "file is 5 bytes", "too short", "truncated"], lambda: read_header(good_file))


def test_empty_file_in_folder(tmp_path):
    (tmp_path / SINGLE_FILE).write_bytes(b"")
    expect([SINGLE_FILE, "file is 0 bytes"], lambda: Checkpoint(tmp_path))


def test_header_lies_about_tensor_size(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}}
    path = raw_file(tmp_path / "lie.safetensors", header, bytes(64))
    expect(["'w'", "shape [4, 4] F32 (64 bytes)", "span 32 bytes", "lies about the tensor's size"],
           lambda: read_header(path))


def test_header_claims_more_data_than_the_file_has(tmp_path):
    header = {"w": {"dtype": "BF16", "shape": [8, 8], "data_offsets": [0, 128]}}
    path = raw_file(tmp_path / "short.safetensors", header, bytes(100))
    expect(["'w'", "the file has", "truncated"], lambda: read_header(path))


def test_header_json_garbage(tmp_path):
    path = raw_file(tmp_path / "garbage.safetensors", None, bytes(16), header_bytes=b"{not json at all\xff")
    expect([str(path), "header is not valid JSON", "corrupt"], lambda: read_header(path))


def test_header_not_an_object(tmp_path):
    path = raw_file(tmp_path / "list.safetensors", [1, 2, 3])
    expect([str(path), "not a JSON object"], lambda: read_header(path))


def test_header_entry_malformed(tmp_path):
    path = raw_file(tmp_path / "entry.safetensors", {"w": {"dtype": "F32", "shape": [2]}}, bytes(8))
    expect(["'w'", "malformed header entry", '"data_offsets"'], lambda: read_header(path))


def test_header_unknown_dtype(tmp_path):
    path = raw_file(tmp_path / "dtype.safetensors", {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}},
                    bytes(8))
    expect(["'w'", "dtype 'F4'", "supported dtypes", "'BF16'", "'F32'"], lambda: read_header(path))


def test_header_negative_offsets(tmp_path):
    path = raw_file(tmp_path / "neg.safetensors", {"w": {"dtype": "U8", "shape": [2], "data_offsets": [-4, -2]}},
                    bytes(8))
    expect(["'w'", "negative data offsets [-4, -2]"], lambda: read_header(path))


def test_metadata_entry_is_ignored(tmp_path):
    header = {"__metadata__": {"format": "pt"}, "w": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}
    path = raw_file(tmp_path / "meta.safetensors", header, b"\x01\x02\x03")
    assert list(read_header(path)) == ["w"]


# ---------------------------------------------------------------------------------------------------------------
# Folders and indexes.


def sharded_folder(folder: Path, tensors: dict[str, torch.Tensor], files: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for index in range(files):
        file_name = f"diffusion_pytorch_model-{index + 1:05d}-of-{files:05d}.safetensors"
        part = {name: tensors[name] for name in names[index::files]}
        save_file(part, str(folder / file_name))
        weight_map.update({name: file_name for name in part})
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.fixture()
def index_folder(tmp_path) -> Path:
    return sharded_folder(tmp_path / "sharded", {f"t{i}": torch.randn(3, i + 1) for i in range(4)})


def test_index_names_missing_file(index_folder):
    index = json.loads((index_folder / INDEX_FILE).read_text())
    index["weight_map"]["t0"] = "diffusion_pytorch_model-00009-of-00009.safetensors"
    (index_folder / INDEX_FILE).write_text(json.dumps(index))
    expect([INDEX_FILE, "'diffusion_pytorch_model-00009-of-00009.safetensors'", "does not exist", str(index_folder)],
           lambda: Checkpoint(index_folder))


def test_index_names_tensor_missing_from_its_file(index_folder):
    index = json.loads((index_folder / INDEX_FILE).read_text())
    index["weight_map"]["ghost"] = index["weight_map"]["t0"]
    (index_folder / INDEX_FILE).write_text(json.dumps(index))
    expect(["'ghost'", repr(index["weight_map"]["t0"]), "has no such tensor"], lambda: Checkpoint(index_folder))


@pytest.mark.parametrize("text", ["{", json.dumps({"metadata": {}})], ids=["garbage", "no-weight-map"])
def test_index_not_valid(index_folder, text):
    (index_folder / INDEX_FILE).write_text(text)
    expect([INDEX_FILE, "not a valid safetensors index"], lambda: Checkpoint(index_folder))


def test_index_shard_truncated(index_folder):
    shard = sorted(index_folder.glob("*-of-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-4])
    expect([shard.name, "truncated"], lambda: Checkpoint(index_folder))


def test_folder_without_weights(tmp_path):
    expect([str(tmp_path), SINGLE_FILE, INDEX_FILE], lambda: Checkpoint(tmp_path))


def test_folder_with_only_pickles(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "diffusion_pytorch_model.bin")
    expect(["['diffusion_pytorch_model.bin']", "no safetensors weights", "safe_serialization=True"],
           lambda: Checkpoint(tmp_path))


def test_index_folder_reads_every_tensor(tmp_path):
    tensors = {f"t{i}": torch.randn(3, i + 1) for i in range(5)}
    with Checkpoint(sharded_folder(tmp_path, tensors, files=3)) as checkpoint:
        assert set(checkpoint.tensors) == set(tensors)
        assert len({info.file for info in checkpoint.tensors.values()}) == 3
        for name, tensor in tensors.items():
            assert torch.equal(checkpoint.read(name), tensor)


# ---------------------------------------------------------------------------------------------------------------
# Slices read from disk equal torch slicing of the full tensor.


def all_specs(shape: tuple[int, ...]) -> list[tuple[str, ShardSpec]]:
    """Every kind of slice the loader asks for, on every dim, for every rank, plus hand-written irregular ones."""
    specs: list[tuple[str, ShardSpec]] = []
    for dim in range(len(shape)):
        size = shape[dim]
        for tp in (2, 3):
            if size % tp == 0:
                for rank in range(tp):
                    specs.append((f"even-d{dim}-r{rank}of{tp}", ShardSpec(dim, ((rank * size // tp, size // tp),))))
            if size % (2 * tp) == 0:  # two packed blocks, each split on its own
                for rank in range(tp):
                    local = size // (2 * tp)
                    pieces = ((rank * local, local), (size // 2 + rank * local, local))
                    specs.append((f"packed-d{dim}-r{rank}of{tp}", ShardSpec(dim, pieces)))
        specs.append((f"irregular-d{dim}", ShardSpec(dim, ((size - 1, 1), (0, min(2, size)), (1, 0)))))
        specs.append((f"whole-d{dim}", ShardSpec(dim, ((0, size),))))
    return specs


SHAPES = [(12,), (6, 12), (4, 6, 12)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{len(s)}d")
@pytest.mark.parametrize("layout", ["single", "index"])
def test_slices_equal_torch_slicing(tmp_path, dtype, shape, layout):
    torch.manual_seed(len(shape))
    tensors = {"x": torch.randn(shape).to(dtype), "before": torch.randn(5).to(dtype), "after": torch.randn(3, 2)}
    folder = saved(tmp_path, tensors) if layout == "single" else sharded_folder(tmp_path, tensors)
    full = tensors["x"]
    with Checkpoint(folder) as checkpoint:
        assert checkpoint.tensors["x"].dtype == dtype and checkpoint.tensors["x"].shape == shape
        assert torch.equal(checkpoint.read("x"), full)
        for label, spec in all_specs(shape):
            got = checkpoint.read("x", spec)
            expected = torch.cat([full.narrow(spec.dim, start, length) for start, length in spec.pieces], spec.dim)
            assert got.dtype == dtype and got.shape == expected.shape, label
            assert torch.equal(got, expected), label
            assert torch.equal(got, slice_tensor(full, spec)), label  # the in-memory path agrees
        for name in ("before", "after"):  # neighbours are untouched by the slicing arithmetic
            assert torch.equal(checkpoint.read(name), tensors[name])


@pytest.mark.parametrize(
    "style,tp",
    [(Colwise(), 4), (Rowwise(), 4), (PackedColwise([1, 1]), 2), (PackedColwise([1, 2, 1]), 4),
     (PackedRowwise(lambda config: [8, 24]), 4)],
    ids=["colwise", "rowwise", "packed-1-1", "packed-1-2-1", "packed-rowwise-callable"],
)
def test_style_shards_read_back_and_tile_the_tensor(tmp_path, style, tp):
    """Reading every rank's shard of a weight and bias covers the full tensor exactly once, in the style's order."""
    weight, bias = torch.randn(32, 32).to(torch.bfloat16), torch.randn(32).to(torch.bfloat16)
    folder = saved(tmp_path, {"w": weight, "b": bias})
    with Checkpoint(folder) as checkpoint:
        covered = torch.zeros(32, dtype=torch.int64)
        for rank in range(tp):
            spec = style.shard_spec("weight", weight.shape, rank, tp, None, "w")
            got = checkpoint.read("w", spec)
            assert torch.equal(got, slice_tensor(weight, spec))
            for start, length in spec.pieces:
                covered[start : start + length] += 1
            bias_spec = style.shard_spec("bias", bias.shape, rank, tp, None, "b")
            assert torch.equal(checkpoint.read("b", bias_spec), slice_tensor(bias, bias_spec))
        assert torch.equal(covered, torch.ones(32, dtype=torch.int64))


def test_scalar_empty_and_integer_tensors(tmp_path):
    tensors = {"scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4), "ids": torch.arange(10, dtype=torch.int64),
               "mask": torch.tensor([True, False, True])}
    with Checkpoint(saved(tmp_path, tensors)) as checkpoint:
        for name, tensor in tensors.items():
            got = checkpoint.read(name)
            assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), name
        assert torch.equal(checkpoint.read("ids", ShardSpec(0, ((2, 3), (8, 2)))), torch.tensor([2, 3, 4, 8, 9]))


# ---------------------------------------------------------------------------------------------------------------
# Writing: what SafetensorsWriter / write_checkpoint produce loads with the reference library.


def mixed_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "blocks.0.weight": torch.randn(16, 8),
        "blocks.0.bias": torch.randn(16).to(torch.bfloat16),
        "blocks.1.weight": torch.randn(4, 6, 8).to(torch.float16),
        "norm.scale": torch.tensor(2.0),
        "pos.ids": torch.arange(7, dtype=torch.int32),
        "empty": torch.zeros(0, 3),
    }


def entries_of(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()]


def test_writer_single_file_loads_with_safetensors(tmp_path):
    tensors = mixed_tensors()
    path = tmp_path / "one.safetensors"
    writer = SafetensorsWriter(path, entries_of(tensors))
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert header_len % 8 == 0  # data stays aligned


def test_writer_refuses_out_of_order_or_wrong_tensors(tmp_path):
    tensors = mixed_tensors()
    writer = SafetensorsWriter(tmp_path / "w.safetensors", entries_of(tensors))
    with pytest.raises(RuntimeError, match=r"expected tensor 'blocks.0.weight' \(torch.float32, 512 bytes\).*"
                                           r"got 'blocks.0.bias'"):
        writer.write("blocks.0.bias", tensors["blocks.0.bias"])
    with pytest.raises(RuntimeError, match=r"got 'blocks.0.weight' \(512 bytes, torch.int32"):
        writer.write("blocks.0.weight", torch.zeros(16, 8, dtype=torch.int32))  # same size, wrong dtype
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    with pytest.raises(RuntimeError, match=r"all 6 tensors .* extra 'more'"):
        writer.write("more", torch.ones(1))
    writer.close()


def test_writer_refuses_unsupported_dtype(tmp_path):
    with pytest.raises(CheckpointError, match=r"'c'.*complex64.*supported"):
        SafetensorsWriter(tmp_path / "c.safetensors", [("c", torch.complex64, (2,))])


@pytest.mark.parametrize("max_shard_bytes", [10**9, 600, 1], ids=["single", "index", "one-per-file"])
def test_write_checkpoint_loads_with_safetensors(tmp_path, max_shard_bytes):
    tensors = mixed_tensors()
    produced: list[str] = []

    def produce(name: str) -> torch.Tensor:
        produced.append(name)
        return tensors[name]

    write_checkpoint(tmp_path, entries_of(tensors), produce, max_shard_bytes, write=True)
    assert produced == list(tensors)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    loaded: dict[str, torch.Tensor] = {}
    if max_shard_bytes == 10**9:
        assert files == [SINGLE_FILE] and not (tmp_path / INDEX_FILE).exists()
    else:
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(files)
        assert len(files) > 1
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
        for file_name in files:
            part = load_file(str(tmp_path / file_name))
            assert all(index["weight_map"][name] == file_name for name in part)
            loaded.update(part)
    if not loaded:
        loaded = load_file(str(tmp_path / SINGLE_FILE))
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with Checkpoint(tmp_path) as checkpoint:  # and our own reader agrees
        for name, tensor in tensors.items():
            assert torch.equal(checkpoint.read(name), tensor), name


def test_write_checkpoint_without_write_only_produces(tmp_path):
    tensors = mixed_tensors()
    produced: list[str] = []
    write_checkpoint(tmp_path / "out", entries_of(tensors), lambda n: produced.append(n) or tensors[n], 600,
                     write=False)
    assert produced == list(tensors)  # every rank takes part in every gather...
    assert not (tmp_path / "out").exists()  # ...but only the writer touches the disk
