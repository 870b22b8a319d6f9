"""`paradiff.describe(model)`: every change paradiff made to a model, read back from it (runtime/describe.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paradiff
import rank_cases_describe as cases
from paradiff.distributed.failures import guarded_call
from paradiff.runtime.wrappers import install_wrapper, remove_wrapper


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_wrappers_and_their_hook_are_listed_in_order_and_gone_once_removed():
    model = Tiny()
    assert paradiff.describe(model).changes == []
    assert str(paradiff.describe(model)) == "Tiny: no changes by paradiff"
    model.proj.register_forward_hook(lambda *args: None)  # not paradiff's: not listed
    install_wrapper(model, "failure_guard", guarded_call)
    install_wrapper(model, "stage_switch", lambda args, kwargs: None)
    lines = [str(change) for change in paradiff.describe(model).changes]
    assert lines == ["(model): wrapper: stage_switch", "(model): wrapper: failure_guard",
                     "(model): forward: _registry_forward.forward (paradiff.runtime.wrappers)",
                     "(model): pre-hook: _before_hook.hook"]
    remove_wrapper(model, "failure_guard")
    remove_wrapper(model, "stage_switch")
    assert paradiff.describe(model).changes == []
    with pytest.raises(TypeError, match="takes an nn.Module, got str"):
        paradiff.describe("model")


def test_a_tp2_x_ulysses2_model_lists_its_state_sharded_classes_and_cp_hooks(pools, checkpoints):
    results = pools.get(4).run(cases.describe_a_split_model, family="flux",
                               folder=str(checkpoints[("flux", "single")]), mode="tp2xulysses2")
    for result in results:
        counts, lines = result["counts"], result["lines"]
        assert lines[0] == "(model): state: parallel on a mesh of ulysses 2, tp 2", lines[:3]
        assert "(model): wrapper: failure_guard" in lines
        assert counts["class"] >= 4 and counts["pre-hook"] >= 1 and counts["hook"] >= 1, counts
        assert any(": class: " in line and "over Linear" in line for line in lines), lines
    assert len({tuple(result["lines"]) for result in results}) == 1  # every rank made the same changes


def test_every_patch_of_a_tp2_x_ulysses2_model_with_lora_and_cache_is_listed_and_removing_them_gives_it_back(pools):
    """Issue 37's check, at world 4 (the data and CFG dimensions patch the pipeline, not the model): each patch is
    listed, `remove_patches` undoes them all, and the model, its weights loaded again (the split gave the full ones up),
    gives its unpatched output bit for bit."""
    results = pools.get(4).run(cases.patches_removed_give_the_plain_model_back, family="flux", mode="tp2xulysses2")
    for result in results:
        assert result["adapted_differs"], "the adapter changed nothing: the check would prove nothing"
        assert {"replace_module", "class_swap", "set_attribute", "pre_hook", "hook"} <= set(result["kinds"]), result
        assert {"tp", "cp", "lora", "cache", "wrappers"} <= set(result["mechanisms"]), result["mechanisms"]
        assert result["removed"] == result["remaining"] > 0 and result["left"] == 0, result
        assert result["changed"] == [] and result["missing"] == [], result
        assert result["released_blocks"] >= 2 and result["released"] > 0, result  # no full weight kept by a rank
        assert result["bitwise"], result
    assert len({tuple(result["listed"]) for result in results}) == 1  # every rank made the same patches


def test_every_patch_of_a_tp2_x_ulysses2_x_cfg2_pipeline_quantized_with_lora_and_cache_is_listed_and_removed(
        pools, tiny_pipeline_folders, tmp_path):
    """Issue 37's check on a whole pipeline at world 8: Qwen-Image (two transformer calls per step, so cfg2 patches
    the pipeline and its guider) at tp2 x ulysses2 x cfg2, its transformer in int8 (torchao, quantized while read),
    a LoRA adapter (on the transformer: the only component Qwen-Image's loader adapts), a first-block cache: every patch is listed (the same on
    every rank), `remove_patches(pipeline)` undoes them all, and with each component's weights loaded again the
    pipeline is diffusers' own again: its classes, and its latents bit for bit."""
    from paradiff_testkit.lora import save_pipeline_loras

    folder = tiny_pipeline_folders["qwenimage"]
    lora = save_pipeline_loras("qwenimage", folder, tmp_path)["style"]
    results = pools.get(8).run(cases.pipeline_patches_removed_give_the_plain_pipeline_back, family="qwenimage",
                               folder=str(folder), lora=str(lora), mode="tp2xulysses2xcfg2", scheme="int8",
                               steps=2, timeout_s=600)
    for result in results:
        assert {"tp", "cp", "lora", "cache", "wrappers", "pipeline"} <= set(result["mechanisms"]), result["mechanisms"]
        assert {"", "transformer", "text_encoder", "vae"} <= set(result["patched"]), result["patched"]
        assert {"replace_module", "replace_parameter", "class_swap", "set_attribute", "wrap_forward", "pre_hook",
                "hook", "moved_hooks"} <= set(result["kinds"]), result["kinds"]
        assert "cfg_exchange" in result["wrapped"]["transformer"], result["wrapped"]
        assert result["quantized"] > 0 and result["quantized_after"] == 0, result  # int8 on, then the plain weights
        assert result["removed"] == result["remaining"] > 0 and result["left"] == 0, result
        assert result["wrapped_after"] == [], result["wrapped_after"]
        assert result["released"] > 0, result  # no rank kept the full weights: they were read again
        assert result["classes"] == [], result["classes"]
        assert result["adapted_differs"], "the patched pipeline gave diffusers' latents: nothing was applied"
        assert result["bitwise"], result
    # every rank made the same patches; what they put there differs between the two TP ranks only (the vocabulary's
    # uneven rows: 401 and 400 of 801)
    assert len({tuple(result["placed"]) for result in results}) == 1
    assert len({tuple(result["listed"]) for result in results}) == 2
