"""Quantize on read (docs/quantization.md): each rank quantizes the slice it reads, and every quantized shard equals
the slice of the single-device quantized tensor (data and scales); outputs match the quantized single process."""

from __future__ import annotations

import pytest
import torch
from diffusers import BitsAndBytesConfig, GGUFQuantizationConfig, TorchAoConfig

import paradiff
from paradiff.errors import CheckpointError, ParallelConfigError
from paradiff.io.checkpoint import Checkpoint
from paradiff_testkit.lora import TARGETS
from paradiff.testing.models import build_model, model_class, save_model, tiny_config

import rank_cases_quant as cases
from paradiff_testkit import command

FAMILIES = ("flux2", "wan")
SCHEMES = ("int8", "fp8", "nf4")
MODES = ("tp2", "ulysses2")
# Split against whole, both computing float32 products (NF4 too: quant.apply.float32_4bit_products): they differ by
# summation order only (a row split's all-reduce adds partial sums in another order). Measured on the text encoders'
# case: 5.6e-7 (Mistral-3 NF4) to 1.5e-6 (UMT5 NF4) on an Intel Xeon with AMX and AVX512-BF16 (2026-12-07), within
# it on AMD EPYC (AVX2) in every run. bitsandbytes' own bf16 CPU kernel, which that Intel CPU would take, is 8.5e-3
# (Mistral-3) to 2.6e-2 (UMT5) from the float32 product: a tolerance that let it pass would hide a kernel change.
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
        assert error.startswith("BlockSplitError"), error  # a PlanError
        assert "would cut a block" in error and "llm_int8_skip_modules" in error, error
        assert "attn.to_out.0" in error or "attn.to_add_out" in error or "ff" in error, error


def test_pipeline_requests_refused_on_every_rank_before_any_read(pools, tiny_pipeline_folders):
    """At tp2, a mapping mixing int8 (transformer) with bitsandbytes 8-bit (text encoder), and NF4 on the tiny
    FLUX.2's Mistral-3 (32 wide: its rowwise slices of 16 columns would cut 64-element blocks): every rank raises the
    same one error, naming the component or the layer, and none hangs."""
    per_rank = pools.get(2).run(cases.pipeline_requests_refused, folder=str(tiny_pipeline_folders["flux2"]),
                                mode="tp2")
    assert per_rank[0][0] == per_rank[1][0]
    for mixed, cut in per_rank:  # the cut names each rank's own columns
        assert mixed.startswith("ParallelConfigError") and "'text_encoder' (Mistral3ForConditionalGeneration)" \
            in mixed and "load_in_8bit=True" in mixed, mixed
        assert cut.startswith("BlockSplitError") and "language_model.layers.0.self_attn.o_proj" in cut \
            and "would cut a block" in cut, cut


def test_unknown_scheme_names_the_valid_ones():
    from paradiff.quant.schemes import pipeline_quantization_config

    with pytest.raises(ParallelConfigError, match=r"unknown quantization scheme 'int4'.*\['int8', 'fp8', 'nf4'\]"):
        pipeline_quantization_config("int4", components=("transformer", "text_encoder"))


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


@pytest.mark.slow
def test_generate_quantize_reports_each_ranks_quantized_bytes(tmp_path):
    """`paradiff generate --tp 2 --quantize int8 --quantize-text-encoders --stages` on the embedded demo: each rank
    reports, per component, the scheme, the quantized linears and bytes and the full-precision bytes it held while
    its stage ran (re-read and re-quantized at the stage): as many linears as diffusers' / transformers' own
    single-process int8 models, about half their bytes; the per-stage table prints them."""
    import json

    import diffusers
    import transformers

    from paradiff.demo import pipeline_path
    from paradiff.quant.apply import quantization_summary
    from paradiff.quant.schemes import model_config_for, text_encoder_config_for

    out = tmp_path / "tp2"
    result = command.run(["-m", "paradiff.cli", "generate", "--tp", "2", "--prompt", "a cat",
                          "--height", "32", "--width", "32", "--steps", "2", "--quantize", "int8",
                          "--quantize-text-encoders", "--stages", "--out", str(out)], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    split = json.loads((out / "report.json").read_text())
    assert split["config"]["quantize"] == "int8" and split["config"]["quantize_text_encoders"]
    folder = pipeline_path()
    index = json.loads((folder / "model_index.json").read_text())
    single = {
        "transformer": quantization_summary(getattr(diffusers, index["transformer"][1]).from_pretrained(
            folder / "transformer", quantization_config=model_config_for("int8", torch.float32),
            torch_dtype=torch.float32)),
        "text_encoder": quantization_summary(getattr(transformers, index["text_encoder"][1]).from_pretrained(
            folder / "text_encoder", quantization_config=text_encoder_config_for("int8"), dtype=torch.float32)),
    }
    for rank in split["ranks"]:
        for name, whole in single.items():
            held = rank["quantization"][name]
            assert whole["quantized_linears"] > 0, (name, whole)
            assert held["scheme"] == "int8" and held["quantized_linears"] == whole["quantized_linears"], (name, held)
            assert held["quantized_bytes"] < 0.75 * whole["quantized_bytes"], (name, held, whole)
            assert 0 < held["full_precision_bytes"] <= whole["full_precision_bytes"], (name, held, whole)
        assert rank["quantization"]["vae"]["scheme"] is None and rank["quantization"]["vae"]["quantized_bytes"] == 0
        stages = {stage["stage"]: stage for stage in rank["stages"]}
        assert stages["transformer"]["quantized_bytes"] == rank["quantization"]["transformer"]["quantized_bytes"]
        assert stages["text_encoders"]["components"]["text_encoder"]["scheme"] == "int8"
    assert "quant MiB" in result.stdout and "transformer=int8" in result.stdout and "text_encoder=int8" in result.stdout
    assert (out / split["images"]["0"]).exists() or split["images"]["0"]


def test_quantize_text_encoders_without_a_scheme_is_one_line_and_non_zero(tmp_path):
    result = command.run(["-m", "paradiff.cli", "generate", "--quantize-text-encoders", "--out", str(tmp_path / "out")],
                         timeout=120)
    assert result.returncode == 2 and "--quantize-text-encoders" in result.stderr and "--quantize int8|fp8|nf4" \
        in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.fixture(scope="module")
def block_wide_encoders(tmp_path_factory) -> dict[str, str]:
    from paradiff_testkit.encoders import BLOCK_WIDE_ENCODERS, save_encoder

    root = tmp_path_factory.mktemp("quant-encoders")
    return {name: str(save_encoder(name, root / name, block_wide=True)) for name in BLOCK_WIDE_ENCODERS}


def test_text_encoders_split_by_tp_are_slices_of_transformers_quantized_load(pools, block_wide_encoders):
    """FLUX.2's Mistral-3, Qwen-Image's Qwen2.5-VL and Wan's UMT5 at tp2, 4-bit (NF4), and UMT5 in int8 too (the
    two libraries' rules differ there): each shard is the slice of transformers' own quantized load, transformers'
    kept linears stay full precision, and the outputs match transformers' quantized single-process model. (int8 and
    fp8 text encoders run in the pipeline tests below.)"""
    schemes = {name: ["nf4"] for name in block_wide_encoders}
    schemes["UMT5EncoderModel"].append("int8")
    per_rank = pools.get(2).run(cases.text_encoders_quantized, folders=block_wide_encoders, schemes=schemes, tp=2,
                                timeout_s=600)
    kept = {"Mistral3ForConditionalGeneration": ["lm_head"], "Qwen2_5_VLForConditionalGeneration": ["lm_head"]}
    for results in per_rank:
        assert len(results) == sum(len(s) for s in schemes.values())
        for result in results:
            where = (result["rank"], result["encoder"], result["scheme"])
            assert result["quantized"] >= 12 and result["column_split"] >= 2, (where, result)
            assert result["diff"] <= RELATIVE_TOLERANCE, (where, result["diff"])
            # loaded as on an AVX512-BF16 CPU: no Linear4bit takes bitsandbytes' bf16 kernel (rank_cases_quant)
            assert result["bf16_linears"] == [], (where, result["bf16_linears"])
            assert set(result["float32_precision"].values()) <= cases.FULL_FLOAT32, (where, result["float32_precision"])
            if result["encoder"] == "UMT5EncoderModel":
                # T5 keeps `wo` in fp32: transformers' bitsandbytes rule matches the module name's suffix and leaves
                # it unquantized; its torchao rule matches the parameter's name ("...wo.weight") and quantizes it
                wo = [name for name in result["kept"] if name.endswith(".wo")]
                assert result["kept"] == wo and len(wo) == (2 if result["scheme"] == "nf4" else 0), (where, result)
            else:
                assert result["kept"] == kept[result["encoder"]], (where, result)


def test_float32_products_stay_full_precision_once_every_library_is_imported():
    """No library the suite and the product import (diffusers, transformers, torchao, bitsandbytes, peft) turns on
    torch's reduced-precision float32 products, which oneDNN would run as bf16 on an AMX CPU: the rank processes check
    the same in the text-encoder case above."""
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import torchao  # noqa: F401
    import transformers  # noqa: F401

    import paradiff.quant.apply  # noqa: F401

    assert set(cases.float32_precision().values()) <= cases.FULL_FLOAT32, cases.float32_precision()


PIXEL_TOLERANCE = 1e-5  # absolute, on pixel values in [0, 1]
BOTH = {"transformer": "int8", "text_encoder": "int8"}


def check_pipeline_modes(per_rank: list[list[dict]], runs: list[dict]) -> None:
    for results in per_rank:
        assert len(results) == len(runs)
        for result in results:
            where = (result["rank"], result["family"], result["mode"], result["stages"])
            assert result["image"] <= PIXEL_TOLERANCE, (where, result["image"])
            assert all(count > 5 for count in result["checked"].values()), (where, result["checked"])
            assert result["stage_names"] == ["text_encoders", "transformer", "vae"], where
            for name, scheme in result["schemes"].items():  # pipeline.quantization_report(): what this rank held
                reported = result["reported"][name]
                assert reported["scheme"] == scheme and reported["quantized_linears"] == result["checked"][name], where
                assert reported["quantized_bytes"] == result["held_bytes"][name] > 0, (where, name, reported)
                assert reported["full_precision_bytes"] > 0, (where, name, reported)
            replica = paradiff.ParallelConfig.from_mode(result["mode"])
            ranks_per_replica = replica.world_size // replica.data_degree
            assert result["split_vae"] == (ranks_per_replica > 1), where  # the split VAE beside the quantized models
            if replica.tp_degree > 1:  # the shards really are split (the text encoder over the TP ranks too)
                assert all(count > 0 for count in result["split"].values()), (where, result["split"])
            elif "ulysses" in result["mode"] and "text_encoder" in result["split"]:  # split over the CP ranks
                assert result["split"]["text_encoder"] > 0, (where, result["split"])


PIPELINE_RUNS = {
    2: [dict(family="flux2", mode="tp2", stages=True, schemes=BOTH),
        dict(family="wan", mode="cfg2", stages=False, schemes={"transformer": "fp8", "text_encoder": "fp8"}),
        dict(family="qwenimage", mode="ulysses2", stages=False, schemes=BOTH),
        dict(family="lumina2", mode="dp2", stages=False, schemes=BOTH),
        dict(family="flux2", mode="ulysses2", stages=True, schemes={"transformer": "nf4"})],
    4: [dict(family="lumina2", mode="tp2xulysses2", stages=True, schemes=BOTH)],
}


@pytest.fixture(scope="module")
def pipeline_references(tiny_pipeline_folders) -> dict[str, dict]:
    """The single-process quantized pipelines every mode is compared with, computed once here for all ranks."""
    references = {}
    for run in (run for runs in PIPELINE_RUNS.values() for run in runs):
        key = cases.pipeline_reference_key(run["family"], run["schemes"])
        if key not in references:
            references[key] = cases.quantized_pipeline_reference(
                run["family"], str(tiny_pipeline_folders[run["family"]]), run["schemes"])
    return references


def run_pipeline_modes(pools, tiny_pipeline_folders, references, world_size: int) -> None:
    runs = PIPELINE_RUNS[world_size]
    folders = {run["family"]: str(tiny_pipeline_folders[run["family"]]) for run in runs}
    needed = {key: references[key] for key in (cases.pipeline_reference_key(r["family"], r["schemes"]) for r in runs)}
    check_pipeline_modes(pools.get(world_size).run(cases.pipeline_modes, folders=folders, runs=runs,
                                                   references=needed, timeout_s=900), runs)


def test_quantized_pipelines_in_every_mode_on_two_ranks(pools, tiny_pipeline_folders, pipeline_references):
    """FLUX.2 (Mistral-3) at tp2 staged (re-read and re-quantized at each stage), Wan (UMT5) at cfg2 in fp8, Qwen-Image
    (Qwen2.5-VL) at ulysses2 (the encoder split over the CP ranks), Lumina 2 at dp2, FLUX.2 at ulysses2 staged in
    NF4 (bitsandbytes' whole layers re-quantized in place, under CP's gather hook): transformer and text encoder
    quantized on read; shards and images equal the single-process quantized pipeline's."""
    run_pipeline_modes(pools, tiny_pipeline_folders, pipeline_references, 2)


def test_quantized_pipeline_at_tp2_x_ulysses2(pools, tiny_pipeline_folders, pipeline_references):
    """Lumina 2 (grouped-query attention, Gemma 2) at tp2 x ulysses2 on 4 ranks, staged."""
    run_pipeline_modes(pools, tiny_pipeline_folders, pipeline_references, 4)


def test_tp3_shards_with_uneven_heads(pools, quant_checkpoints):
    """Flux2 at tp3: its 4 heads of 64 split 2 / 1 / 1 and its 128-wide inputs 43 / 43 / 42, so int8 and fp8 rowwise
    slices take whole-row scales from unequal column ranges; shards and outputs as at tp2. (NF4 is refused there:
    43 columns cut a block; FLUX.2-dev's widths split on blocks at tp3.)"""
    runs = [dict(family="flux2", folder=quant_checkpoints["flux2"], scheme=scheme, mode="tp3")
            for scheme in ("int8", "fp8")]
    per_rank = pools.get(3).run(cases.quantized_equivalence, cases=runs, timeout_s=600)
    widths = set()
    for results in per_rank:
        for result in results:
            assert result["quantized"] > 10 and result["column_split"] > 0, result
            assert result["relative_diff"] <= RELATIVE_TOLERANCE, result
            widths.add((result["scheme"], result["local_quantized_bytes"]))
    assert len(widths) > 2, widths  # the ranks' shares differ: the split is uneven


@pytest.fixture(scope="module")
def flux2_lora(quant_checkpoints, tmp_path_factory) -> str:
    from paradiff_testkit.lora import random_lora, save_lora

    model = model_class("flux2").from_pretrained(quant_checkpoints["flux2"])
    path = tmp_path_factory.mktemp("quant-lora") / "lora.safetensors"
    return str(save_lora(path, random_lora(model, TARGETS["flux2"], rank=4, seed=5), rank=4, alpha=8.0))


def test_lora_unfused_on_quantized_shards(pools, quant_checkpoints, flux2_lora):
    """QLoRA style on Flux2 at tp2, int8 and NF4: colwise, rowwise and whole quantized bases carry the adapter
    unfused; outputs equal the single-process quantized model with the same adapter (and without it once disabled);
    fuse_lora is refused by name on every rank and leaves the model as it was."""
    per_rank = pools.get(2).run(cases.quantized_lora, folder=quant_checkpoints["flux2"], lora=flux2_lora,
                                schemes=["int8", "nf4"], modes=["tp2"], timeout_s=600)
    for results in per_rank:
        assert len(results) == 2
        for result in results:
            where = (result["rank"], result["scheme"], result["mode"])
            assert result["changed"] > 0.05, where  # the adapter matters
            assert all(diff <= RELATIVE_TOLERANCE for diff in result["diffs"].values()), (where, result["diffs"])
            assert result["quantized_bases"] == len(TARGETS["flux2"]), (where, result)
            if result["mode"] == "tp2":
                assert result["colwise"] >= 3 and result["rowwise"] >= 3, (where, result)
            assert result["refusal"].startswith("fuse_lora:") and "quantized" in result["refusal"], where


def test_compiled_quantized_shards(pools, quant_checkpoints):
    """paradiff.compile (aot_eager, fullgraph blocks) of a tp2 Flux2 quantized int8 (torchao's tensor subclass) and
    NF4 (bitsandbytes' 4-bit product): no graph break inside a block, outputs equal the eager quantized model."""
    per_rank = pools.get(2).run(cases.compiled_quantized, folder=quant_checkpoints["flux2"], schemes=["int8", "nf4"],
                                mode="tp2", timeout_s=600)
    for results in per_rank:
        assert [r["scheme"] for r in results] == ["int8", "nf4"]
        for result in results:
            assert result["compiled_blocks"] == 2, result
            assert result["diff"] <= RELATIVE_TOLERANCE, result


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


@pytest.mark.slow
def test_load_peak_grows_by_the_quantized_share_not_the_full_precision_one(deep_checkpoint):
    """tp2 int8 (column slices: extrema pass, then the quantizing read) and nf4: each rank's peak memory growth
    during the load is at most what it holds after it (quantized weights and scales, other parameters) plus the
    largest slice of one weight, twice (read, then quantized), and a small constant. Its fp32 share would not fit.
    Fresh ranks, not the shared pool: a pool process that ran the cases above grows by up to 27 MiB more here."""
    from paradiff.distributed.spawn import run_ranks

    with Checkpoint(deep_checkpoint) as checkpoint:
        full = sum(info.nbytes for info in checkpoint.tensors.values())
    per_rank = run_ranks(cases.load_memory_fresh, 2, timeout_s=600, gloo_timeout_s=300,
                         kwargs=dict(family="flux2", folder=deep_checkpoint, schemes=["int8", "nf4"]))
    for rank, results in enumerate(per_rank):
        for result in results:
            where = f"rank {rank} {result['scheme']}: " + ", ".join(
                f"{key} {value / MIB:.1f} MiB" for key, value in result.items() if key.endswith(("bytes", "growth",
                                                                                                  "read")))
            held = result["quantized_bytes"] + result["full_precision_bytes"]
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
    quantization (written on CPU by paradiff_testkit.quant), torchao int8 / fp8 (diffusers' own save)."""
    from diffusers import BitsAndBytesConfig

    from paradiff_testkit.quant import save_bnb_4bit

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

    from paradiff_testkit.quant import save_bnb_4bit

    folder = save_bnb_4bit(build_model("flux2", seed=3, head_dim=16), tmp_path / "narrow",
                           BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    errors = pools.get(2).run(cases.refused_before_read, family="flux2", folder=str(folder), scheme=None, mode="tp2")
    for error in errors:  # every rank raises, none hangs
        assert error.startswith("PlanError") and "bitsandbytes 4-bit in blocks of 64" in error, error
        assert "would cut a block" in error and "tp_degree" in error, error


@pytest.fixture(scope="module")
def saved_pipelines(tiny_pipeline_folders, tmp_path_factory) -> dict[str, str]:
    """kind -> the tiny FLUX.2 pipeline with its transformer saved quantized (torchao int8 by diffusers' own save;
    bitsandbytes NF4 with double quantization as diffusers writes it)."""
    import shutil

    from paradiff_testkit.quant import save_bnb_4bit

    source = tiny_pipeline_folders["flux2"]
    transformer = model_class("flux2").from_pretrained(source / "transformer")
    folders = {}
    for kind in ("torchao-int8", "bnb-nf4-double"):
        folder = tmp_path_factory.mktemp(f"saved-pipeline-{kind}")
        shutil.copytree(source, folder, dirs_exist_ok=True)
        shutil.rmtree(folder / "transformer")
        if kind == "torchao-int8":
            model_class("flux2").from_pretrained(source / "transformer", quantization_config=cases.quant_config("int8"),
                                                 torch_dtype=torch.float32).save_pretrained(folder / "transformer")
        else:
            save_bnb_4bit(transformer, folder / "transformer", BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.float32))
        folders[kind] = str(folder)
    return folders


def test_pre_quantized_transformer_in_a_staged_pipeline(pools, saved_pipelines):
    """A pipeline folder whose transformer was saved quantized, loaded with stages=True on two ranks (torchao int8 at
    tp2: its stored rows / columns read again at the transformer's stage; NF4 double-quantized at ulysses2): the
    images equal the single-process resident pipeline's, and the transformer holds the saved scheme at its stage."""
    references = {kind: cases.saved_pipeline_image(folder)["image"] for kind, folder in saved_pipelines.items()}
    runs = [dict(kind="torchao-int8", folder=saved_pipelines["torchao-int8"], mode="tp2"),
            dict(kind="bnb-nf4-double", folder=saved_pipelines["bnb-nf4-double"], mode="ulysses2")]
    per_rank = pools.get(2).run(cases.saved_pipelines_staged, runs=runs, references=references, timeout_s=600)
    for results in per_rank:
        assert [r["kind"] for r in results] == ["torchao-int8", "bnb-nf4-double"]
        for result in results:
            scheme = "int8" if result["kind"] == "torchao-int8" else "nf4"
            assert result["image"] <= PIXEL_TOLERANCE, result
            assert result["transformer"]["scheme"] == scheme, result
            assert result["transformer"]["quantized_linears"] > 10, result
            assert (result["split"] > 10) == (result["mode"] == "tp2"), result


def test_compare_reference_computes_bitsandbytes_4bit_in_float32_as_paradiff_does(monkeypatch):
    """`--compare --quantize`'s reference (diffusers' quantized load) multiplies NF4 as paradiff does on every CPU,
    not with bitsandbytes' bf16 kernel where the CPU has AVX512-BF16 (quant.apply.float32_4bit_products)."""
    import bitsandbytes as bnb
    from diffusers import DiffusionPipeline

    from paradiff.cli.compare import single_process_pipeline

    with monkeypatch.context() as patched:
        patched.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)  # built as on such a CPU
        encoder = torch.nn.Sequential(bnb.nn.Linear4bit(64, 64, quant_type="nf4"))
    assert encoder[0].support_avx512bf16_for_cpu

    class Loaded:
        components = {"text_encoder": encoder, "scheduler": object()}

    monkeypatch.setattr(DiffusionPipeline, "from_pretrained", lambda *args, **kwargs: Loaded())
    single_process_pipeline("folder", torch.float32, quantization=object())
    assert not encoder[0].support_avx512bf16_for_cpu
