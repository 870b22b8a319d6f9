"""Wan-Animate 2's self-attention as paradiff runs it (plans/wan_animate2.py: one query frame at a time over the
slots its BlockMask lets it see) against diffusers' own processor on flex attention, in one process; the family
tests (tests/test_families.py) compare it across ranks."""

from __future__ import annotations

import torch

from paradiff.plan_tools import family_examples as examples


def test_self_attention_equals_diffusers_flex_processor_in_both_passes():
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2AttnProcessor

    from paradiff.plans.wan_animate2 import SelfAttention

    model = examples.build_example("wan_animate2", "wan-animate2")
    assert all(isinstance(block.self_attn.processor, SelfAttention) for block in model.blocks)
    inputs = examples.example_inputs("wan_animate2", "wan-animate2", model.config)
    ours = examples.forward(model, inputs)
    assert len(ours) == 4  # both passes, two samples each
    for block in model.blocks:
        block.self_attn.set_processor(WanAnimate2AttnProcessor())
    theirs = examples.forward(model, inputs)
    assert len(model.block_masks) == 1  # the mask run_example built ahead, under the key the model looks up
    assert examples.relative_difference(ours, theirs) <= 1e-6


def test_the_denoising_step_reads_the_reference_and_the_padded_slots(monkeypatch):
    from paradiff.models import wan_animate2

    model = examples.build_example("wan_animate2", "wan-animate2")
    inputs = examples.example_inputs("wan_animate2", "wan-animate2", model.config)
    step = examples.forward(model, inputs)[2:]
    # another reference changes the step only through the cache
    other = {**inputs, "extract": {**inputs["extract"],
                                   "hidden_states": [x + 1 for x in inputs["extract"]["hidden_states"]]}}
    assert examples.relative_difference(examples.forward(model, other)[2:], step) > 1e-3
    # the zero slots of the full-video layout take part in the softmax: dropping them changes the result
    original = wan_animate2._slots
    monkeypatch.setattr(wan_animate2, "_slots", lambda x, count, frames, per_frame, slot: original(
        x, count, frames, per_frame, per_frame)[:, :frames])
    assert examples.relative_difference(examples.forward(model, inputs)[2:], step) > 1e-3
