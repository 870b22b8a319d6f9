"""Adapters per sample (api/lora_slots.py): one call on a batch whose samples each run their own adapter (or none),
unmerged, every sample equal to diffusers' single-process model with only that adapter loaded; at tp2, tp2 x
ulysses2, on an int8 base, and compiled (a switch of adapters compiles no new graph)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rank_cases_lora_slots as cases
from paradiff.api.lora_slots import (enable_adapter_slots, load_slot_adapter, module_scalings,
                                     set_sample_adapters)
from paradiff.errors import AdapterError
from paradiff.tensor_parallel.lora_slots import LoraSlots, SlotIndex
from paradiff_testkit.lora import TARGETS, random_lora, save_kohya_flux_lora, save_lora
from paradiff.testing.models import build_model

RTOL = 1e-5
SAMPLES = [None, "style", "detail", "kohya"]
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def slot_loras(tmp_path_factory) -> dict[str, dict]:
    """Three FLUX.1 adapters of different ranks and formats: diffusers rank 4 (alpha 8) on every target, diffusers
    rank 16 (alpha 6) on every other one, kohya rank 8 (alpha 2) converted by diffusers."""
    root = tmp_path_factory.mktemp("slot-loras")
    model = build_model("flux")
    return {
        "style": {"path": str(save_lora(root / "style.safetensors", random_lora(model, TARGETS["flux"], 4, seed=1),
                                        rank=4, alpha=8))},
        "detail": {"path": str(save_lora(root / "detail.safetensors",
                                         random_lora(model, TARGETS["flux"][::2], 16, seed=2), rank=16, alpha=6))},
        "kohya": {"path": str(save_kohya_flux_lora(root / "kohya.safetensors", model.config, rank=8, alpha=2.0,
                                                   seed=3)), "kohya": True},
    }


def test_slot_rows_follow_their_samples_and_a_rank_above_the_slots_is_refused():
    index = SlotIndex(3)
    slots = LoraSlots(4, 2, max_loras=2, max_rank=2, index=index, dtype=torch.float32)
    a, b = torch.randn(2, 4), torch.randn(2, 2)
    slots.write(2, a, b, 0.5)
    index.set([0, 2])
    x = torch.randn(4, 3, 4)  # two copies of the two samples (CFG batched in one call)
    out = slots(x)
    assert torch.equal(out[0], torch.zeros(3, 2)) and torch.equal(out[2], torch.zeros(3, 2))
    torch.testing.assert_close(out[1], 0.5 * (x[1] @ a.T) @ b.T)
    torch.testing.assert_close(out[3], 0.5 * (x[3] @ a.T) @ b.T)
    with pytest.raises(AdapterError, match="rank 3 does not fit slots of max_lora_rank 2"):
        slots.write(1, torch.randn(3, 4), torch.randn(2, 3), 1.0)
    with pytest.raises(AdapterError, match=r"must be in 0\.\.2"):
        index.set([0, 3])
    with pytest.raises(AdapterError, match="3 batch rows for 2 sample"):
        slots(torch.randn(3, 4))


def test_scalings_are_diffusers_lora_config():
    shapes = {"a.lora_A.weight": (4, 8), "a.lora_B.weight": (8, 4), "b.lora_A.weight": (16, 8),
              "b.lora_B.weight": (8, 16)}
    assert module_scalings(shapes, None, None, "x") == {"a": 1.0, "b": 1.0}  # no alphas: alpha = rank
    assert module_scalings(shapes, {"a.alpha": 2.0, "b.alpha": 2.0}, None, "x") == {"a": 0.5, "b": 0.125}
    assert module_scalings(shapes, None, {"r": 4, "lora_alpha": 8, "rank_pattern": {"b": 16}}, "x") == \
        {"a": 2.0, "b": 0.5}


def test_mixed_batch_on_a_plain_model_and_bad_names(slot_loras, checkpoints):
    """Single process, on diffusers' own model: base + 3 adapters in one call; unknown names and full slots refused."""
    result = cases.mixed_batch("flux", str(checkpoints[("flux", "single")]), "single", slot_loras, SAMPLES)
    assert max(result["diffs"].values()) <= RTOL, result
    model = build_model("flux")
    enable_adapter_slots(model, max_loras=1, max_lora_rank=4)
    load_slot_adapter(model, "style", slot_loras["style"]["path"], use_safetensors=True)
    with pytest.raises(AdapterError, match="No adapter named 'turbo'"):
        set_sample_adapters(model, ["style", "turbo"])
    with pytest.raises(AdapterError, match="All 1 adapter slots are in use"):
        load_slot_adapter(model, "other", slot_loras["style"]["path"], use_safetensors=True)
    with pytest.raises(AdapterError, match="rank 16 on .* above max_lora_rank 4"):
        from paradiff.api.lora_slots import disable_adapter_slots

        disable_adapter_slots(model)
        enable_adapter_slots(model, max_loras=2, max_lora_rank=4)
        load_slot_adapter(model, "detail", slot_loras["detail"]["path"], use_safetensors=True)


@pytest.fixture(scope="module")
def sd3_loras(tiny_pipeline_folders, tmp_path_factory) -> dict[str, str]:
    from paradiff_testkit.lora import save_pipeline_loras

    files = save_pipeline_loras("sd3", tiny_pipeline_folders["sd3"], tmp_path_factory.mktemp("sd3-loras"))
    return {name: str(files[name]) for name in ("style", "detail")}


def test_mixed_batch_matches_diffusers_per_sample_in_every_mode(pools, checkpoints, slot_loras, tiny_pipeline_folders,
                                                               sd3_loras):
    """tp2 compiled (the first call, then a switch and an unload compile no new graph), tp2 on an int8 base, SD3's
    pipeline at cfg2 (one transformer call on the batched branches, each rank one branch: every row's adapter follows
    its sample); then tp2 x ulysses2."""
    folder = str(checkpoints[("flux", "single")])
    base = dict(family="flux", folder=folder, loras=slot_loras, samples=SAMPLES)
    two = [dict(base, mode="tp2", compiled=True), dict(base, mode="tp2", scheme="int8"),
           dict(family="sd3", folder=str(tiny_pipeline_folders["sd3"]), mode="cfg2", loras=sd3_loras,
                samples=["detail", None, "style"], pipeline=True)]
    results = pools.get(2).run(cases.mixed_batch_cases, timeout_s=900, cases=two)
    results += pools.get(4).run(cases.mixed_batch_cases, timeout_s=900, cases=[dict(base, mode="tp2xulysses2")])
    for rank_results in results:
        for result in rank_results:
            where = (result["case"]["mode"], result["case"].get("scheme"), result["rank"])
            assert max(result["diffs"].values()) <= RTOL, (where, result["diffs"])
            if result["case"].get("compiled"):
                assert max(result["switched"].values()) <= RTOL, (where, result["switched"])
                assert max(result["unloaded"].values()) <= RTOL, (where, result["unloaded"])
                assert result["graphs"]["first"] > 0
                assert result["graphs"]["after switch and unload"] == result["graphs"]["first"], where


def test_generate_with_an_adapter_column_draws_mixed_batches(tmp_path):
    """`paradiff generate --lora A --lora B --prompts-file` with an adapter column: the three prompts in one call, each
    image as diffusers draws it with only its adapter (within one level of 255: batched sums round differently)."""
    import json

    import numpy as np
    from diffusers import DiffusionPipeline

    from paradiff.cli.embedded import embedded_call_kwargs, embedded_default
    from paradiff.cli.outputs import png_bytes
    from paradiff.demo import LORA_FILE
    from paradiff_testkit import command
    from test_serve import assert_same_picture

    prompt = "a red circle on a blue background, top left"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"lora0\t{prompt}\n-\t{prompt}\nlora1\t{prompt}\n")
    out = tmp_path / "out"
    done = command.run(["-m", "paradiff.cli", "generate", "--steps", "2", "--prompts-file", str(prompts), "--lora",
                        str(LORA_FILE), "--lora", f"{LORA_FILE}:0.5", "--batch", "3", "--out", str(out)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert [report["outputs"][str(i)].get("adapter") for i in range(3)] == ["lora0", None, "lora1"], report["outputs"]
    pipeline = DiffusionPipeline.from_pretrained(str(embedded_default()))
    pipeline.set_progress_bar_config(disable=True)
    pipeline.load_lora_weights(str(LORA_FILE), adapter_name="swap")
    for index, scale in enumerate([1.0, 0.0, 0.5]):
        pipeline.set_adapters(["swap"], [scale])
        image = pipeline(prompt=prompt, generator=torch.Generator("cpu").manual_seed(index), height=64, width=64,
                         num_inference_steps=2, output_type="np", **embedded_call_kwargs()).images[0]
        assert_same_picture((out / f"{index:04d}.png").read_bytes(), png_bytes(image))
    assert np.any(np.asarray(image) != 0)


def test_an_adapter_column_names_only_lora_adapters(tmp_path):
    from paradiff.cli.args import CliError, build_parser, check_args, prompt_adapters
    from paradiff.demo import LORA_FILE

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("colour_swap\ta fox\n-\ta cat\nlora0\ta dog\n")
    args = build_parser().parse_args(["generate", "--prompt", "first", "--prompts-file", str(prompts),
                                      "--lora", str(LORA_FILE)])
    check_args(args)
    assert prompt_adapters(args) == [None, "lora0", None, "lora0"]
    prompts.write_text("turbo\ta fox\n")
    with pytest.raises(CliError, match=r"line 1: adapter 'turbo' is not a --lora adapter; valid: \['colour_swap', "
                                       r"'lora0', '-'\]"):
        check_args(args)
    args = build_parser().parse_args(["generate", "--prompts-file", str(prompts)])
    with pytest.raises(CliError, match="adapter column: give the adapters with --lora"):
        check_args(args)
