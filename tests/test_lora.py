"""LoRA adapters on paradiff models and pipelines: diffusers' own LoRA API, in TP, Ulysses, ring and TP x Ulysses,
against diffusers' LoRA on the unsplit model; on pipelines also split text encoders, CFG, data and staged modes;
each rank holds the slices of the factors; fuse / unfuse exact; bad adapters refused with one typed error. (Every
family's pipeline in every mode: tools/verify_lora.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rank_cases_lora as cases
from paradiff.errors import AdapterError
from paradiff.tensor_parallel.lora import factor_specs
from paradiff.tensor_parallel.plan import TensorParallelPlan, resolve_plan
from paradiff.tensor_parallel.styles import ColwiseHeads, HeadNorm, PackedColwise, ShardSpec
from paradiff_testkit.lora import TARGETS, random_lora, save_kohya_flux_lora, save_lora, save_pipeline_loras
from paradiff.testing.models import FAMILIES, build_model
from paradiff_testkit import command

RTOL = 1e-5
WEIGHTS = {"style": 0.7, "detail": 1.3}
pytest.importorskip("peft")


@pytest.fixture(scope="session")
def lora_files(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """family -> adapter name -> file: 'style' rank 4 alpha 8 on every target (attention, FFN, AdaLN, the top-level
    projection), 'detail' rank 16 alpha 6 on every other target, both in diffusers' format with its metadata."""
    root = tmp_path_factory.mktemp("loras")
    files = {}
    for family in FAMILIES:
        model = build_model(family)
        files[family] = {
            "swap": save_lora(root / family / "swap.safetensors", random_lora(model, TARGETS[family], 4, seed=3),
                              rank=4, alpha=8),
            "style": save_lora(root / family / "style.safetensors", random_lora(model, TARGETS[family], 4, seed=1),
                               rank=4, alpha=8),
            "detail": save_lora(root / family / "detail.safetensors",
                                random_lora(model, TARGETS[family][::2], 16, seed=2), rank=16, alpha=6),
        }
    files["flux"]["kohya"] = save_kohya_flux_lora(root / "flux" / "kohya.safetensors", build_model("flux").config,
                                                  rank=4, alpha=2.0, seed=3)
    return files


def _cases(checkpoints, lora_files, mode: str, families=FAMILIES) -> list[dict]:
    return [dict(family=family, folder=str(checkpoints[(family, "single")]), mode=mode,
                 loras={name: str(lora_files[family][name]) for name in ("style", "detail")}, weights=WEIGHTS,
                 swap=str(lora_files[family]["swap"]))
            for family in families]


def _check(results: list[list[dict]]) -> None:
    for rank_results in results:
        for result in rank_results:
            where = (result["case"]["family"], result["case"]["mode"], result["rank"])
            assert max(result["diffs"].values()) <= RTOL, (where, result["diffs"])
            first = next(iter(result["case"]["loras"]))
            assert result["diffs"][f"only {first}"] <= RTOL and result["diffs"]["mixed"] <= RTOL, where
            assert result["fused_changed"] == result["layers"] > 0, where  # fusing changed every adapted shard
            assert result["unfused_exact"], where
            if result["case"].get("swap"):
                assert result["diffs"]["hotswapped"] <= RTOL, where


def test_tp2_and_cp2_match_diffusers_lora(pools, checkpoints, lora_files):
    """tp2, ulysses2 and ring2 on the four families in one pool run (plus one adapter given as a dict)."""
    batch = _cases(checkpoints, lora_files, "tp2") + _cases(checkpoints, lora_files, "ulysses2")
    batch += _cases(checkpoints, lora_files, "ring2", families=("flux",))
    batch.append(dict(_cases(checkpoints, lora_files, "tp2", families=("qwenimage",))[0], via="dict", swap=None))
    results = pools.get(2).run(cases.lora_cases, timeout_s=900, cases=batch)
    _check(results)
    for result in results[0]:
        case = result["case"]
        if case["mode"] == "tp2":
            assert result["sliced"] > 0  # the factors of every split layer were checked against the full slices
            if case.get("via", "file") == "file":
                # the last adapter loaded: read exactly what the rank keeps, less than the file holds
                assert 0 < result["bytes_read"] == result["local_bytes"] < _tensor_bytes(case["loras"]["detail"])
        else:
            assert result["sliced"] == 0


def _tensor_bytes(path: str) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() * t.element_size() for t in load_file(path).values())


def test_tp2_x_ulysses2_and_unified_match_diffusers_lora(pools, checkpoints, lora_files):
    batch = _cases(checkpoints, lora_files, "tp2xulysses2") + _cases(checkpoints, lora_files, "ring2xulysses2",
                                                                       families=("flux",))
    results = pools.get(4).run(cases.lora_cases, timeout_s=900, cases=batch)
    _check(results)
    assert all((result["sliced"] > 0) == (result["case"]["mode"] == "tp2xulysses2")
               for rank_results in results for result in rank_results)


def test_bad_adapters_are_one_typed_error_and_the_model_still_generates(pools, checkpoints, lora_files, tmp_path):
    good = lora_files["flux"]["style"]
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    model = build_model("flux")
    seed_files = [str(save_lora(tmp_path / f"seed{seed}.safetensors", random_lora(model, TARGETS["flux"], 4, seed=seed),
                                rank=4, alpha=8)) for seed in (10, 11)]
    results = pools.get(2).run(cases.lora_errors, family="flux", folder=str(checkpoints[("flux", "single")]),
                               good=str(good), truncated=str(truncated), seed_files=seed_files)
    for result in results:
        errors, rank = result["errors"], result["rank"]
        assert errors["wrong shape"][0] == "AdapterError" and result["first_key"] in errors["wrong shape"][1]
        assert "needs" in errors["wrong shape"][1]
        assert errors["unknown target"][0] == "AdapterError" and "to_nowhere" in errors["unknown target"][1]
        assert errors["truncated"][0] == "CheckpointError" and "truncated" in errors["truncated"][1]
        assert errors["different files"][0] == "DistributedError"
        assert "ranks disagree on adapter content" in errors["different files"][1]
        if rank == 1:
            assert errors["only rank 1 wrong"][0] == "AdapterError"
        else:
            assert errors["only rank 1 wrong"][0] == "DistributedError"
            assert "rank 1: AdapterError" in errors["only rank 1 wrong"][1]
        assert errors["name in use"][0] == "AdapterError" and "already loaded" in errors["name in use"][1]
        assert result["adapters"] == ["style"]
        assert result["same_output"]


def test_kohya_flux_lora_converted_by_diffusers_matches(pools, checkpoints, lora_files):
    """A kohya `lora_unet_*` file, converted by diffusers' FluxPipeline.lora_state_dict, loaded at tp2 x ulysses2."""
    batch = [dict(family="flux", folder=str(checkpoints[("flux", "single")]), mode=mode, via="kohya",
                  loras={"kohya": str(lora_files["flux"]["kohya"]), "style": str(lora_files["flux"]["style"])},
                  weights={"kohya": 1.0, "style": 0.5}) for mode in ("tp2xulysses2",)]
    _check(pools.get(4).run(cases.lora_cases, timeout_s=600, cases=batch))


@pytest.fixture(scope="module")
def pipeline_loras(tiny_pipeline_folders, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """family -> adapter name -> file (paradiff_testkit.lora.save_pipeline_loras)."""
    root = tmp_path_factory.mktemp("pipeline-loras")
    return {family: save_pipeline_loras(family, tiny_pipeline_folders[family], root / family)
            for family in ("flux", "sd3", "qwenimage", "hunyuanvideo")}


def _pipeline_cases(tiny_pipeline_folders, pipeline_loras, specs) -> list[dict]:
    """One denoising step per call: every check compares the latents with diffusers' after the same steps, and the
    adapters act alike in every transformer call (a second step doubled the pipelines' cost and checked the same
    again). Qwen-Image keeps two: with one step its comparisons came out NaN."""
    cases = []
    for family, mode, names, extra in specs:
        loras = {name: str(pipeline_loras[family][name]) for name in names}
        cases.append(dict(family=family, folder=str(tiny_pipeline_folders[family]), mode=mode, loras=loras,
                          weights=dict(zip(names, (0.7, 1.3))), steps=2 if family == "qwenimage" else 1, **extra))
    return cases


def _check_pipeline(results: list[list[dict]]) -> None:
    for rank_results in results:
        for result in rank_results:
            case = result["case"]
            where = (case["family"], case["mode"], case.get("stages", False), result["rank"])
            assert max(result["diffs"].values()) <= RTOL, (where, result["diffs"])
            assert result["changed"] > 1e-3, where  # the adapters do change the latents
            assert result["active"][0] == result["active"][1], where
            assert result["shards"] > 0 and result["fused_changed"] == result["checked_shards"] > 0, (where, result)
            assert result["unfused_exact"] and result["back_to_base"], where
            assert all(names == sorted(case["loras"]) for names in result["adapters"].values()), (where, result)


# every two-rank pipeline case of the tests below, in one pool run: diffusers' pipeline runs once per folder, adapters
# and prompt (SD3 at tp2 and cfg2; FLUX.1 at tp2, tp2 staged and rank 0 of dp2 share theirs); each test checks its own
PIPELINE_SPECS = {
    "split text encoders": [("flux", "tp2", ("style", "kohya"), dict(bad_text_encoder=True)),
                            ("sd3", "tp2", ("style", "detail"), {})],
    "cfg and data": [("qwenimage", "cfg2", ("style", "detail"), {}), ("sd3", "cfg2", ("style", "detail"), {}),
                     ("flux", "dp2", ("style", "kohya"), {})],
    "staged": [("flux", "tp2", ("style", "kohya"), dict(stages=True))],
    "packed": [("hunyuanvideo", "tp2", ("style", "original"), {})],
}


@pytest.fixture(scope="module")
def pipeline_results(pools, tiny_pipeline_folders, pipeline_loras) -> dict[str, list[list[dict]]]:
    """test -> its cases' results per rank (PIPELINE_SPECS), from one pool run."""
    batch, owners = [], []
    for test, specs in PIPELINE_SPECS.items():
        batch += _pipeline_cases(tiny_pipeline_folders, pipeline_loras, specs)
        owners += [test] * len(specs)
    results = pools.get(2).run(cases.pipeline_lora_cases, timeout_s=900, cases=batch)
    return {test: [[result for result, owner in zip(rank_results, owners) if owner == test]
                   for rank_results in results] for test in PIPELINE_SPECS}


def test_pipeline_lora_on_split_text_encoders(pipeline_results):
    """FLUX.1 (a diffusers file and a kohya one, both with CLIP tensors) and SD3 (both CLIP encoders) at tp2: the
    encoders' factors sliced like their shards, everything within 1e-5 of diffusers; an adapter whose encoder part
    does not fit is refused on every rank. (Encoders split over CP ranks, and every other mode: tools/verify_lora.py.)"""
    results = pipeline_results["split text encoders"]
    _check_pipeline(results)
    for result in results[0] + results[1]:
        case = result["case"]
        encoders = [name for name in result["adapters"] if name.startswith("text_encoder")]
        assert encoders == (["text_encoder"] if case["family"] == "flux" else ["text_encoder", "text_encoder_2"])
        for name in encoders:
            # the 6 Linears of the first CLIP layer, all split; each (layer, adapter) factor pair its slice
            assert result["split_layers"][name] == 6, (case["family"], name, result)
            assert result["sliced"][name] == {"flux": 12, "sd3": 9}[case["family"]], (case["family"], name, result)
        assert result["split_layers"]["transformer"] > 0, result
        if case.get("bad_text_encoder"):
            assert result["bad_key"].removeprefix("text_encoder.").split(".lora_A")[0] in result["bad_error"]
            assert "needs" in result["bad_error"], result["bad_error"]
            assert result["adapters_after_bad"] == [] and result["still_base"]


def test_pipeline_lora_in_cfg_and_data_modes(pipeline_results):
    """cfg2 in both CFG styles (Qwen-Image: two transformer calls per step; SD3: one call on the batched branches,
    its CLIP encoders whole and adapted by diffusers) and dp2 (FLUX.1, each replica its own prompt): every step
    within 1e-5 of diffusers' single process."""
    results = pipeline_results["cfg and data"]
    _check_pipeline(results)
    for result in results[0] + results[1]:
        assert sum(result["split_layers"].values()) == 0, result  # nothing is split in these modes


def test_pipeline_lora_on_staged_pipelines(pipeline_results):
    """stages=True at tp2 (FLUX.1, CLIP adapted too): the adapters are loaded and fused while the components'
    weights are freed, their factors stay resident while each stage frees and reads its shards again, and fused
    layers are fused again after each read."""
    results = pipeline_results["staged"]
    _check_pipeline(results)
    for result in results[0] + results[1]:
        assert result["stage_entries"]["text_encoders"] >= 6, result  # freed and read again at every call
        assert all(count > 0 for count in result["split_layers"].values()), result


def test_hunyuan_video_lora_with_packed_projections(pipeline_results):
    """HunyuanVideo at tp2: a diffusers-format adapter on every Linear of the first blocks (the single block's
    output projection is split as two packed column blocks: [attention, MLP]) and one in the original repository's
    layout (fused q/k/v), converted by diffusers."""
    results = pipeline_results["packed"]
    _check_pipeline(results)
    for result in results[0] + results[1]:
        assert result["packed"] == ["single_transformer_blocks.0.proj_out"], result


@pytest.mark.slow
def test_cli_generate_with_loras(tiny_pipeline_folders, pipeline_loras, tmp_path):
    """`paradiff generate MODEL --lora PATH[:SCALE]` (twice) at tp2, --compare against diffusers with the same
    adapters; report.json lists them."""
    import json

    loras = pipeline_loras["flux"]
    out = tmp_path / "out"
    argv = ["-m", "paradiff.cli", "generate", str(tiny_pipeline_folders["flux"]), "--tp", "2",
               "--prompt", "a cat", "--steps", "1", "--height", "32", "--width", "32", "--compare", "--out", str(out),
               "--lora", f"{loras['style']}:0.8", "--lora", str(loras["kohya"])]
    result = command.run(argv, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["loras"] == [
        {"adapter_name": "lora0", "path": str(loras["style"]), "scale": 0.8},
        {"adapter_name": "lora1", "path": str(loras["kohya"]), "scale": 1.0}]
    assert report["max_abs_diff_vs_single_process"] < 1e-5


def test_lora_spec_parsing():
    import argparse

    from paradiff.cli.args import lora_specs

    specs = lora_specs(argparse.Namespace(lora=["a.safetensors:0.5", "org/repo", "c:/x.safetensors", "d:1e-1"]))
    assert [(s["path"], s["scale"]) for s in specs] == [("a.safetensors", 0.5), ("org/repo", 1.0),
                                                         ("c:/x.safetensors", 1.0), ("d", 0.1)]
    assert [s["adapter_name"] for s in specs] == ["lora0", "lora1", "lora2", "lora3"]


def test_wan22_second_transformer(pools, tiny_pipeline_folders, tmp_path):
    """Wan 2.2 A14B at tp2: `load_into_transformer_2=True` reaches paradiff's loader on the second transformer."""
    from diffusers import WanTransformer3DModel

    folder = tiny_pipeline_folders["wan2.2-a14b"]
    targets = ("blocks.0.attn1.to_q", "blocks.0.attn1.to_out.0", "blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2",
               "proj_out")
    files = {}
    for seed, name in ((7, "high"), (8, "low")):
        transformer = WanTransformer3DModel.from_pretrained(folder / ("transformer" if name == "high" else "transformer_2"))
        files[name] = str(save_lora(tmp_path / f"{name}.safetensors", random_lora(transformer, targets, 4, seed=seed),
                                    rank=4, alpha=8))
    for result in pools.get(2).run(cases.wan22_two_transformers, timeout_s=600, folder=str(folder), mode="tp2",
                                   **files):
        assert result["diff"] <= 1e-4, result
        assert result["adapters"] == {"transformer": ["high"], "transformer_2": ["low"]}
        assert result["split_layers"] == 8, result  # 4 split Linears per transformer; proj_out stays whole


# --- which slice of each factor a rank holds, per style (no processes) ---

def _resolved(model, styles: dict, rank: int, size: int = 2):
    return resolve_plan(model, TensorParallelPlan(styles=styles), rank, size)


@pytest.mark.parametrize("rank", [0, 1])
def test_factor_specs_follow_the_base_weight_spec(rank):
    model = build_model("wan")
    head_dim = model.config.attention_head_dim
    resolved = _resolved(model, {
        "blocks.0.attn1.to_q": "colwise", "blocks.0.attn1.to_k": ColwiseHeads(head_dim),
        "blocks.0.ffn.net.0.proj": PackedColwise([1, 1]), "blocks.0.attn1.to_out.0": "rowwise",
        "condition_embedder.time_proj": "rowwise_split_input"}, rank)
    for name, linear in resolved.linears.items():
        specs = factor_specs(name, linear)
        weight = linear.specs["weight"]
        if linear.style.kind == "colwise":
            assert specs["lora_B.weight"] == ShardSpec(dim=0, pieces=weight.pieces) and specs["lora_A.weight"] is None
            assert specs["lora_B.bias"] == specs["lora_B.weight"]
        else:
            assert specs["lora_A.weight"] == ShardSpec(dim=1, pieces=weight.pieces) and specs["lora_B.weight"] is None
            assert specs["lora_B.bias"] is None  # added once, after the all-reduce
    packed = factor_specs("blocks.0.ffn.net.0.proj", resolved.linears["blocks.0.ffn.net.0.proj"])["lora_B.weight"]
    assert len(packed.pieces) == 2  # one piece per packed block, as the weight


def test_factor_specs_refuse_norms_and_vocab_naming_the_layer():
    model = build_model("wan")
    resolved = _resolved(model, {"blocks.0.attn1.norm_q": HeadNorm(), "blocks.0.attn1.to_q": "colwise"}, 0)
    with pytest.raises(AdapterError, match="blocks.0.attn1.norm_q"):
        factor_specs("blocks.0.attn1.norm_q", resolved.linears["blocks.0.attn1.norm_q"])
    resolved = _resolved(model, {"proj_out": "vocab"}, 0)
    with pytest.raises(AdapterError, match="proj_out.*gathered"):
        factor_specs("proj_out", resolved.linears["proj_out"])


def test_only_pipelines_with_a_lora_loader_get_paradiffs():
    from diffusers import DiTPipeline, FluxPipeline

    from paradiff.api.pipeline import parallel_pipeline_class

    assert not hasattr(parallel_pipeline_class(DiTPipeline), "load_lora_weights")  # --lora refuses it by this
    flux = parallel_pipeline_class(FluxPipeline)
    assert flux.load_lora_weights.__qualname__ == "LoraPipelineMixin.load_lora_weights"
    assert flux.load_lora_into_text_encoder.__qualname__ == "LoraPipelineMixin.load_lora_into_text_encoder"


def test_random_lora_is_deterministic():
    model = build_model("flux")
    first, second = (random_lora(model, TARGETS["flux"], 4, seed=1) for _ in range(2))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)



def test_hotswap_on_compiled_tp2_model_does_not_recompile(pools, checkpoints, lora_files, tmp_path):
    """enable_lora_hotswap(target_rank=8) before compiling a tp2 FLUX.2: swapping in an adapter of the same rank and
    one of a lower rank (peft pads it to 8) compiles no new graph, and the output equals diffusers' unsplit model
    with that adapter freshly loaded."""
    model = build_model("flux2")
    lower = save_lora(tmp_path / "rank2.safetensors", random_lora(model, TARGETS["flux2"], 2, seed=5), rank=2,
                      alpha=3)
    files = lora_files["flux2"]
    results = pools.get(2).run(cases.compiled_hotswap, timeout_s=600, family="flux2",
                               folder=str(checkpoints[("flux2", "single")]), mode="tp2", first=str(files["style"]),
                               swaps={"same rank": str(files["swap"]), "lower rank": str(lower)}, target_rank=8)
    for result in results:
        assert set(result["graphs"].values()) == {result["graphs"]["first"]} and result["graphs"]["first"] > 0, result
        assert max(result["diffs"].values()) <= RTOL, result
        assert result["padded"] == [(8,)], result  # every layer's A is padded to the target rank
