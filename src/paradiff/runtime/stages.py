"""Staged execution of a pipeline call: text encoders -> transformer -> VAE.

A pipeline's own `__call__` runs the stages in that order (every prompt is encoded before the first denoising step,
and decoding comes last), so the switch from one stage to the next is the first use of a component of the next
stage: a forward of a text encoder or of the transformer, or the VAE's encode / decode. With `staged=True`, at each
switch the components of every other stage drop their weights (placeholders on the meta device keep the module
tree, hooks, config and buffers) and the new stage's components read theirs again, shard-on-read; so a rank's peak
is its largest stage, not the sum. With `staged=False` nothing is freed and the same switches only time and
measure each stage.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from paradiff.runtime.patches import set_attribute
from paradiff.runtime.wrappers import install_wrapper
from paradiff.distributed.agreement import agree
from paradiff.quant.apply import quantization_summary
from paradiff.runtime.memory import PeakMemory, parameter_bytes, release_freed_memory

STAGE_ORDER = ("text_encoders", "transformer", "vae")


def stage_of(component: str) -> str | None:
    """The stage a pipeline component belongs to, by its name in model_index.json; None: always resident."""
    if component.startswith(("text_encoder", "image_encoder")):
        return "text_encoders"
    if component.startswith(("transformer", "controlnet")):  # a ControlNet runs once per step, beside the transformer
        return "transformer"
    if component.startswith("vae"):
        return "vae"
    return None


@dataclass
class StagedComponent:
    name: str
    module: nn.Module
    stage: str
    load: Callable[[], None] | None = None  # reads the weights again (staged components only)
    free: Callable[[], None] | None = None
    # after every rank of the replica read its stage's weights: quantize what was read (a quantized component; its
    # rowwise shards take a collective in their TP group, so it runs only once all ranks agreed the read)
    settle: Callable[[], None] | None = None
    scheme: str | None = None  # the quantization paradiff applied on read ("int8", "nf4" ...), for the report


@dataclass
class StageFigures:
    """One stage on one rank, summed over the calls since the last reset (peaks: the largest)."""

    stage: str
    load_s: float = 0.0
    run_s: float = 0.0
    peak_bytes: int = 0
    parameter_bytes: int = 0
    entries: int = 0
    # what the stage's own components held while it ran (their weights are all in place then, staged or not):
    # quantized bytes (data and scales), full-precision bytes (every other parameter), and per component its
    # scheme with quant.apply.quantization_summary's counts
    quantized_bytes: int = 0
    full_precision_bytes: int = 0
    components: dict[str, dict[str, Any]] = field(default_factory=dict)


class StageRunner:
    def __init__(self, components: list[StagedComponent], modules: list[nn.Module], device: torch.device,
                 staged: bool, replica_ranks: list[int] | None) -> None:
        self.components = components
        self.modules = modules  # every module of the pipeline, for the parameter bytes held
        self.staged = staged
        self.replica_ranks = replica_ranks
        self.memory = PeakMemory(device)
        self.device = device
        self.figures = {stage: StageFigures(stage) for stage in STAGE_ORDER}
        self.current: str | None = None
        self.entered_at = 0.0

    def install(self) -> None:
        for component in self.components:
            _on_first_use(component.module, component.stage, self.enter)

    def preload_time(self, stage: str, seconds: float) -> None:
        """Time spent loading a stage's components up front (all-resident mode)."""
        self.figures[stage].load_s += seconds

    def enter(self, stage: str) -> None:
        if stage == self.current:
            return
        self._close()
        figures = self.figures[stage]
        figures.entries += 1
        if self.staged:
            for component in self.components:
                if component.stage != stage and component.free is not None:
                    component.free()
            release_freed_memory(self.device)
        self.memory.reset()
        started = time.perf_counter()
        if self.staged:
            self._load(stage)
        figures.load_s += time.perf_counter() - started
        self.current, self.entered_at = stage, time.perf_counter()

    def _load(self, stage: str) -> None:
        error = None
        try:
            for component in self.components:
                if component.stage == stage and component.load is not None:
                    component.load()
        except Exception as exc:  # noqa: BLE001 - a read failure on one rank must stop its replica's ranks
            error = exc
        if self.replica_ranks is not None:
            agree(f"paradiff stage {stage} (reading weights)", {"loaded": True}, error, ranks=self.replica_ranks)
        elif error is not None:
            raise error
        for component in self.components:
            if component.stage == stage and component.settle is not None:
                component.settle()

    def _close(self) -> None:
        if self.current is None:
            return
        figures = self.figures[self.current]
        figures.run_s += time.perf_counter() - self.entered_at
        figures.peak_bytes = max(figures.peak_bytes, self.memory.peak())
        figures.parameter_bytes = max(figures.parameter_bytes, parameter_bytes(self.modules))
        for component in self.components:
            if component.stage == self.current:
                figures.components[component.name] = {"scheme": component.scheme,
                                                      **quantization_summary(component.module)}
        held = figures.components.values()
        figures.quantized_bytes = sum(entry["quantized_bytes"] for entry in held)
        figures.full_precision_bytes = sum(entry["full_precision_bytes"] for entry in held)
        self.current = None

    @contextmanager
    def call(self) -> Iterator[None]:
        with self.memory.active():
            try:
                yield
            finally:
                self._close()

    def report(self) -> list[dict[str, Any]]:
        return [asdict(self.figures[stage]) for stage in STAGE_ORDER if self.figures[stage].entries]

    def quantization(self) -> dict[str, dict[str, Any]]:
        """Per component, what it held while its stage ran (the latest call): its scheme (None: not quantized by
        paradiff), quantized linears, quantized and full-precision bytes."""
        return {name: entry for stage in STAGE_ORDER for name, entry in self.figures[stage].components.items()}

    def reset(self) -> None:
        loads = {stage: figures.load_s for stage, figures in self.figures.items()} if not self.staged else {}
        self.figures = {stage: StageFigures(stage, load_s=loads.get(stage, 0.0)) for stage in STAGE_ORDER}


def _on_first_use(module: nn.Module, stage: str, enter: Callable[[str], None]) -> None:
    """Call enter(stage) before the module computes: before its forward, and before a VAE's encode / decode, which
    pipelines call directly."""
    install_wrapper(module, "stage_switch", lambda _args, _kwargs: enter(stage))
    for method in ("encode", "decode") if stage == "vae" else ():
        original = getattr(module, method, None)
        if callable(original):
            set_attribute(module, method, _entering(original, stage, enter), by="stages")


def _entering(method: Callable, stage: str, enter: Callable[[str], None]) -> Callable:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        enter(stage)
        return method(*args, **kwargs)

    return wrapped
