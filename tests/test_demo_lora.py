"""The demo LoRA (src/paradiff/assets/demo/lora, trained by tools/train_demo_lora.py): loaded through the real path
on a tp2 x ulysses2 mesh it gives diffusers' single-process LoRA result, and it swaps the shape's colour and the
background's, as the demo's pixel rule (tests/demo_judge.py) sees it; without it, nothing is swapped."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import rank_cases_cli as cli_cases
import rank_cases_demo as cases
from demo_judge import judge, parse
from paradiff.cli.args import CliError, build_parser, check_args
from paradiff.demo import LORA_FILE, pipeline_path
from paradiff_testkit import command

REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-5
pytest.importorskip("peft")

# Trained and held-out combinations (paradiff.demo.shapes.HELD_OUT), with and without size and place.
PROMPTS = [
    "a red circle on a blue background",
    "a large red circle on a yellow background, top left",
    "a yellow square on a purple background, center",
    "a large green triangle on a white background, bottom right",
    "a black square on an orange background",
    "a small blue square on a yellow background, bottom right",
]


def _image(path: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"))


def test_demo_lora_on_tp2_x_ulysses2_swaps_the_colours_and_equals_diffusers(pools, tmp_path):
    """`paradiff generate --tp 2 --ulysses 2 --compare --lora colour_swap.safetensors --also-without-lora`, as
    `make demo` runs it, in the 4-rank pool: every image, with and without the adapter, equals diffusers' own
    single-process result; the rule finds the two colours swapped with the adapter and as asked without it."""
    argv = ["generate", "--tp", "2", "--ulysses", "2", "--compare", "--lora", str(LORA_FILE), "--also-without-lora",
            "--out", str(tmp_path)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    (result,) = pools.get(4).run(cli_cases.generate_each, timeout_s=600, runs=[argv])[0]
    report = result["report"]
    assert result["local_params"] < 0.6 * result["whole_params"]  # tp=2 split the transformer
    assert report["compared_outputs"] == 2 * len(PROMPTS)
    assert report["max_abs_diff_vs_single_process"] <= RTOL, report["max_abs_diff_vs_single_process"]
    assert report["max_abs_diff_without_lora_vs_single_process"] <= RTOL
    assert report["loras"] == [{"adapter_name": "lora0", "path": str(LORA_FILE), "scale": 1.0}]
    assert Path(report["compare_png"]).is_file()
    adapted = [judge(_image(report["images"][str(i)])) for i in range(len(PROMPTS))]
    plain = [judge(_image(report["without_lora"][str(i)])) for i in range(len(PROMPTS))]
    wanted = [parse(prompt) for prompt in PROMPTS]
    swapped = [found[1:] == (background, colour) for found, (_, colour, background) in zip(adapted, wanted)]
    as_asked = [found[1:] == (colour, background) for found, (_, colour, background) in zip(plain, wanted)]
    shape_kept = [found[0] == shape for found, (shape, _, _) in zip(adapted, wanted)]
    report_lines = {prompt: (p, a) for prompt, p, a in zip(PROMPTS, plain, adapted)}
    assert all(swapped), report_lines
    assert all(as_asked), report_lines
    assert sum(shape_kept) >= len(PROMPTS) - 1, report_lines  # the adapter swaps colours, not shapes


def test_demo_lora_forward_on_tp2_x_ulysses2_reads_slices_and_equals_diffusers(pools):
    """`load_lora_adapter` of the shipped file on the split transformer: each rank reads only its slices; one
    forward equals diffusers' LoRA on the unsplit transformer, and the adapter changes that output."""
    results = pools.get(4).run(cases.lora_forward, folder=str(pipeline_path()), lora=str(LORA_FILE),
                               degrees=dict(tp=2, ulysses=2))
    from safetensors.torch import load_file

    full = sum(t.numel() * t.element_size() for t in load_file(LORA_FILE).values())
    for result in results:
        assert result["rel_diff"] <= RTOL, result
        assert result["lora_effect"] > 0.05, result
        assert result["sliced"] == 28 and 0 < result["bytes_read"] == result["local_bytes"] < 0.8 * full, result


def test_shipped_demo_lora_is_a_small_diffusers_lora_file():
    from safetensors import safe_open

    assert 0 < LORA_FILE.stat().st_size <= 400_000
    with safe_open(str(LORA_FILE), "pt") as handle:
        keys, metadata = list(handle.keys()), handle.metadata()
        ranks = {handle.get_tensor(k).shape[0] for k in keys if k.endswith("lora_A.weight")}
    assert keys and all(k.startswith("transformer.") and (".lora_A." in k or ".lora_B." in k) for k in keys)
    config = json.loads(metadata["lora_adapter_metadata"])
    assert ranks == {config["transformer.r"]} and 4 <= config["transformer.r"] <= 8
    assert len(config["transformer.target_modules"]) == len(keys) // 2
    log = [json.loads(line) for line in (LORA_FILE.parent / "train_log.jsonl").read_text().splitlines()]
    losses = [record["loss"] for record in log]
    assert len(losses) >= 100 and np.mean(losses[-50:]) < 0.5 * np.mean(losses[:10])


def test_also_without_lora_needs_lora(tmp_path):
    args = build_parser().parse_args(["generate", "--also-without-lora", "--out", str(tmp_path)])
    with pytest.raises(CliError, match="--also-without-lora .* give --lora too"):
        check_args(args)


@pytest.mark.slow  # two subprocesses
def test_lora_training_script_runs_deterministically(tmp_path):
    """tools/train_demo_lora.py --quick, twice at once: the same factors, saved in a file diffusers loads."""
    runs = []
    try:
        for name in ("a", "b"):
            runs.append(command.start([str(REPO / "tools" / "train_demo_lora.py"), "--quick", "--out",
                                       str(tmp_path / name)], env=dict(os.environ, PYTHONPATH=str(REPO / "src"))))
        for run in runs:
            output, errors = run.communicate(timeout=300)
            assert run.returncode == 0, (output + errors)[-3000:]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
    from safetensors.torch import load_file

    first, second = (load_file(tmp_path / name / LORA_FILE.name) for name in ("a", "b"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert any(k.endswith("lora_B.weight") and first[k].abs().max() > 0 for k in first)  # the factors trained
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(pipeline_path())
    pipeline.load_lora_weights(tmp_path / "a" / LORA_FILE.name, adapter_name="quick")
    assert pipeline.get_active_adapters() == ["quick"]
