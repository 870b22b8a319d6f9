"""The embedded demo pipeline: it draws what it is asked (also for combinations it never saw), the parallel images
equal the single-process ones in every mode `paradiff generate` offers on 4 ranks, and its training runs."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np
import torch

import rank_cases_demo as cases
from demo_judge import judge, parse, score
from paradiff.demo import CALL_KWARGS, DEFAULT_PROMPTS, DEFAULT_STEPS, pipeline_path
from paradiff.demo.shapes import HELD_OUT, combinations
from paradiff_testkit import command
from paradiff_testkit.beside import beside

REPO = Path(__file__).resolve().parents[1]

# Eight prompts the model was trained on and eight combinations it never saw, in every caption form.
TRAINED = [
    "a red circle on a blue background",
    "a large green square on a black background, top right",
    "a small white triangle on a purple background",
    "a yellow circle on a green background, bottom left",
    "a large purple square on an orange background",
    "a black triangle on a white background, center",
    "a small blue square on a yellow background, bottom right",
    "a large orange circle on a red background, top left",
]
HELD = [
    "a large red circle on a yellow background",
    "a red square on a purple background, top left",
    "a small green triangle on a white background, center",
    "a large blue triangle on a purple background, bottom right",
    "a large yellow circle on a white background, top right",
    "an orange square on a black background",
    "a large purple circle on a blue background, bottom left",
    "a black square on a blue background",
]


def _random_weight_images(prompts: list[str]) -> np.ndarray:
    """The shipped pipeline with a freshly initialised transformer: what the rule says of untrained weights."""
    from diffusers import DiffusionPipeline, Flux2Transformer2DModel

    pipeline = DiffusionPipeline.from_pretrained(pipeline_path())
    torch.manual_seed(0)
    pipeline.transformer = Flux2Transformer2DModel.from_config(pipeline.transformer.config).eval()
    pipeline.set_progress_bar_config(disable=True)
    return pipeline(prompt=prompts, generator=torch.Generator().manual_seed(0), num_inference_steps=DEFAULT_STEPS,
                    output_type="np", **CALL_KWARGS).images


def test_test_prompts_are_trained_and_held_out_combinations():
    trained = set(combinations(held_out=False))
    assert all(parse(p) in trained for p in TRAINED)
    assert all(parse(p) in set(HELD_OUT) for p in HELD)
    assert len(set(map(parse, HELD))) == len(HELD) == 8
    assert sum(parse(p) in set(HELD_OUT) for p in DEFAULT_PROMPTS) == len(DEFAULT_PROMPTS) // 2


def test_parallel_demo_draws_what_it_is_asked(pools):
    prompts = TRAINED + HELD
    # the untrained pipeline's pictures are drawn here while the ranks draw the trained ones
    results, untrained_images = beside(
        lambda: _random_weight_images(prompts),
        lambda: pools.get(4).run(cases.generate_batch, folder=str(pipeline_path()), degrees=dict(tp=2, ulysses=2),
                                 prompts=prompts, steps=DEFAULT_STEPS, seed=0))
    images = [r["images"] for r in results if r["images"] is not None]
    assert len(images) == 1 and images[0].shape == (16, 64, 64, 3)
    full = sum(p.numel() for p in _transformer().parameters())
    assert all(r["transformer_params"] < 0.6 * full for r in results)  # tp=2 really split the weights
    found = score(prompts, list(images[0]))
    held = score(HELD, list(images[0][len(TRAINED):]))
    report = {p: judge(im) for p, im in zip(prompts, images[0])}
    print("judged:", found, "held-out half:", held)
    assert found["background"] >= 0.9 and found["colour"] >= 0.9 and found["shape"] >= 0.7, (found, report)
    assert held["background"] >= 0.75 and held["colour"] >= 0.75 and held["shape"] >= 0.6, (held, report)
    untrained = score(prompts, list(untrained_images))
    assert untrained["background"] < 0.5 and untrained["colour"] < 0.5 and untrained["shape"] < 0.7, untrained


# Every combination of --tp, --ulysses, --ring and --dp whose product is 4 that the demo pipeline can take (its 4
# heads allow tp 1, 2, 4). paradiff splits text encoders over the TP ranks (with no TP, the context-parallel ranks):
# the demo's text encoder has 2 heads, so where that group has 4 ranks it stays whole on each rank, by itself (a
# warning says so); --whole-text-encoders keeps it whole anyway (tp2 x ring2). --cfg 2 needs true CFG, which
# Flux2Pipeline does not run.
WHOLE = dict(whole_text_encoders=True)
MODES = [dict(tp=4), dict(ulysses=4), dict(ring=4), dict(tp=2, ulysses=2),
         dict(tp=2, ring=2, **WHOLE), dict(ring=2, ulysses=2), dict(dp=2, tp=2), dict(dp=2, ulysses=2),
         dict(dp=2, ring=2), dict(dp=4)]
# The text encoder's group in each mode: 2 ranks split it; 4 ranks cannot (2 heads); none keeps it whole.
ENCODER_SPLIT = {0: 1, 1: 1, 2: 1, 3: 2, 4: 1, 5: 1, 6: 2, 7: 2, 8: 2, 9: 1}


def test_parallel_images_equal_single_process_in_every_mode(pools):
    from diffusers import DiffusionPipeline

    prompts, steps, seed = [DEFAULT_PROMPTS[1], DEFAULT_PROMPTS[4]], 2, 3
    # after the ranks, not beside them (paradiff_testkit.beside): 4 ranks already fill the 2 cores, and a fifth
    # computing process made this test slower in both paired measurements (64.5 -> 78.5 s, 57.7 -> 58.6 s)
    results = pools.get(4).run(cases.generate_in_modes, folder=str(pipeline_path()), modes=MODES, prompts=prompts,
                               steps=steps, seed=seed)
    reference = DiffusionPipeline.from_pretrained(pipeline_path())
    reference.set_progress_bar_config(disable=True)
    expected = [reference(prompt=p, generator=torch.Generator().manual_seed(seed + i), num_inference_steps=steps,
                          output_type="np", **CALL_KWARGS).images[0] for i, p in enumerate(prompts)]
    full = sum(p.numel() for p in reference.transformer.parameters())
    for position, degrees in enumerate(MODES):
        per_rank = [r[position] for r in results]
        made = {}
        for result in per_rank:
            for index, image in result["images"].items():
                assert index not in made, (degrees, index)  # one output rank per image
                made[index] = image
        assert sorted(made) == [0, 1], degrees
        for index, image in made.items():
            worst = float(np.abs(image - expected[index]).max())
            assert worst <= 1 / 255, (degrees, index, worst)
        if degrees.get("tp", 1) > 1:
            assert all(r["transformer_params"] < 0.6 * full for r in per_rank), degrees
        encoder = sum(p.numel() for p in reference.text_encoder.parameters())
        split = ENCODER_SPLIT[position]
        held = [r["text_encoder_params"] for r in per_rank]
        if split == 1:
            assert held == [encoder] * 4, (degrees, held, encoder)
        else:  # about half: norms (and the unused vision tower) stay whole
            assert all(0.4 * encoder < h < 0.75 * encoder for h in held), (degrees, held, encoder)


def test_compare_png_shows_single_parallel_and_amplified_difference(tmp_path):
    from PIL import Image

    from paradiff.cli.compare import AMPLIFY, write_compare_png

    single = np.full((8, 8, 3), 0.4)
    parallel = single.copy()
    parallel[3, 4, 1] += 1 / 255
    write_compare_png(tmp_path / "compare.png", [(single, parallel)], scale=1)
    page = np.asarray(Image.open(tmp_path / "compare.png").convert("RGB"))[14:]  # below the labels
    left, middle, right = page[:8, 0:8], page[:8, 10:18], page[:8, 20:28]
    assert (left == 102).all() and middle[3, 4, 1] == 103 and (np.delete(middle.reshape(-1), 3 * 24 + 13) == 102).all()
    assert right[3, 4, 1] == AMPLIFY and right.sum() == AMPLIFY  # black where they agree


@functools.cache
def _transformer():
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel.from_pretrained(pipeline_path(), subfolder="transformer")


def test_shipped_pipeline_is_small_and_ships_with_the_package():
    folder = pipeline_path()
    weights = sum(p.stat().st_size for p in folder.rglob("*.safetensors"))
    assert 0 < weights <= 20 * 2**20, weights
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2Pipeline"
    assert {"tokenizer", "text_encoder", "vae", "transformer", "scheduler"} <= set(index)
    config = _transformer().config
    assert config.num_attention_heads % 4 == 0 and config.num_layers >= 2 and config.num_single_layers >= 2
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"assets/demo/**/*"' in pyproject


def test_training_script_runs_deterministically_and_its_losses_fall(tmp_path):
    """A shortened run (a few steps per stage), twice at once: the same weights, falling losses, a loadable
    pipeline. The full run is `python tools/train_demo.py` (docs/cli.md, "The demo")."""
    runs = []
    try:
        for name in ("a", "b"):
            runs.append(command.start([str(REPO / "tools" / "train_demo.py"), "--quick", "--out", str(tmp_path / name),
                                       "--work", str(tmp_path / f"work-{name}")],
                                      env=dict(os.environ, PYTHONPATH=str(REPO / "src"))))
        for run in runs:
            output, errors = run.communicate(timeout=600)
            assert run.returncode == 0, (output + errors)[-3000:]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
    from safetensors.torch import load_file

    for component in ("vae", "transformer"):
        (a,) = (tmp_path / "a" / component).glob("*.safetensors")
        b = tmp_path / "b" / component / a.name
        first, second = load_file(a), load_file(b)
        assert all(torch.equal(first[k], second[k]) for k in first), component
    records = [json.loads(line) for line in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    for stage in ("vae", "transformer"):
        losses = [r["loss"] for r in records if r["stage"] == stage]
        assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), (stage, losses)
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(tmp_path / "a")
    pipeline.set_progress_bar_config(disable=True)
    image = pipeline(prompt=DEFAULT_PROMPTS[0], num_inference_steps=2, output_type="np", **CALL_KWARGS).images[0]
    assert image.shape == (64, 64, 3)
