"""The pipeline coverage table (docs/pipeline-coverage.md, `paradiff plans --pipelines`), the record it is made from
(plans/pipelines_verified.json, written by tools/verify_pipelines.py) and the tiny-pipeline zoo behind it; a small
sample of the verification run on the rank pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from paradiff.plan_tools.pipeline_coverage import MODES, load_verified, pipeline_coverage_table, summary

ROOT = Path(__file__).resolve().parents[1]


def test_doc_table_is_generated_from_the_code_and_the_record():
    doc = (ROOT / "docs" / "pipeline-coverage.md").read_text()
    assert pipeline_coverage_table(markdown=True) in doc, (
        "docs/pipeline-coverage.md's table is stale: run `python tools/verify_pipelines.py --table`")


def test_record_lists_every_dit_pipeline_class_of_the_installed_diffusers():
    import diffusers

    from paradiff_testkit import zoo

    record = load_verified()
    assert record["diffusers"] == diffusers.__version__, "run `python tools/verify_pipelines.py --classes`"
    classes = set(record["classes"])
    assert len(classes) >= 150 and {"FluxPipeline", "QwenImageEditPlusPipeline", "SanaSprintPipeline"} <= classes
    assert {zoo.pipeline_name(key) for key in zoo.names()} <= classes


def test_the_table_lists_the_modular_dit_classes_with_their_guidance():
    """The Modular Diffusers classes are rows too: each one whose blocks expect a transformer (SDXL's, a UNet's, is
    not listed), its CFG style from its blocks' guider components, counted in the footer."""
    from paradiff.plan_tools.pipeline_coverage import cfg_style

    record = load_verified()
    modular = record["modular"]
    assert len(modular) >= 35 and set(modular) <= set(record["classes"])
    assert "StableDiffusionXLModularPipeline" not in record["classes"]
    assert modular["QwenImageModularPipeline"] == ["guider"] and modular["FluxModularPipeline"] == []
    assert cfg_style("QwenImageModularPipeline") == "its guider" and cfg_style("FluxModularPipeline") == "never guides"
    assert cfg_style("Ideogram4ModularPipeline") == "not split yet"  # PipelineSpec.modular_cfg_refusal
    table = pipeline_coverage_table(markdown=True)
    assert "| `Krea2TurboModularPipeline` | never guides |" in table
    assert f"({len(modular)} of them Modular Diffusers pipelines)" in table


def test_every_recipe_has_a_record_in_every_mode():
    from paradiff_testkit import zoo

    pipelines = load_verified()["pipelines"]
    keys = zoo.names()
    missing = {key: sorted(set(MODES) - set(pipelines.get(key, {}).get("modes", {}))) for key in keys}
    assert not {key: modes for key, modes in missing.items() if modes}, (
        "recipes without a verification record: run `python tools/verify_pipelines.py --only KEY`")
    for key in keys:
        for mode, outcome in pipelines[key]["modes"].items():
            assert outcome["status"] in ("verified", "n/a", "refused", "mismatch", "failed"), (key, mode, outcome)
            assert outcome["status"] != "verified" or outcome["diff"] <= 1e-5, (key, mode, outcome)
            assert outcome["status"] in ("verified",) or outcome.get("reason"), (key, mode, outcome)


def test_the_summary_counts_classes_verified_in_every_applicable_mode():
    record = {"classes": ["A", "B", "C"], "modular": {"B": []}, "pipelines": {
        "A": {"modes": {mode: {"status": "verified", "diff": 0.0} for mode in MODES}},
        "B": {"modes": {**{mode: {"status": "verified", "diff": 0.0} for mode in MODES},
                        "cfg2": {"status": "n/a", "reason": "never guides"}}},
        "C": {"modes": {**{mode: {"status": "verified", "diff": 0.0} for mode in MODES},
                        "ring2": {"status": "refused", "reason": "PlanError: ..."}}}}}
    assert summary(record) == {"classes": 3, "modular": 1, "with recipe": 3, "verified in every mode": 2}


def test_plans_command_prints_the_pipeline_table(capsys):
    from paradiff.cli import main

    assert main(["plans", "--pipelines"]) == 0
    out = capsys.readouterr().out
    assert "FluxKontextPipeline" in out and "DiT pipeline classes in diffusers" in out
    assert main(["plans", "FluxPipeline", "--pipelines"]) == 2
    assert "takes no class name" in capsys.readouterr().err


def test_a_recipe_missing_a_required_component_says_which(monkeypatch):
    from paradiff_testkit import zoo

    # the family's components as names only: the builder's reading of the pipeline's __init__ is what is tested
    monkeypatch.setattr(zoo, "_registry", lambda: {"QwenImageEditPipeline": zoo.Recipe(family="qwenimage")})
    monkeypatch.setattr(zoo.tiny, "family_components", lambda family, seed: dict.fromkeys(
        ("scheduler", "vae", "text_encoder", "tokenizer")))
    monkeypatch.setattr(zoo.tiny, "family_transformers", lambda family, seed, config: {"transformer": None})
    with pytest.raises(TypeError, match="QwenImageEditPipeline needs a 'processor' component"):
        zoo.build("QwenImageEditPipeline")


# --- a sample of tools/verify_pipelines.py on the rank pool -------------------------------------------------------

# batch CFG with a ControlNet's residual lists batched, two-call CFG on an edit pipeline (Kontext under CP:
# tests/test_conditioning.py), the same Kontext pipeline as a Modular Diffusers pipeline under Ulysses (the modular
# folder made from the standard one), batch CFG over per-sample lists (Z-Image), image-to-video under Ulysses (LTX
# I2V: the clean first frame's tokens carry their own timestep, split with the tokens; Wan I2V: the image's latents
# beside the noise, its CLIP tokens before the text, 27 video tokens over 2 ranks)
SAMPLE = (("StableDiffusion3ControlNetPipeline", "cfg2"), ("FluxKontextPipeline", "cfg2"),
          ("FluxKontextModularPipeline", "ulysses2"), ("ZImagePipeline", "cfg2"),
          ("LTXImageToVideoPipeline", "ulysses2"), ("WanImageToVideoPipeline", "ulysses2"))
# the tokens the first block sees in the single process: conditioned and uneven where the pipeline allows it
FIRST_BLOCK_TOKENS = {"StableDiffusion3ControlNetPipeline": 35, "FluxKontextPipeline": 162,
                      "FluxKontextModularPipeline": 131, "LTXImageToVideoPipeline": 192, "WanImageToVideoPipeline": 27}


@pytest.fixture(scope="module")
def sample_jobs(tmp_path_factory, tiny_pipeline_folders):
    from paradiff_testkit import zoo
    from paradiff_testkit.zoo.check import reference

    root = tmp_path_factory.mktemp("zoo")
    jobs, expected, folders = [], {}, {}
    for key, mode in SAMPLE:
        recipe = zoo.recipe(key)
        if zoo.is_modular(key):  # made from its standard recipe's folder, saved above
            folders[key] = str(zoo.save(key, root / key, standard_folder=folders[recipe.standard]))
        else:
            unchanged = (not (recipe.transformer or recipe.components or recipe.controlnet or recipe.init)
                         and recipe.family in tiny_pipeline_folders)  # not a recipe module's own family
            # a recipe that only calls its family's pipeline another way reads the family's folder, saved for the
            # session
            folders[key] = str(tiny_pipeline_folders[recipe.family] if unchanged else zoo.save(key, root / key))
        folder = folders[key]
        if key not in expected:
            expected[key] = reference(key, folder)
        jobs.append(dict(key=key, folder=folder, mode=mode, expected=expected[key]))
    return jobs


def test_sample_pipelines_equal_single_process_in_their_modes(pools, sample_jobs):
    from paradiff_testkit.zoo.check import check_modes

    results = pools.get(2).run(check_modes, jobs=sample_jobs, timeout_s=400)
    for rank, outcomes in enumerate(results):
        for job, outcome in zip(sample_jobs, outcomes):
            print(rank, job["key"], job["mode"], outcome)
            assert outcome["status"] == "verified" and outcome["diff"] <= 1e-5, (job["key"], job["mode"], outcome)
    # the sample is conditioned and uneven: SD3's 35 tokens, Kontext's 99 noise + 63 reference tokens (the modular
    # Kontext's default image processor resizes the 36 x 28 reference to 32 x 16: 99 + 32), LTX I2V's 3
    # latent frames of 8 x 8, Wan I2V's 27 (Z-Image pads its own tokens to multiples of 32)
    assert {job["key"]: job["expected"]["blocks"][0][1] for job in sample_jobs
            if job["key"] in FIRST_BLOCK_TOKENS} == FIRST_BLOCK_TOKENS


# --- what the pipeline class alone decides, refused before any worker starts --------------------------------------

@pytest.mark.parametrize("pipeline,flags,reason", [
    ("SanaPAGPipeline", ["--ulysses", "2"], "SanaPAGPipeline: its perturbed-attention guidance replaces the "
                                            "self-attention of its perturbed layers"),
    ("StableDiffusion3PAGPipeline", ["--ring", "2"], "load the folder as StableDiffusion3Pipeline (no PAG)"),
    ("PixArtSigmaPAGPipeline", ["--cfg", "2"], "not supported with CFG parallelism yet: perturbed-attention guidance "
                                               "runs [uncond, cond, perturbed] as one batch"),
    # a pipeline that takes a transformer but is no DiT generator, in any mode
    ("AmusedPipeline", ["--tp", "2"], "AmusedPipeline is not split by paradiff: aMUSEd is a masked-token"),
])
def test_pipelines_a_mode_cannot_split_are_refused_before_any_worker(tmp_path, capsys, monkeypatch, pipeline, flags,
                                                                      reason):
    import json

    import paradiff.cli
    from paradiff.cli import main

    started = []
    monkeypatch.setattr(paradiff.cli, "launch", lambda *args, **kwargs: started.append(args) or 0)
    (tmp_path / "model_index.json").write_text(json.dumps({
        "_class_name": pipeline, "transformer": ["diffusers", "SD3Transformer2DModel"]}))
    assert main(["generate", str(tmp_path), *flags, "--prompt", "a cat"]) == 2
    err = capsys.readouterr().err
    assert reason in err and len(err.strip().splitlines()) == 1 and not started, err
