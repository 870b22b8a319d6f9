"""Quantize on read (docs/quantization.md): each rank quantizes the slice it reads, and every quantized shard equals
the slice of the single-device quantized tensor (data and scales); outputs match the quantized single process."""

from __future__ import annotations

import pytest
import torch
from diffusers import BitsAndBytesConfig, GGUFQuantizationConfig, TorchAoConfig

import paradiff
from paradiff.errors import CheckpointError, ParallelConfigError
from paradiff.io.checkpoint import Checkpoint
from paradiff.testing.models import build_model, model_class, save_model, tiny_config

import rank_cases_quant as cases

FAMILIES = ("flux2", "wan")
SCHEMES = ("int8", "fp8", "nf4")
MODES = ("tp2", "ulysses2")
RELATIVE_TOLERANCE = 1e-5


# widths of the inputs the plans split rowwise (text and timestep projections), so that at tp2 every slice of every
# planned weight is whole nf4 blocks of 64
BLOCK_WIDE = {"flux2": dict(joint_attention_dim=128, timestep_guidance_channels=128),
              "wan": dict(text_dim=128, freq_dim=128, ffn_dim=256)}


def block_wide_model(family: str) -> torch.nn.Module:
    torch.manual_seed(3)
    model = model_class(family)(**{**tiny_config(family, head_dim=64), **BLOCK_WIDE[family]})
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def quant_checkpoints(tmp_path_factory) -> dict[str, str]:
    """Tiny checkpoints with 64-wide heads and inputs: at tp2 every planned slice of them is whole nf4 blocks."""
    folders = {}
    for family in FAMILIES:
        folders[family] = str(save_model(block_wide_model(family), tmp_path_factory.mktemp(f"quant-{family}")))
    folders["flux2-narrow"] = str(save_model(build_model("flux2", seed=3, head_dim=16),
                                             tmp_path_factory.mktemp("quant-flux2-narrow")))
    return folders


def test_every_shard_is_the_slice_of_the_single_device_quantized_tensor(pools, quant_checkpoints):
    """Flux2 and Wan x int8 / fp8 (torchao) / nf4 (bitsandbytes) x tp2 / ulysses2, in one pool run."""
    runs = [dict(family=family, folder=quant_checkpoints[family], scheme=scheme, mode=mode)
            for family in FAMILIES for scheme in SCHEMES for mode in MODES]
    per_rank = pools.get(2).run(cases.quantized_equivalence, cases=runs, timeout_s=600)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(runs)
        for result in results:
            where = f"rank {rank} {result['family']} {result['scheme']} {result['mode']}"
            assert result["quantized"] > 10, where
            assert result["relative_diff"] <= RELATIVE_TOLERANCE, (where, result["relative_diff"])
            if result["mode"] == "tp2":
                assert result["column_split"] > 0, where  # the rowwise path (whole-row scales) ran
    tp2 = {(r["family"], r["scheme"]): r["local_quantized_bytes"] for r in per_rank[0] if r["mode"] == "tp2"}
    cp2 = {(r["family"], r["scheme"]): r["local_quantized_bytes"] for r in per_rank[0] if r["mode"] == "ulysses2"}
    assert all(tp2[key] < cp2[key] for key in tp2), (tp2, cp2)  # TP ranks hold their share; CP ranks everything


def test_nf4_slice_cutting_a_block_is_refused_by_name_before_any_read(pools, quant_checkpoints):
    errors = pools.get(2).run(cases.refused_before_read, family="flux2", folder=quant_checkpoints["flux2-narrow"],
                              scheme="nf4", mode="tp2")
    for error in errors:  # every rank raises, none hangs
        assert error.startswith("PlanError"), error
        assert "would cut a block" in error and "llm_int8_skip_modules" in error, error
        assert "attn.to_out.0" in error or "attn.to_add_out" in error or "ff" in error, error


@pytest.fixture
def no_weight_read(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("a weight was read before the quantization request was checked")

    monkeypatch.setattr(Checkpoint, "read", refuse)


def _torchao(name: str, **kwargs):
    import torchao.quantization as ao

    return TorchAoConfig(getattr(ao, name)(**kwargs))


@pytest.mark.parametrize("make_config, fragments", [
    (lambda: _torchao("Int8DynamicActivationInt8WeightConfig"),
     ["Int8DynamicActivationInt8WeightConfig", "not supported", "Int8WeightOnlyConfig"]),
    (lambda: _torchao("Int8WeightOnlyConfig", granularity=__import__("torchao.quantization").quantization.PerTensor()),
     ["granularity", "PerRow"]),
    (lambda: BitsAndBytesConfig(load_in_8bit=True), ["load_in_8bit=True", "not supported"]),
    (lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4"), ["'fp4'", "'nf4'"]),
    (lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
     ["bnb_4bit_use_double_quant=True"]),
    (lambda: GGUFQuantizationConfig(compute_dtype=torch.float32), ["GGUFQuantizationConfig", "not supported", "GGUF"]),
    (lambda: {"load_in_4bit": True}, ["quantization_config=dict(...)", "BitsAndBytesConfig(load_in_4bit=True"]),
], ids=["dynamic-activation", "per-tensor", "bnb-8bit", "bnb-fp4", "double-quant", "gguf", "dict"])
def test_unsupported_scheme_is_one_clear_error_before_any_read(quant_checkpoints, no_weight_read, make_config,
                                                                fragments):
    with pytest.raises(ParallelConfigError) as caught:
        paradiff.from_pretrained(model_class("flux2"), quant_checkpoints["flux2"], quantization_config=make_config(),
                                 device="cpu")
    assert all(fragment in str(caught.value) for fragment in fragments), str(caught.value)


def test_modules_to_not_convert_stay_in_full_precision(quant_checkpoints):
    skip = ["transformer_blocks.0.attn", "proj_out"]
    config = cases.quant_config("int8")
    config.modules_to_not_convert = skip
    model = paradiff.from_pretrained(model_class("flux2"), quant_checkpoints["flux2"], quantization_config=config,
                                     device="cpu")
    reference = model_class("flux2").from_pretrained(quant_checkpoints["flux2"], quantization_config=config,
                                                     torch_dtype=torch.float32)
    held = {name: hasattr(m.weight, "qdata") for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    expected = {name: hasattr(m.weight, "qdata") for name, m in reference.named_modules()
                if isinstance(m, torch.nn.Linear)}
    assert held == expected
    assert not held["proj_out"] and not held["transformer_blocks.0.attn.to_q"] and held["transformer_blocks.0.ff.linear_in"]


def test_pipeline_request_quantizes_the_transformer_shards(pools, tiny_pipeline_folders):
    counts = pools.get(2).run(cases.pipeline_quantized, folder=str(tiny_pipeline_folders["flux2"]))
    assert all(count > 10 for count in counts), counts


@pytest.mark.slow
def test_generate_quantize_reports_each_ranks_quantized_bytes(tmp_path):
    """`paradiff generate --tp 2 --quantize int8` on the embedded demo: each rank reports the quantized linears and
    bytes it holds: as many linears as diffusers' own single-process int8 transformer, about half its bytes."""
    import json
    import subprocess
    import sys

    import diffusers

    from paradiff.demo import pipeline_path
    from paradiff.quant.apply import quantization_summary
    from paradiff.quant.schemes import model_config_for

    out = tmp_path / "tp2"
    result = subprocess.run([sys.executable, "-m", "paradiff.cli", "generate", "--tp", "2", "--prompt", "a cat",
                             "--height", "32", "--width", "32", "--steps", "2", "--quantize", "int8",
                             "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    split = json.loads((out / "report.json").read_text())
    assert split["config"]["quantize"] == "int8"
    folder = pipeline_path()
    _, class_name = json.loads((folder / "model_index.json").read_text())["transformer"]
    whole = getattr(diffusers, class_name).from_pretrained(
        folder / "transformer", quantization_config=model_config_for("int8", torch.float32), torch_dtype=torch.float32)
    single = quantization_summary(whole)
    assert single["quantized_linears"] > 0
    for rank in split["ranks"]:
        held = rank["quantization"]["transformer"]
        assert held["scheme"] == "int8" and held["quantized_linears"] == single["quantized_linears"]
        assert held["quantized_bytes"] < 0.75 * single["quantized_bytes"], (held, single)
    assert (out / split["images"]["0"]).exists() or split["images"]["0"]


def test_quantize_with_stages_is_one_line_and_non_zero(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "paradiff.cli", "generate", "--quantize", "nf4", "--stages",
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--quantize nf4 with --stages" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


MIB = 2**20
LOAD_CONSTANT = 8 * MIB  # the process groups, the meta model, Python objects: what a load adds besides weights


@pytest.fixture(scope="module")
def deep_checkpoint(tmp_path_factory) -> str:
    """A Flux2 deep enough (6 double + 12 single blocks, 20M parameters, 80 MB in fp32) that a rank's fp32 share is
    several times its quantized share plus one weight's slice."""
    torch.manual_seed(5)
    config = {**tiny_config("flux2", head_dim=64, layers=6, single_layers=12), **BLOCK_WIDE["flux2"]}
    model = model_class("flux2")(**config).eval()
    return str(save_model(model, tmp_path_factory.mktemp("quant-deep")))


def test_load_peak_grows_by_the_quantized_share_not_the_full_precision_one(pools, deep_checkpoint):
    """tp2 int8 (column slices: extrema pass, then the quantizing read) and nf4: each rank's peak memory growth
    during the load is at most what it holds after it (quantized weights and scales, other parameters) plus the
    largest slice of one weight, twice (read, then quantized), and a small constant. Its fp32 share would not fit."""
    with Checkpoint(deep_checkpoint) as checkpoint:
        full = sum(info.nbytes for info in checkpoint.tensors.values())
    per_rank = pools.get(2).run(cases.load_memory, family="flux2", folder=deep_checkpoint, schemes=["int8", "nf4"])
    for rank, results in enumerate(per_rank):
        for result in results:
            where = f"rank {rank} {result['scheme']}: " + ", ".join(
                f"{key} {value / MIB:.1f} MiB" for key, value in result.items() if key.endswith(("bytes", "growth",
                                                                                                  "read")))
            held = result["quantized_bytes"] + result["other_bytes"]
            limit = held + 2 * result["largest_read"] + LOAD_CONSTANT
            assert result["quantized_linears"] > 50, where
            assert result["growth"] <= limit, where
            assert 0.5 * full > limit + 4 * MIB, where  # a rank's fp32 share, held before quantizing, would not fit
        reads = {result["scheme"]: result["read_bytes"] for result in results}
        assert reads["nf4"] <= 0.52 * full, reads  # its share, once (plus the small replicated tensors)
        assert reads["nf4"] < reads["int8"] <= 0.52 * full + 0.5 * reads["nf4"], reads  # column slices read twice


@pytest.fixture(scope="module")
def saved_checkpoints(tmp_path_factory) -> dict[tuple[str, str], str]:
    """(family, kind) -> a pre-quantized folder, as diffusers saves it: bitsandbytes nf4, nf4 / fp4 with double
    quantization (written on CPU by paradiff.testing.quant), torchao int8 / fp8 (diffusers' own save)."""
    from diffusers import BitsAndBytesConfig

    from paradiff.testing.quant import save_bnb_4bit

    folders = {}
    kinds = {"flux2": ("bnb-nf4", "bnb-fp4-double", "torchao-int8", "torchao-fp8"),
             "wan": ("bnb-nf4-double", "torchao-int8")}
    for family in FAMILIES:
        model = block_wide_model(family)
        plain = save_model(model, tmp_path_factory.mktemp(f"plain-{family}"))
        for kind in kinds[family]:
            if not kind.startswith("bnb"):
                continue
            config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind.split("-")[1],
                                        bnb_4bit_use_double_quant=kind.endswith("double"),
                                        bnb_4bit_compute_dtype=torch.float32)
            folders[family, kind] = str(save_bnb_4bit(model, tmp_path_factory.mktemp(f"{kind}-{family}"), config))
        for scheme in [kind.split("-")[1] for kind in kinds[family] if kind.startswith("torchao")]:
            quantized = model_class(family).from_pretrained(plain, quantization_config=cases.quant_config(scheme),
                                                            torch_dtype=torch.float32)
            folder = tmp_path_factory.mktemp(f"ao-{scheme}-{family}")
            quantized.save_pretrained(folder)
            folders[family, f"torchao-{scheme}"] = str(folder)
    return folders


def _weights_bytes(folder: str) -> int:
    with Checkpoint(folder) as checkpoint:
        return sum(info.nbytes for info in checkpoint.tensors.values())


def test_pre_quantized_checkpoints_are_sliced_on_read(pools, saved_checkpoints):
    """bitsandbytes 4-bit (nf4; nf4 and fp4 with double quantization) and torchao int8 / fp8 checkpoints saved by
    diffusers: each tp2 rank reads about half the file and holds the slices of what diffusers' single-device model
    holds (bnb: packed codes and absmax; torchao: data and scales); paradiff's single process holds exactly that
    model's tensors; outputs within 1e-5 (single process: bit-equal). ulysses2 holds the whole weights."""
    runs = [dict(family="flux2", kind=kind, mode="tp2") for kind in
            ("bnb-nf4", "bnb-fp4-double", "torchao-int8", "torchao-fp8")]
    runs += [dict(family="wan", kind=kind, mode="tp2") for kind in ("bnb-nf4-double", "torchao-int8")]
    runs += [dict(family="flux2", kind="bnb-fp4-double", mode="ulysses2")]
    for run in runs:
        run["folder"] = saved_checkpoints[run["family"], run["kind"]]
    per_rank = pools.get(2).run(cases.saved_equivalence, cases=runs, timeout_s=600)
    for rank, results in enumerate(per_rank):
        for run, result in zip(runs, results):
            where = f"rank {rank} {result}"
            assert result["checked"] > 10, where
            assert result["relative_diff"] <= RELATIVE_TOLERANCE and result["single_diff"] == 0.0, where
            share = result["read_bytes"] / _weights_bytes(run["folder"])
            if run["mode"] == "tp2":
                assert result["split"] > 10 and share <= 0.56, (where, share)
            else:
                assert result["split"] == 0 and share >= 0.99, (where, share)


@pytest.fixture
def only_quant_state_records(monkeypatch):
    """Reading a weight fails the test; the small bitsandbytes quant-state records (read while checking) pass."""
    original = Checkpoint.read

    def read(self, name, *args, **kwargs):
        if ".quant_state.bitsandbytes__" not in name:
            raise AssertionError(f"weight {name!r} was read before the checkpoint was checked")
        return original(self, name, *args, **kwargs)

    monkeypatch.setattr(Checkpoint, "read", read)


def _rewritten(source: str, target, config_change=None, metadata_change=None):
    """A copy of a pre-quantized folder with its config.json's quantization_config or its file metadata changed."""
    import json
    import shutil

    import safetensors
    import safetensors.torch

    shutil.copytree(source, target)
    if config_change is not None:
        record = json.loads((target / "config.json").read_text())
        config_change(record["quantization_config"])
        (target / "config.json").write_text(json.dumps(record))
    if metadata_change is not None:
        path = target / "diffusion_pytorch_model.safetensors"
        with safetensors.safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata())
        tensors = safetensors.torch.load_file(str(path))
        metadata_change(metadata)
        safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    return str(target)


def test_pre_quantized_checkpoints_paradiff_cannot_slice_are_refused_by_tensor_and_type(
        saved_checkpoints, tmp_path, only_quant_state_records):
    import json

    cls = model_class("flux2")
    bnb8 = _rewritten(saved_checkpoints["flux2", "bnb-nf4"], tmp_path / "bnb8",
                      config_change=lambda q: q.update(load_in_4bit=False, load_in_8bit=True))

    def int4(metadata):
        record = json.loads(metadata["transformer_blocks.0.attn.to_q.weight"])
        metadata["transformer_blocks.0.attn.to_q.weight"] = json.dumps({**record, "_type": "Int4Tensor"})

    torchao_int4 = _rewritten(saved_checkpoints["flux2", "torchao-int8"], tmp_path / "int4", metadata_change=int4)
    cases_ = [
        (bnb8, CheckpointError, ["bitsandbytes 8-bit", "tensor 'context_embedder.weight', torch.uint8",
                                 "cannot slice"]),
        (torchao_int4, CheckpointError, ["'transformer_blocks.0.attn.to_q.weight'", "torchao Int4Tensor",
                                         "cannot slice", "Int8Tensor / Float8Tensor"]),
    ]
    for folder, error, fragments in cases_:
        with pytest.raises(error) as caught:
            paradiff.from_pretrained(cls, folder, device="cpu")
        assert all(fragment in str(caught.value) for fragment in fragments), str(caught.value)
    with pytest.raises(ParallelConfigError) as caught:  # quantizing a quantized checkpoint again: refused
        paradiff.from_pretrained(cls, saved_checkpoints["flux2", "bnb-nf4"], device="cpu",
                                 quantization_config=cases.quant_config("int8"))
    assert "saved quantized (bitsandbytes" in str(caught.value) and "drop quantization_config" in str(caught.value)


def test_pre_quantized_slice_cutting_a_block_is_refused_by_name_before_any_read(pools, tmp_path):
    from diffusers import BitsAndBytesConfig

    from paradiff.testing.quant import save_bnb_4bit

    folder = save_bnb_4bit(build_model("flux2", seed=3, head_dim=16), tmp_path / "narrow",
                           BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    errors = pools.get(2).run(cases.refused_before_read, family="flux2", folder=str(folder), scheme=None, mode="tp2")
    for error in errors:  # every rank raises, none hangs
        assert error.startswith("PlanError") and "bitsandbytes 4-bit in blocks of 64" in error, error
        assert "would cut a block" in error and "tp_degree" in error, error
