"""GGUF single files sliced on read (docs/quantization.md): each rank reads only the rows / whole-block columns of
its shards from the file and holds them packed; every tensor equals the slice of what diffusers' single-process
`from_single_file(..., GGUFQuantizationConfig)` model holds, and the outputs match it."""

from __future__ import annotations

import pytest
import torch
from diffusers import BitsAndBytesConfig, GGUFQuantizationConfig

import paradiff
from paradiff.errors import CheckpointError, ParallelConfigError
from paradiff.io.gguf import GGUFFile
from paradiff_testkit.gguf import save_flux2_gguf, write_gguf, flux2_original_state_dict
from paradiff.testing.models import Lengths, make_inputs, model_class, run_forward, tiny_config

import rank_cases_gguf as cases

RELATIVE_TOLERANCE = 1e-5
# 2 heads of 128, MLP 512, text 512: at tp2 every column slice is 128 or 256 wide, so the 32-blocks of Q8_0 / Q4_0
# fit everywhere and the 256-blocks of the K-quants where the slice is 256 wide
CONFIG = dict(heads=2, head_dim=128)
WIDE = dict(mlp_ratio=2.0, joint_attention_dim=512, timestep_guidance_channels=256, axes_dims_rope=(32, 32, 32, 32))
# original (BFL) name -> type: every type in row-split (colwise), column-split (rowwise) and whole linears
TYPES = {
    "time_in.in_layer.weight": "Q5_K", "time_in.out_layer.weight": "Q8_0",
    "guidance_in.in_layer.weight": "Q4_0", "guidance_in.out_layer.weight": "Q4_0",
    "double_stream_modulation_img.lin.weight": "BF16", "double_stream_modulation_txt.lin.weight": "Q5_0",
    "single_stream_modulation.lin.weight": "Q4_1", "txt_in.weight": "Q4_K", "img_in.weight": "F16",
    "final_layer.linear.weight": "Q6_K", "final_layer.adaLN_modulation.1.weight": "Q8_0",
    "double_blocks.0.img_attn.qkv.weight": "Q4_K", "double_blocks.0.txt_attn.qkv.weight": "Q8_0",
    "double_blocks.0.img_attn.proj.weight": "Q5_1", "double_blocks.0.txt_attn.proj.weight": "F32",
    "double_blocks.0.img_mlp.0.weight": "Q6_K", "double_blocks.0.img_mlp.2.weight": "Q5_K",
    "double_blocks.0.txt_mlp.0.weight": "BF16", "double_blocks.0.txt_mlp.2.weight": "Q6_K",
    "single_blocks.0.linear1.weight": "Q8_0", "single_blocks.0.linear2.weight": "Q4_0",
    "double_blocks.0.img_attn.norm.query_norm.scale": "F16",
}
PLAIN_ITEMSIZE = {"x_embedder.weight": 2, "transformer_blocks.0.attn.norm_q.weight": 2}
REQUIRED = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "BF16")


def tiny_flux2() -> torch.nn.Module:
    torch.manual_seed(5)
    model = model_class("flux2")(**{**tiny_config("flux2", **CONFIG), **WIDE})
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gguf")
    model = tiny_flux2()
    model.save_config(root / "config")
    files = {"config": str(root / "config")}
    save_flux2_gguf(model, root / "mixed.gguf", lambda name, tensor: TYPES.get(name, "F32"))
    files["mixed"] = str(root / "mixed.gguf")
    cutting = {**TYPES, "double_blocks.0.txt_attn.proj.weight": "Q4_K"}  # rowwise: 128 columns a rank at tp2
    save_flux2_gguf(model, root / "cutting.gguf", lambda name, tensor: cutting.get(name, "F32"))
    files["cutting"] = str(root / "cutting.gguf")
    return files


def test_every_shard_is_the_slice_of_diffusers_single_file_gguf_model(pools, gguf_files):
    """tp2 and ulysses2 on one file mixing F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K."""
    runs = [dict(file=gguf_files["mixed"], config=gguf_files["config"], mode=mode, plain_itemsize=PLAIN_ITEMSIZE)
            for mode in ("tp2", "ulysses2")]
    per_rank = pools.get(2).run(cases.gguf_equivalence, cases=runs, timeout_s=600)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(runs)
        tp2, cp2 = results
        for result in results:
            assert result["relative_diff"] <= RELATIVE_TOLERANCE, (rank, result["mode"], result["relative_diff"])
            # the kernel's count of bytes read: the rank's share of the tensors (+ the header, config.json and
            # the store traffic of the agreements), and at least the packed bytes themselves
            assert result["packed_bytes"] <= result["read"] <= result["share"] + result["header"] + 256 * 1024, result
        assert tp2["share"] < 0.55 * tp2["total"] and cp2["share"] == cp2["total"], (tp2, cp2)
        assert tp2["packed_bytes"] < 0.55 * cp2["packed_bytes"], (tp2, cp2)  # held packed: about half the bytes
        for kind in REQUIRED:
            assert {"rows", "columns"} <= set(tp2["splits"][kind]), (kind, tp2["splits"])
        assert "whole" in tp2["splits"]["Q6_K"] and "columns" in tp2["splits"]["F32"], tp2["splits"]
        assert set(cp2["splits"]) >= set(REQUIRED) and all(v == ["whole"] for v in cp2["splits"].values())


def test_tp2_x_ulysses2_shards_and_output(pools, gguf_files):
    """TP inside each Ulysses group: the same shards as tp2, the output of diffusers' single process."""
    runs = [dict(file=gguf_files["mixed"], config=gguf_files["config"], mode="tp2xulysses2",
                 plain_itemsize=PLAIN_ITEMSIZE)]
    for (result,) in pools.get(4).run(cases.gguf_equivalence, cases=runs, timeout_s=600):
        assert result["relative_diff"] <= RELATIVE_TOLERANCE, result
        assert result["share"] < 0.55 * result["total"], result
        assert result["packed_bytes"] <= result["read"] <= result["share"] + result["header"] + 256 * 1024, result


def test_a_split_cutting_a_block_is_refused_by_name_before_any_read(pools, gguf_files):
    errors = pools.get(2).run(cases.refused_before_read, file=gguf_files["cutting"], config=gguf_files["config"])
    for error in errors:  # every rank raises, none hangs
        assert error.startswith("PlanError"), error
        for fragment in ("transformer_blocks.0.attn.to_add_out.weight", "double_blocks.0.txt_attn.proj.weight",
                         "Q4_K", "block of 256", "tp_degree"):
            assert fragment in error, (fragment, error)


def _load_both(file: str, config: str, skip: list[str] | None):
    quantization = GGUFQuantizationConfig(compute_dtype=torch.float32)
    quantization.modules_to_not_convert = skip  # diffusers' quantizer reads it; the constructor does not take it
    cls = model_class("flux2")
    reference = cls.from_single_file(file, config=config, quantization_config=quantization)
    model = paradiff.from_single_file(cls, file, config=config, quantization_config=quantization, device="cpu")
    return reference, model


@pytest.mark.parametrize("skip", [None, ["proj_out", "context_embedder"]], ids=["packed", "modules_to_not_convert"])
def test_single_process_gguf_equals_diffusers_from_single_file(gguf_files, skip):
    reference, model = _load_both(gguf_files["mixed"], gguf_files["config"], skip)
    expected = dict(reference.named_parameters())
    held = dict(model.named_parameters())
    assert held.keys() == expected.keys()
    for name, param in held.items():
        # (diffusers leaves a dequantized modules_to_not_convert weight a plain tensor; paradiff a Parameter)
        assert param.dtype == expected[name].dtype, name
        assert getattr(param, "quant_type", None) == getattr(expected[name], "quant_type", None), name
        assert torch.equal(param.data, expected[name].data), name
    if skip:
        assert not hasattr(held["proj_out.weight"], "quant_type") and held["proj_out.weight"].dtype == torch.float32
    assert {type(m).__name__ for m in model.modules()} == {type(m).__name__ for m in reference.modules()}
    inputs = make_inputs("flux2", reference.config, batch=1, lengths=Lengths(height=4, width=4, text=6))
    assert torch.equal(run_forward(model, inputs), run_forward(reference, inputs))


def test_original_names_map_to_every_parameter_by_diffusers_converter(gguf_files):
    """The file holds BFL's names (fused QKV, (shift, scale) modulation); the model's parameters come from them."""
    with GGUFFile(gguf_files["mixed"]) as gguf_file:
        names = set(gguf_file.tensors)
    assert "double_blocks.0.img_attn.qkv.weight" in names and "transformer_blocks.0.attn.to_q.weight" not in names
    assert set(flux2_original_state_dict(tiny_flux2())) == names


def test_unsupported_gguf_type_is_refused_naming_the_tensor(tmp_path, gguf_files):
    model = tiny_flux2()
    path = tmp_path / "tq.gguf"
    write_gguf(path, flux2_original_state_dict(model), lambda name, tensor: "F32")
    _rewrite_type(path, "double_blocks.0.img_attn.qkv.weight", "TQ2_0")
    with pytest.raises(CheckpointError) as caught:
        paradiff.from_pretrained(model_class("flux2"), str(path), config=gguf_files["config"], device="cpu",
                                 quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32))
    assert "double_blocks.0.img_attn.qkv.weight" in str(caught.value) and "TQ2_0" in str(caught.value)


def _rewrite_type(path, name: str, type_name: str) -> None:
    """Rewrite the file with `name` in `type_name` (a ggml type gguf-py can quantize but paradiff cannot hold)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(path) + ".tmp", arch="flux")
    for tensor in reader.tensors:
        data = torch.from_numpy(tensor.data.copy()).reshape(*reversed([int(d) for d in tensor.shape])).numpy()
        if tensor.name == name:
            qtype = gguf.GGMLQuantizationType[type_name]
            writer.add_tensor(tensor.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    import os

    os.replace(str(path) + ".tmp", path)


@pytest.mark.parametrize("make_call, error, fragments", [
    (lambda files: dict(path=files["mixed"], config=files["config"], quantization_config=None), ParallelConfigError,
     ["GGUFQuantizationConfig(compute_dtype"]),
    (lambda files: dict(path=files["mixed"], config=files["config"],
                        quantization_config=BitsAndBytesConfig(load_in_4bit=True)),
     ParallelConfigError, ["BitsAndBytesConfig", "pre-quantized"]),
    (lambda files: dict(path=files["config"], quantization_config=GGUFQuantizationConfig()), ParallelConfigError,
     ["GGUFQuantizationConfig", "single file"]),
    (lambda files: dict(path=files["mixed"] + ".missing.gguf", config=files["config"],
                        quantization_config=GGUFQuantizationConfig()),
     CheckpointError, ["not a local file"]),
], ids=["no-config", "other-config", "folder", "missing-file"])
def test_bad_gguf_requests_are_one_clear_error_before_any_read(gguf_files, monkeypatch, make_call, error, fragments):
    monkeypatch.setattr(GGUFFile, "read", lambda *a, **k: (_ for _ in ()).throw(AssertionError("read")))
    call = make_call(gguf_files)
    with pytest.raises(error) as caught:
        paradiff.from_pretrained(model_class("flux2"), call.pop("path"), device="cpu", **call)
    assert all(fragment in str(caught.value) for fragment in fragments), str(caught.value)


def test_without_config_the_repository_is_the_one_diffusers_infers(gguf_files, monkeypatch):
    """As from_single_file does: the repository from the file's names and shapes, the class's default subfolder;
    only its config.json is fetched (here answered with the tiny model's)."""
    import huggingface_hub

    asked = []

    def fake_download(repo_id, filename, subfolder=None, **kwargs):
        asked.append((repo_id, filename, subfolder))
        return f"{gguf_files['config']}/config.json"

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    model = paradiff.from_single_file(model_class("flux2"), gguf_files["mixed"], device="cpu",
                                      quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32))
    assert asked == [("black-forest-labs/FLUX.2-dev", "config.json", "transformer")]
    assert model.config.num_attention_heads == CONFIG["heads"]


READER_TYPES = {"a": "Q8_0", "b": "Q4_K", "c": "F16", "d": "F32", "e": "BF16", "f": "Q6_K"}


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    torch.manual_seed(0)
    tensors = {name: torch.randn(6, 512) for name in READER_TYPES}
    tensors["v"] = torch.randn(40)
    path = tmp_path_factory.mktemp("reader") / "small.gguf"
    write_gguf(path, tensors, lambda name, tensor: READER_TYPES.get(name, "F32"))
    return path


@pytest.mark.parametrize("rows, spec", [
    (None, None), ((2, 3), None), (None, (0, ((0, 2), (4, 1)))), ((1, 4), (1, ((256, 256),))),
    (None, (1, ((0, 256), (512 - 256, 256)))),
], ids=["whole", "rows", "row-pieces", "rows-then-columns", "column-pieces"])
def test_reader_slices_are_the_bytes_of_gguf_py_reader(small_file, rows, spec):
    """Each read is the slice of what gguf-py's own reader maps for the tensor: rows as they are, columns as the bytes
    of the whole blocks they cover; the bytes counted are exactly the slice's."""
    import gguf
    from paradiff.tensor_parallel.styles import ShardSpec

    reader = {tensor.name: tensor for tensor in gguf.GGUFReader(str(small_file)).tensors}
    shard = None if spec is None else ShardSpec(*spec)
    with GGUFFile(small_file) as gguf_file:
        for name, type_name in READER_TYPES.items():
            info = gguf_file.tensors[name]
            full = torch.from_numpy(reader[name].data.copy()).view(torch.uint8).reshape(info.byte_shape)
            expected = full if rows is None else full[rows[0]:rows[0] + rows[1]]
            if shard is not None:
                pieces = shard.pieces if shard.dim == 0 else [
                    (s // info.block * info.type_size, n // info.block * info.type_size) for s, n in shard.pieces]
                expected = torch.cat([expected.narrow(shard.dim, s, n) for s, n in pieces], dim=shard.dim)
            before = gguf_file.bytes_read
            got = gguf_file.read(name, rows, shard)
            assert gguf_file.bytes_read - before == expected.numel(), name
            assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1)), (name, type_name)
            assert got.dtype == ({"F16": torch.float16, "F32": torch.float32}.get(type_name, torch.uint8)), name


def test_reader_refuses_a_piece_of_a_block(small_file):
    from paradiff.tensor_parallel.styles import ShardSpec

    with GGUFFile(small_file) as gguf_file, pytest.raises(CheckpointError, match="cut a block of 256"):
        gguf_file.read("b", spec=ShardSpec(1, ((0, 128),)))


@pytest.mark.parametrize("damage, fragment", [
    (lambda data: data[: len(data) - 100], "truncated"),
    (lambda data: data[:40], "runs past the end"),
    (lambda data: b"GGML" + data[4:], "not a GGUF file"),
    (lambda data: data[:4] + (9).to_bytes(4, "little") + data[8:], "GGUF version 9"),
], ids=["data", "header", "magic", "version"])
def test_damaged_gguf_file_is_refused_before_any_read(small_file, tmp_path, damage, fragment):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(damage(small_file.read_bytes()))
    with pytest.raises(CheckpointError, match=fragment):
        GGUFFile(broken)


def pipeline_gguf_type(name: str, tensor: torch.Tensor) -> str:
    """Q8_0 for the 2-D weights whose tp2 column slices are whole 32-blocks, Q4_0 for the MLPs', BF16 otherwise."""
    if tensor.dim() != 2 or tensor.shape[-1] % 64:
        return "BF16" if tensor.dim() == 2 else "F32"
    return "Q4_0" if "mlp" in name or "linear1" in name else "Q8_0"


def test_load_pipeline_reads_the_transformer_from_a_gguf_file(pools, tiny_pipeline_folders, tmp_path):
    """load_pipeline(tp2, transformer_file=...) over the tiny FLUX.2 pipeline with its transformer as a GGUF file:
    the transformer's shards are those of from_pretrained(file) at tp2, the images those of diffusers' pipeline
    with the file's from_single_file transformer; the same staged (the slices read again at their stage)."""
    folder = tiny_pipeline_folders["flux2"]
    transformer = model_class("flux2").from_pretrained(folder / "transformer")
    file = tmp_path / "transformer.gguf"
    types = save_flux2_gguf(transformer, file, pipeline_gguf_type)
    assert {"Q8_0", "Q4_0", "BF16"} <= set(types.values()), types
    results = pools.get(2).run(cases.pipeline_gguf, folder=str(folder), file=str(file), timeout_s=600)
    for result in results:
        assert result["packed"] > 10 and result["spread"] > 0.05, result
        assert result["diff"] <= 1e-5 and result["staged_diff"] <= 1e-5, result
        assert result["staged_packed"] == result["packed"], result


def test_load_pipeline_gguf_file_without_its_config_is_refused_before_any_read(tiny_pipeline_folders, tmp_path,
                                                                               monkeypatch):
    from diffusers import PipelineQuantizationConfig

    folder = tiny_pipeline_folders["flux2"]
    monkeypatch.setattr(GGUFFile, "read", lambda *a, **k: (_ for _ in ()).throw(AssertionError("read")))
    file = tmp_path / "t.gguf"
    save_flux2_gguf(model_class("flux2").from_pretrained(folder / "transformer"), file, pipeline_gguf_type)
    int8 = PipelineQuantizationConfig(quant_mapping={"transformer": BitsAndBytesConfig(load_in_4bit=True)})
    for config, fragments in ((None, ["no quantization_config", "GGUFQuantizationConfig(compute_dtype=...)"]),
                              (int8, ["BitsAndBytesConfig(...)", "quant_mapping={'transformer': GGUF"])):
        with pytest.raises(ParallelConfigError) as caught:
            paradiff.load_pipeline(folder, transformer_file=str(file), quantization_config=config, device="cpu")
        assert all(fragment in str(caught.value) for fragment in fragments), str(caught.value)
    with pytest.raises(ParallelConfigError, match="'transformer_9', which is not a transformer"):
        paradiff.load_pipeline(folder, transformer_file={"transformer_9": str(file)}, device="cpu")


@pytest.mark.slow
def test_generate_gguf_splits_the_file_and_checks_it_before_any_worker(tiny_pipeline_folders, tmp_path):
    """`paradiff generate FOLDER --tp 2 --gguf FILE --compare`: each rank reports the packed weights it holds, and
    the image equals diffusers' pipeline with the file's from_single_file transformer; at --tp 4 the file's Q8_0
    blocks would be cut (16 of a 64-column weight a rank): one line, exit code 2, before any worker starts."""
    import json

    from paradiff_testkit import command

    folder = tiny_pipeline_folders["flux2"]
    good = tmp_path / "good.gguf"
    save_flux2_gguf(model_class("flux2").from_pretrained(folder / "transformer"), good, pipeline_gguf_type)
    common = ["-m", "paradiff.cli", "generate", str(folder), "--prompt", "a red fox",
              "--height", "32", "--width", "32", "--steps", "1"]
    refused = command.run([*common, "--tp", "4", "--gguf", str(good), "--out", str(tmp_path / "bad")], timeout=300)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert "--gguf" in line and "--tp 4" in line and "Q8_0" in line and "would cut" in line, line
    assert not (tmp_path / "bad" / "report.json").exists()
    out = tmp_path / "run"
    result = command.run([*common, "--tp", "2", "--gguf", f"transformer={good}", "--compare", "--out", str(out)],
                         timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["gguf"] == [f"transformer={good}"]
    assert report["compared_outputs"] == 1 and report["max_abs_diff_vs_single_process"] <= 1e-5, report
    held = [rank["quantization"]["transformer"] for rank in report["ranks"]]
    assert len(held) == 2 and all(item["scheme"] == "gguf" and item["quantized_linears"] > 10 for item in held), held
