"""Errors the model folder's configs already decide are one line, exit 2, and no worker is started."""

from __future__ import annotations

import json

import pytest

import paradiff.cli
from paradiff.cli import main


@pytest.fixture
def no_worker(monkeypatch):
    started = []
    monkeypatch.setattr(paradiff.cli, "launch", lambda *args, **kwargs: started.append(args) or 0)
    return started


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_missing_folder_that_is_no_hub_id(tmp_path, capsys, no_worker, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run(capsys, "generate", "no-such-model", "--out", str(tmp_path / "out"))
    assert (code, no_worker) == (2, [])
    assert err.strip() == ("paradiff: error: model folder no-such-model does not exist (and is not a Hub id of the "
                           "form 'owner/name')")


@pytest.mark.parametrize("family,reason", [
    ("flux2", "Flux2Pipeline never runs classifier-free guidance (guidance-distilled"),
    (None, "EasyAnimateControlPipeline is not classified for CFG parallelism yet ("),
], ids=["never-guides", "not-classified"])
def test_cfg_on_a_pipeline_paradiff_cannot_split_by_cfg(tiny_pipeline_folders, tmp_path, capsys, no_worker, family,
                                                         reason):
    if family is None:
        (tmp_path / "unclassified").mkdir()
        (tmp_path / "unclassified" / "model_index.json").write_text(json.dumps({
            "_class_name": "EasyAnimateControlPipeline",
            "transformer": ["diffusers", "EasyAnimateTransformer3DModel"]}))
    folder = str(tiny_pipeline_folders[family]) if family else str(tmp_path / "unclassified")
    code, err = run(capsys, "generate", folder, "--cfg", "2", "--out", str(tmp_path))
    assert (code, no_worker) == (2, [])
    assert err.startswith(f"paradiff: error: --cfg 2: {folder}: {reason}") and err.strip().endswith(". Use --cfg 1")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("family,options,need", [
    ("qwenimage", [], "--true-cfg-scale above 1 and --negative-prompt"),
    ("sd3", ["--guidance-scale", "1"], "--guidance-scale above 1"),
], ids=["two-calls-without-negative-prompt", "batch-at-scale-1"])
def test_cfg_on_a_call_that_does_not_guide(tiny_pipeline_folders, tmp_path, capsys, no_worker, family, options,
                                           need):
    code, err = run(capsys, "generate", str(tiny_pipeline_folders[family]), "--cfg", "2", *options,
                    "--out", str(tmp_path))
    assert (code, no_worker) == (2, [])
    assert f"runs no classifier-free guidance with these options (it needs {need};" in err, err
    assert len(err.strip().splitlines()) == 1


def test_cfg_on_a_guiding_call_passes_preflight(tiny_pipeline_folders, tmp_path, capsys, no_worker):
    code, err = run(capsys, "generate", str(tiny_pipeline_folders["sana"]), "--cfg", "2", "--out", str(tmp_path))
    assert (code, err) == (0, "") and len(no_worker) == 1


def test_tp_beyond_the_head_count(tiny_pipeline_folders, tmp_path, capsys, no_worker):
    code, err = run(capsys, "generate", str(tiny_pipeline_folders["flux2"]), "--tp", "8", "--out", str(tmp_path))
    assert (code, no_worker) == (2, [])
    assert err.startswith("paradiff: error: --tp 8: transformer (Flux2Transformer2DModel): ")
    assert "head" in err and len(err.strip().splitlines()) == 1


def test_a_valid_request_reaches_the_launcher(tiny_pipeline_folders, tmp_path, capsys, no_worker):
    code, _ = run(capsys, "generate", str(tiny_pipeline_folders["flux2"]), "--tp", "2", "--out", str(tmp_path))
    assert code == 0 and len(no_worker) == 1
