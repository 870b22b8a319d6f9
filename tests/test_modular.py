"""Modular Diffusers pipelines (modular_model_index.json, blocks, a guider): load_pipeline splits their transformer,
text encoders and VAE like a standard pipeline's, and the images equal diffusers' single-process modular call.

The sample here: Qwen-Image (guided: tp2, ulysses2, cfg2), Krea 2 Turbo (modular-only, guidance-distilled:
tp2 x ulysses2), Wan (a 3-branch SkipLayerGuidance guider at cfg3 and at cfg2), the refusals, the folder's index and
`paradiff generate` on a modular folder. Every modular zoo key in the coverage table's modes:
tools/verify_pipelines.py; the extra modes: tools/verify_modular.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rank_cases_cli as cli_cases
import rank_cases_modular as cases
from paradiff.io.folders import read_pipeline_index
from paradiff_testkit import zoo
from paradiff_testkit.modular import modular_equivalence

RTOL = 1e-5
STEPS = 2


QWEN, WAN, KREA = "QwenImageModularPipeline", "WanModularPipeline", "Krea2TurboModularPipeline"


@pytest.fixture(scope="module")
def modular_folders(tiny_pipeline_folders, tmp_path_factory):
    """The zoo's modular pipelines; Qwen-Image's and Wan's from the session's standard family folders (their zoo
    standard recipes are those families unchanged)."""
    root = tmp_path_factory.mktemp("modular")
    standard = {QWEN: tiny_pipeline_folders["qwenimage"], WAN: tiny_pipeline_folders["wan"]}
    return {key: str(zoo.save(key, root / key, standard_folder=standard.get(key))) for key in (QWEN, WAN, KREA)}


def _check(results: list[dict], modes: dict[str, dict]) -> None:
    """Every rank's output equals the single-process one; TP ranks hold their slices, CP ranks their token share."""
    for result in results:
        for mode, outcome in result["modes"].items():
            assert outcome["max_abs_diff"] <= RTOL * max(outcome["scale"], 1.0), (mode, outcome)
            degrees = modes[mode]
            assert outcome["vae_split"], (mode, outcome)  # decoded by rows across the replica's ranks
            if degrees.get("tp", 1) > 1:  # the transformer and the text encoder split over the TP ranks
                assert outcome["wrong_slices"] == [] and outcome["param_share"] < 0.75, (mode, outcome)
                assert outcome["encoder_share"] < 0.75, (mode, outcome)
            if degrees.get("stages"):  # each stage entered once, its weights read again at its start
                assert outcome["stages"] == ["text_encoders", "transformer", "vae"], (mode, outcome)
            cp = degrees.get("ulysses", 1) * degrees.get("ring", 1)
            if cp > 1:  # each CP rank's first block saw its own share; the shares make up the sequence
                assert outcome["tokens"] < result["tokens"], (mode, outcome)
                copies = len(results) // cp
                assert sum(outcome["token_shares"]) == copies * result["tokens"], (mode, outcome)


QWEN_MODES = {"tp2-staged": dict(tp=2, stages=True), "ulysses2": dict(ulysses=2), "cfg2": dict(cfg=2)}


def test_guided_modular_pipeline_equals_single_process(pools, modular_folders):
    """QwenImageModularPipeline (its ClassifierFreeGuidance guider: two transformer calls per step) at tp2 (staged:
    text encoder, transformer and VAE each read at their stage), ulysses2 and cfg2: at cfg2 each rank computes one
    branch per step and the guider gets both predictions."""
    results = pools.get(2).run(modular_equivalence, key=QWEN, folder=modular_folders[QWEN],
                               modes=QWEN_MODES, steps=STEPS, timeout_s=400)
    _check(results, QWEN_MODES)
    for result in results:
        cfg2 = result["modes"]["cfg2"]
        assert cfg2["type"] == "ParallelQwenImageModularPipeline", cfg2
        assert cfg2["computed"] == STEPS and cfg2["branch_counts"] == [2] * STEPS, cfg2
        assert "cfg_exchange" in cfg2["wrappers"] and "cfg_exchange" not in result["modes"]["ulysses2"]["wrappers"]


def test_modular_only_pipeline_at_tp2_x_ulysses2(pools, modular_folders):
    """Krea2TurboModularPipeline, which diffusers ships only as a modular pipeline, on 4 ranks."""
    modes = {"tp2xulysses2": dict(tp=2, ulysses=2)}
    results = pools.get(4).run(modular_equivalence, key=KREA, folder=modular_folders[KREA],
                               modes=modes, steps=STEPS, timeout_s=400)
    _check(results, modes)
    assert results[0]["modes"]["tp2xulysses2"]["type"] == "ParallelKrea2TurboModularPipeline"


def test_three_branch_guider_splits_over_three_cfg_ranks(pools, modular_folders):
    """WanModularPipeline with SkipLayerGuidance (cond, uncond, cond with a block skipped: 3 transformer calls per
    step from the second step on, 2 on the first): at cfg3 each rank computes branch i of each step, and the
    video equals the single process; cfg3 with the pipeline's 2-branch CFG guider is refused."""
    steps = 3
    results = pools.get(3).run(modular_equivalence, key=WAN, folder=modular_folders[WAN],
                               modes={"cfg3": dict(cfg=3)}, guider="skip_layer", steps=steps, timeout_s=400)
    _check(results, {"cfg3": dict(cfg=3)})
    counts = results[0]["modes"]["cfg3"]["branch_counts"]
    assert counts == [2, 3, 3], counts
    computed = sorted(result["modes"]["cfg3"]["computed"] for result in results)
    assert computed == [2, 3, 3] and sum(computed) == sum(counts), computed
    messages = pools.get(3).run(cases.modular_cfg_too_wide, folder=modular_folders[WAN])
    for message in messages:
        assert message.startswith("ParallelConfigError: cfg_degree=3 needs 3 guidance branches per step"), message
        assert "ClassifierFreeGuidance" in message and "runs 2 branches" in message, message


def test_three_branch_guider_on_two_cfg_ranks(pools, modular_folders):
    """3 branches over cfg2: rank 0 computes branches 0 and 2, rank 1 branch 1."""
    results = pools.get(2).run(modular_equivalence, key=WAN, folder=modular_folders[WAN],
                               modes={"cfg2": dict(cfg=2)}, guider="skip_layer", steps=3, timeout_s=400)
    _check(results, {"cfg2": dict(cfg=2)})
    assert sorted(r["modes"]["cfg2"]["computed"] for r in results) == [3, 5]


def test_standard_pipeline_with_a_guider_splits_its_branches(pools, tmp_path_factory):
    """HunyuanVideo15Pipeline guides through its ClassifierFreeGuidance component, one transformer call per branch:
    at cfg2 each rank computes one branch per step, and the video equals the single process. Its transformer
    cannot run on the meta device, so each rank also computes the first call of the other branch once (for the
    output's structure, remembered per argument shapes): 2 steps, 3 forwards per rank instead of 4."""
    from paradiff_testkit.guiders import save_guided_pipeline

    folder = str(save_guided_pipeline("hunyuanvideo15", tmp_path_factory.mktemp("guided") / "hv15"))
    results = pools.get(2).run(cases.guided_standard_equivalence, folder=folder, modes={"cfg2": dict(cfg=2)},
                               timeout_s=400)
    for result in results:
        outcome = result["modes"]["cfg2"]
        assert outcome["max_abs_diff"] <= RTOL * max(outcome["scale"], 1.0), outcome
        assert outcome["branch_counts"] == [2, 2], outcome
        assert outcome["computed"] == 3, outcome


def test_modular_refusals(pools, modular_folders):
    messages = pools.get(2).run(cases.modular_refusals, folders=modular_folders)
    for distilled, other_seed, no_guidance, no_guider in messages:
        assert other_seed.startswith("DistributedError: generation start: ranks disagree on initial latents"), \
            other_seed
        assert distilled.startswith("ParallelConfigError: cfg_degree=2: Krea2TurboModularPipeline never runs "
                                    "classifier-free guidance (its blocks have no guider component"), distilled
        assert no_guidance.startswith("ParallelConfigError: cfg_degree=2 needs 2 guidance branches per step"), \
            no_guidance
        assert "runs no guidance (one branch)" in no_guidance and "guidance_scale=1.0" in no_guidance, no_guidance
        assert no_guider.startswith("ParallelConfigError: cfg_degree=2 splits the guidance branches of "
                                    "QwenImageModularPipeline's guider, but its guider is None"), no_guider


def test_modular_index_names_components_and_where_they_are(modular_folders, tmp_path):
    """A modular folder's index: each component's class and repository; a copy of the folder elsewhere (its index
    still naming the original) reads its components from the copy, as Modular Diffusers does."""
    import shutil

    folder = modular_folders[KREA]
    index = read_pipeline_index(folder)
    assert index.modular and index.class_name == KREA
    assert index.components["transformer"] == ("diffusers", "Krea2Transformer2DModel")
    assert index.components["text_encoder"] == ("transformers", "Qwen3VLModel")
    assert index.location("transformer") == (folder, "transformer")
    copy = shutil.copytree(folder, tmp_path / "copy")
    entries = json.loads((copy / "modular_model_index.json").read_text())
    assert entries["vae"][2]["pretrained_model_name_or_path"] == folder  # still the original
    assert read_pipeline_index(copy).location("vae") == (str(copy), "vae")


def test_generate_on_a_modular_folder(pools, modular_folders, tmp_path):
    """`paradiff generate` on a modular folder (no model_index.json) at ulysses2, --compare against diffusers' own
    modular call; --guidance-scale sets the guider's scale, on both sides."""
    out = tmp_path / "out"
    argv = ["generate", modular_folders[QWEN], "--ulysses", "2", "--height", "32", "--width", "32", "--steps",
            "2", "--prompt", "a small red fox", "--negative-prompt", "blurry", "--guidance-scale", "3.0", "--compare",
            "--out", str(out)]
    (rank0, rank1) = pools.get(2).run(cli_cases.generate_each, runs=[argv], timeout_s=400)
    report = rank0[0]["report"]
    assert rank1[0]["report"] is None
    assert report["max_abs_diff_vs_single_process"] <= 1e-5, report
    assert report["config"]["ulysses"] == 2 and len(report["images"]) == 1, report
    assert (out / "0.png").is_file() or all(Path(path).is_file() for path in report["images"].values()), report


def test_a_standard_folder_run_by_its_modular_class(tiny_pipeline_folders):
    """`pipeline_cls=QwenImageModularPipeline` on a standard (model_index.json) folder: the components paradiff reads
    itself come from the folder, the blocks are the class's defaults; one process, equal to diffusers' modular
    pipeline of that folder."""
    import numpy as np
    import torch
    from diffusers import ModularPipeline, QwenImageModularPipeline

    import paradiff
    folder = str(tiny_pipeline_folders["qwenimage"])
    kwargs = dict(zoo.call_kwargs(QWEN), num_inference_steps=STEPS)
    pipeline = paradiff.load_pipeline(folder, pipeline_cls=QwenImageModularPipeline)
    assert type(pipeline).__name__ == "ParallelQwenImageModularPipeline"
    reference = ModularPipeline.from_pretrained(folder)
    reference.load_components(dtype=torch.float32)
    assert type(reference) is QwenImageModularPipeline
    actual = np.asarray(pipeline(**kwargs, seed=0, output="images"))
    expected = np.asarray(reference(**kwargs, generator=torch.Generator().manual_seed(0), output="images"))
    assert np.abs(actual - expected).max() <= RTOL


@pytest.mark.parametrize("key,argv,message", [
    (KREA, ["--cfg", "2"], "--cfg 2: {folder}: Krea2TurboModularPipeline never runs classifier-free guidance"),
    (QWEN, ["--cfg", "3"], "--cfg 3: QwenImageModularPipeline's guider (ClassifierFreeGuidance, guidance_scale "
                                  "4.0) runs 2 guidance branches per step; each cfg rank computes one. Use --cfg 2"),
    (QWEN, ["--cfg", "2", "--guidance-scale", "1"], "--cfg 2: QwenImageModularPipeline's guider "
                                                           "(ClassifierFreeGuidance, guidance_scale 1.0) runs no guidance"),
    (KREA, ["--negative-prompt", "blurry"], "--negative-prompt: Krea2TurboModularPipeline (a modular "
                                                      "pipeline) takes no negative_prompt; its blocks take "),
], ids=["no-guider", "cfg3-on-two-branches", "no-guidance", "flag-not-taken"])
def test_cli_refuses_on_a_modular_folder_before_any_worker(modular_folders, tmp_path, capsys, monkeypatch, key,
                                                           argv, message):
    """What a modular folder's index and blocks decide is refused by the launcher: one line, exit 2, no worker."""
    import paradiff.cli

    started = []
    monkeypatch.setattr(paradiff.cli, "launch", lambda *args, **kwargs: started.append(args) or 0)
    folder = modular_folders[key]
    code = paradiff.cli.main(["generate", folder, *argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert (code, started) == (2, []), err
    assert err.startswith("paradiff: error: " + message.format(folder=folder)), err
    assert len(err.strip().splitlines()) == 1, err
