"""Quantize on read (docs/quantization.md): each rank quantizes the slice it reads, and every quantized shard equals
the slice of the single-device quantized tensor (data and scales); outputs match the quantized single process."""

from __future__ import annotations

import pytest
import torch
from diffusers import BitsAndBytesConfig, GGUFQuantizationConfig, TorchAoConfig

import paradiff
from paradiff.errors import ParallelConfigError
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


@pytest.fixture(scope="module")
def block_wide_encoders(tmp_path_factory) -> dict[str, str]:
    from paradiff.testing.encoders import BLOCK_WIDE_ENCODERS, save_encoder

    root = tmp_path_factory.mktemp("quant-encoders")
    return {name: str(save_encoder(name, root / name, block_wide=True)) for name in BLOCK_WIDE_ENCODERS}


def test_text_encoders_split_by_tp_are_slices_of_transformers_quantized_load(pools, block_wide_encoders):
    """FLUX.2's Mistral-3, Qwen-Image's Qwen2.5-VL and Wan's UMT5 at tp2, 4-bit (NF4) and int8 (fp8 for Mistral):
    each shard is the slice of transformers' own quantized load, transformers' kept linears stay full precision, and
    the outputs match transformers' quantized single-process model."""
    schemes = {name: ["nf4", "int8"] for name in block_wide_encoders}
    schemes["Mistral3ForConditionalGeneration"].append("fp8")
    per_rank = pools.get(2).run(cases.text_encoders_quantized, folders=block_wide_encoders, schemes=schemes, tp=2,
                                timeout_s=600)
    kept = {"Mistral3ForConditionalGeneration": ["lm_head"], "Qwen2_5_VLForConditionalGeneration": ["lm_head"]}
    for results in per_rank:
        assert len(results) == sum(len(s) for s in schemes.values())
        for result in results:
            where = (result["rank"], result["encoder"], result["scheme"])
            assert result["quantized"] >= 12 and result["column_split"] >= 2, (where, result)
            assert result["diff"] <= RELATIVE_TOLERANCE, (where, result["diff"])
            if result["encoder"] == "UMT5EncoderModel":
                # T5 keeps `wo` in fp32: transformers' bitsandbytes rule matches the module name's suffix and leaves
                # it unquantized; its torchao rule matches the parameter's name ("...wo.weight") and quantizes it
                wo = [name for name in result["kept"] if name.endswith(".wo")]
                assert result["kept"] == wo and len(wo) == (2 if result["scheme"] == "nf4" else 0), (where, result)
            else:
                assert result["kept"] == kept[result["encoder"]], (where, result)


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
            replica = paradiff.ParallelConfig.from_mode(result["mode"])
            ranks_per_replica = replica.world_size // replica.data_degree
            assert result["split_vae"] == (ranks_per_replica > 1), where  # the split VAE beside the quantized models
            if replica.tp_degree > 1:  # the shards really are split (the text encoder over the TP ranks too)
                assert all(count > 0 for count in result["split"].values()), (where, result["split"])
            elif "ulysses" in result["mode"] and "text_encoder" in result["split"]:  # split over the CP ranks
                assert result["split"]["text_encoder"] > 0, (where, result["split"])


def test_quantized_pipelines_in_every_mode_on_two_ranks(pools, tiny_pipeline_folders):
    """FLUX.2 (Mistral-3), Qwen-Image (Qwen2.5-VL), Wan (UMT5) and Lumina 2 (grouped-query attention, Gemma 2):
    transformer and text encoder quantized on read at tp2 (staged: re-read and re-quantized at each stage), cfg2,
    ulysses2 (the encoder split over the CP ranks), dp2, and NF4 under stages (bitsandbytes' layers re-quantized in
    place): shards and images equal the single-process quantized pipeline's."""
    runs = [
        dict(family="flux2", mode="tp2", stages=True, schemes=BOTH),
        dict(family="qwenimage", mode="cfg2", stages=False, schemes={"transformer": "fp8", "text_encoder": "fp8"}),
        dict(family="wan", mode="ulysses2", stages=False, schemes=BOTH),
        dict(family="lumina2", mode="tp2", stages=False, schemes=BOTH),
        dict(family="lumina2", mode="dp2", stages=True, schemes=BOTH),
        dict(family="flux2", mode="ulysses2", stages=True, schemes={"transformer": "nf4"}),
    ]
    folders = {run["family"]: str(tiny_pipeline_folders[run["family"]]) for run in runs}
    check_pipeline_modes(pools.get(2).run(cases.pipeline_modes, folders=folders, runs=runs, timeout_s=900), runs)


def test_quantized_pipelines_at_tp3_and_tp2_x_ulysses2(pools, tiny_pipeline_folders):
    """tp3 (4 heads split 2 / 1 / 1) and tp2 x ulysses2 on 4 ranks, staged."""
    folders = {family: str(tiny_pipeline_folders[family]) for family in ("flux2", "qwenimage")}
    runs3 = [dict(family="flux2", mode="tp3", stages=False, schemes=BOTH)]
    runs4 = [dict(family="qwenimage", mode="tp2xulysses2", stages=True, schemes=BOTH)]
    check_pipeline_modes(pools.get(3).run(cases.pipeline_modes, folders=folders, runs=runs3, timeout_s=900), runs3)
    check_pipeline_modes(pools.get(4).run(cases.pipeline_modes, folders=folders, runs=runs4, timeout_s=900), runs4)
