"""SANA-WM's self- and cross-attention as paradiff runs them (plans/sana_wm.py) against diffusers' own forwards in
one process, the whole-video inputs its CP plan builds, and the camera branch's refusal; the family tests
(tests/test_families.py) compare the split runs across ranks."""

from __future__ import annotations

import pytest
import torch

import rank_cases_families as cases
from paradiff.plan_tools import family_examples as examples
from paradiff.plans import sana_wm


@pytest.mark.parametrize("example", ["sana-wm", "sana-wm-softmax"])
def test_attention_forwards_equal_diffusers_on_one_process(example):
    model = examples.build_example("sana_wm", example)
    inputs = examples.example_inputs("sana_wm", example, model.config)
    inputs["frame_valid_mask"] = inputs["frame_valid_mask"][:, None, :, None, None]  # the 5-D form the model takes
    theirs = examples.forward(model, inputs)
    for block in model.blocks:
        block.attn.forward = sana_wm.SelfAttention(block.attn)
        block.cross_attn.forward = sana_wm.CrossAttention(block.cross_attn)
    ours = examples.forward(model, inputs)
    assert examples.relative_difference(ours, theirs) <= 1e-6


def test_whole_inputs_take_every_frame_mask_form_and_the_model_s_rotary_table():
    model = examples.build_example("sana_wm", "sana-wm")
    inputs = examples.example_inputs("sana_wm", "sana-wm", model.config)
    rewrite = sana_wm.context_parallel_plan(model.config).rewrite_inputs[""]
    mask = inputs["frame_valid_mask"]
    for form in (mask, mask[:, None], mask[:, None, :, None, None]):
        out = rewrite({"hidden_states": inputs["hidden_states"], "frame_valid_mask": form})
        assert torch.equal(out["frame_valid_mask"], mask[:, None])
    assert torch.equal(out["pos_embeds"], model.rope(tuple(inputs["hidden_states"].shape[-3:])))
    given = torch.ones(1)
    assert "pos_embeds" not in rewrite({"hidden_states": inputs["hidden_states"], "pos_embeds": given})


@pytest.mark.parametrize("mode", ["tp2", "ulysses2"])
def test_camera_conditions_are_refused_with_the_reason(pools, mode):
    for message in pools.get(2).run(cases.sana_wm_camera_refused, mode=mode):
        assert "camera branch's UCPE ray transforms" in message and "camera_conditions" in message, message
