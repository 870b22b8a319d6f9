"""Every encoder class a diffusers DiT pipeline loads and paradiff has a plan for (docs/pipelines.md, "Encoder
classes"), loaded alone through paradiff at tp2 and tp3: batch 2 (text padded to two lengths, the mask passed),
float32, every output equal to transformers' single-process model to 1e-5 relative, and each rank holding exactly
the slices of the full tensors its resolved plan names."""

from __future__ import annotations

import pytest

import rank_cases_encoder_classes as cases
from paradiff.plans import family_of
from paradiff_testkit.encoders import (ENCODER_CLASSES, encoder_class, save_cogview4_pipeline, save_encoder,
                                      save_wan_i2v_encoders)

TOLERANCE = 1e-5  # relative


@pytest.fixture(scope="session")
def encoder_folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("encoder-classes")
    return {name: str(save_encoder(name, root / name)) for name in ENCODER_CLASSES}


def test_every_tested_class_has_a_builtin_plan():
    for name in ENCODER_CLASSES:
        assert family_of(encoder_class(name)) is not None, name


@pytest.fixture(scope="module")
def encoder_references(encoder_folders) -> dict[str, dict]:
    """transformers' single-process model of each class (state_dict and outputs), made once here for both TP
    degrees instead of on every rank."""
    return {name: cases.reference(name, folder) for name, folder in encoder_folders.items()}


@pytest.mark.parametrize("tp", [2, 3])
def test_encoder_classes_match_single_process(pools, encoder_folders, encoder_references, tp):
    results = pools.get(tp).run(cases.encoder_classes_match, folders=encoder_folders, references=encoder_references,
                                tp=tp, timeout_s=600)
    assert len(results) == tp
    for result in results:
        assert set(result["classes"]) == set(ENCODER_CLASSES), result["rank"]
        for name, figures in result["classes"].items():
            assert figures["diff"] <= TOLERANCE, (tp, result["rank"], name, figures)
            assert figures["split_tensors"] > 0, (tp, result["rank"], name, figures)
            # norms, position embeddings, pooling heads and the VLMs' vision towers stay whole: in these tiny
            # models they are a large part, so a rank holds up to ~0.3 more than 1/tp
            assert figures["share"] < 1 / tp + 0.3, (tp, result["rank"], name, figures)


def test_image_encoder_splits_inside_a_pipeline(pools, tmp_path_factory):
    """load_pipeline splits a pipeline's image encoder like its text encoders (the TP ranks; with no TP, the CP
    ranks): Wan I2V's CLIP vision tower encodes two images as diffusers' single-process pipeline does."""
    folder = str(save_wan_i2v_encoders(tmp_path_factory.mktemp("wan-i2v") / "pipeline"))
    modes = {"tp2": dict(tp=2), "ulysses2": dict(ulysses=2)}
    for result in pools.get(2).run(cases.image_encoder_in_pipeline, folder=folder, modes=modes, timeout_s=600):
        for mode, figures in result["modes"].items():
            assert figures["diff"] <= TOLERANCE, (mode, result["rank"], figures)
            assert figures["split_tensors"] > 0 and figures["share"] < 0.5 + 0.3, (mode, result["rank"], figures)


def test_cogview4_glm_encoder_splits_over_tp_and_cp_ranks(pools, tmp_path_factory):
    """CogView4's GLM encoder (packed gate/up) splits at tp2 and, CP-only, over the ulysses2 ranks: the prompt
    embeddings (batch 2, different lengths) and the images are diffusers' single-process ones."""
    folder = str(save_cogview4_pipeline(tmp_path_factory.mktemp("cogview4") / "pipeline"))
    prompts = ["a cat", "a lighthouse on a rocky coast during a storm, dramatic lighting"]
    modes = {"tp2": dict(tp=2), "ulysses2": dict(ulysses=2)}
    for result in pools.get(2).run(cases.cogview4_pipeline_matches, folder=folder, prompts=prompts, modes=modes,
                                   timeout_s=600):
        for mode, figures in result["modes"].items():
            assert figures["embeds"] <= TOLERANCE, (mode, result["rank"], figures)
            assert figures["image"] <= 1e-5, (mode, result["rank"], figures)  # pixels in [0, 1]
            assert 0.45 <= figures["encoder_share"] <= 0.6, (mode, result["rank"], figures)
