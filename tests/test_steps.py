"""A pipeline call's denoising steps (runtime/steps.py): each parallelism's step hooks once per step, in order, the
scheduler patched for the call only, a copy of it left with its own step. In process, no ranks."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from torch import nn

from paradiff.runtime.patches import patches
from paradiff.runtime.steps import StepHooks


class Recorder:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def before_step(self, model: nn.Module, step: int) -> None:
        self.log.append((self.name, "before", step))

    def after_step(self, model: nn.Module, step: int) -> None:
        self.log.append((self.name, "after", step))


def _denoise(model: nn.Module, scheduler, steps: int, calls_per_step: int, copy_scheduler: bool = False):
    """A flow-matching loop as diffusers' pipelines run it: the transformer `calls_per_step` times, then one step."""
    scheduler.set_timesteps(steps)
    other = copy.deepcopy(scheduler) if copy_scheduler else None  # a second stream's scheduler (LTX-2's audio)
    latents = torch.ones(1, 4)
    for timestep in scheduler.timesteps:
        with torch.no_grad():
            prediction = sum(model(latents) for _ in range(calls_per_step)) / calls_per_step
        if other is not None:
            other.step(prediction, timestep, latents)
        latents = scheduler.step(prediction, timestep, latents).prev_sample
    return latents, other


@pytest.mark.parametrize("calls_per_step", [1, 2])
def test_each_hook_runs_once_per_step_in_order_and_the_output_is_unchanged(calls_per_step):
    torch.manual_seed(0)
    model, log, steps = nn.Linear(4, 4), [], 3
    expected, _ = _denoise(model, FlowMatchEulerDiscreteScheduler(), steps, calls_per_step)
    hooks = StepHooks(((Recorder("first", log), model), (Recorder("second", log), model)))
    hooks.install([model])
    scheduler = FlowMatchEulerDiscreteScheduler()
    with hooks.call(scheduler):
        assert [str(patch) for _, patch in patches(scheduler)] == ["set_attribute step: close the denoising step "
                                                                  "(by steps)"]
        actual, other = _denoise(model, scheduler, steps, calls_per_step, copy_scheduler=True)
    assert torch.equal(actual, expected)
    assert log == [(name, hook, step) for step in range(steps) for hook in ("before", "after")
                   for name in ("first", "second")]
    assert hooks.last_call_steps == steps
    assert patches(scheduler) == [] and "step" not in scheduler.__dict__  # the call's patch is off again
    assert other.step.__self__ is other  # the copy steps itself, closing nothing


def test_a_step_no_scheduler_closes_is_closed_when_the_call_ends():
    model, log = nn.Linear(4, 4), []
    hooks = StepHooks(((Recorder("only", log), model),))
    hooks.install([model])
    with hooks.call(None):
        model(torch.ones(1, 4))
        model(torch.ones(1, 4))
    assert log == [("only", "before", 0), ("only", "after", 0)] and hooks.last_call_steps == 1


def test_cfg_closes_each_steps_pair_and_refuses_a_step_of_one_call():
    """CFG's per-step duty (`CfgModel.after_step`): a two-call step's pair is whole and the next call is a first
    branch again; a step of one call is refused there, naming the step, instead of pairing with the next step's."""
    from paradiff.errors import ParallelConfigError
    from paradiff.runtime.cfg import CfgSplitter

    splitter = CfgSplitter(group=None, cfg_rank=0)  # cfg rank 0's first call of a pair needs no collective
    forward = lambda x: 2 * x  # noqa: E731
    splitter(forward, (torch.ones(1),), {})
    with pytest.raises(ParallelConfigError, match="at denoising step 4 it made 1 call"):
        splitter.step_done(4)
    splitter.calls = 2
    splitter.step_done(5)
    assert splitter.calls == 0
