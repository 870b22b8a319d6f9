"""The per-step lifecycle of a pipeline call: each enabled parallelism's `before_step` / `after_step`, once per
denoising step, on every rank.

diffusers pipelines have no step event of their own that every pipeline sends (`callback_on_step_end` is optional,
and the caller's), so a step is read from what every denoising loop does: it calls the transformer (once, twice
for two-call CFG, or once per guider branch) and then the scheduler's `step`. A step opens at its first transformer
call (a recorded forward pre-hook on each transformer, after the stage switch and the latent check: the weights are
in place) and closes when `scheduler.step` returns (its `step` shadowed for the call's duration, a recorded patch
taken off again at the call's end: the user may put another scheduler in between calls). A step still open when
the call ends (a pipeline that calls no scheduler after its last transformer call) is closed then, so every
`before_step` has its `after_step`. Every rank runs the same loop, so every rank runs the same hooks at the same
steps: no hook decides alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from torch import nn

from paradiff.runtime.patches import add_hook, remove_patch, set_attribute


@dataclass
class StepHooks:
    """The (parallelism, model) pairs whose hooks a pipeline runs per step, in the order given (the registry's
    apply order, transformer by transformer), and where the current call is."""

    hooks: tuple[tuple[Any, nn.Module], ...]
    step: int = 0  # the step the current call is in (or will open next)
    open: bool = False
    last_call_steps: int = 0  # the steps the last call ran (for reports and tests)

    def install(self, models: list[nn.Module]) -> None:
        """Open a step at the first call of any of `models` (a recorded pre-hook on each)."""
        for model in models:
            add_hook(model, self._model_called, by="steps", pre=True)

    @contextlib.contextmanager
    def call(self, scheduler: Any) -> Iterator[None]:
        """One pipeline call: steps counted from 0; `scheduler` (None: the pipeline has none, and the call is one
        step) closes each step when it steps."""
        self.step, self.open = 0, False
        patch = None
        if scheduler is not None and callable(getattr(scheduler, "step", None)):
            patch = set_attribute(scheduler, "step", _StepThenClose(scheduler, scheduler.step, self), by="steps",
                                  what="close the denoising step")
        try:
            yield
            self.close()  # a step the scheduler did not close (it never ran after the last transformer call)
        finally:
            self.open = False
            if patch is not None:
                remove_patch(scheduler, patch)
            self.last_call_steps = self.step

    def _model_called(self, _module: nn.Module, _args: tuple) -> None:
        if not self.open:
            self.open = True
            for parallelism, model in self.hooks:
                parallelism.before_step(model, self.step)

    def close(self) -> None:
        """Close the open step, if one is (a scheduler step with no transformer call before it closes none)."""
        if self.open:
            self.open = False
            for parallelism, model in self.hooks:
                parallelism.after_step(model, self.step)
            self.step += 1


class _StepThenClose:
    """The scheduler's `step`, then the open denoising step closed. Pipelines copy their scheduler for a second
    stream (LTX-2's audio, SkyReels-V2's per-chunk samples: `copy.deepcopy(self.scheduler)`): the copy gets its own
    class `step`, neither this scheduler's nor a step hook."""

    def __init__(self, scheduler: Any, plain: Any, hooks: StepHooks) -> None:
        self.scheduler, self.plain, self.hooks = scheduler, plain, hooks

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.plain(*args, **kwargs)
        self.hooks.close()
        return output

    def __deepcopy__(self, memo: dict) -> Any:
        copy = memo.get(id(self.scheduler))  # the scheduler being copied, when it is (deepcopy registers it first)
        return self if copy is None else type(copy).step.__get__(copy)
