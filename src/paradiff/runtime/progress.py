"""Progress of long work: bars on rank 0 when stderr is a terminal (silence otherwise), and the per-step events and
times of denoising that the CLI's bar, report.json and the server's progress, metrics and previews read."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch.distributed as dist


def is_main_rank() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


@contextmanager
def byte_progress(total: int, description: str, enabled: bool | None = None) -> Iterator[callable]:
    """Yield an `advance(nbytes)` callback; the bar shows only on rank 0 and only on a terminal unless forced."""
    show = is_main_rank() and (sys.stderr.isatty() if enabled is None else enabled)
    if not show:
        yield lambda nbytes: None
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=description, file=sys.stderr)
    try:
        yield bar.update
    finally:
        bar.close()


@dataclass
class StepEvent:
    """One denoising step ended, on the rank that makes a replica's outputs: what step callbacks (the server's
    progress and previews, `generate`'s bar and per-step times) are given. `latents` are the pipeline's, after the
    step: read them, never change them."""

    step: int  # steps done in this call, 1 to steps
    steps: int
    seconds: float  # this step's wall time
    latents: Any = None  # None where the pipeline's callback hands none
    context: dict = field(default_factory=dict)  # what the caller runs: work item ids, sizes, previews asked for


class StepClock:
    """Per-step wall times of pipeline calls, from the step-end callback: `begin()` before a call, `tick()` at each
    step end returns that step's seconds; `times` keeps them all."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def begin(self) -> None:
        self._last = time.perf_counter()

    def tick(self) -> float:
        now = time.perf_counter()
        seconds = now - (self._last if self._last is not None else now)
        self._last = now
        self.times.append(seconds)
        return seconds


@contextmanager
def step_progress(total: int, description: str, enabled: bool | None = None) -> Iterator[callable]:
    """Yield an `advance(steps)` callback for a bar of denoising steps: on rank 0 only, on a terminal unless forced
    (`enabled`)."""
    show = is_main_rank() and (sys.stderr.isatty() if enabled is None else enabled)
    if not show:
        yield lambda steps=1: None
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="step", desc=description, file=sys.stderr)
    try:
        yield bar.update
    finally:
        bar.close()
