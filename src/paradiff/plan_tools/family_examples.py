"""Tiny example models and inputs from the families' `examples`, and how to measure a forward on them.

`paradiff check-plan` and the test suite use these to run every plan single-process and in parallel; benchmarks
use the same measurements. Nothing here issues a collective.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from paradiff.runtime.patches import add_hook
from paradiff.errors import PlanError
from paradiff.plan_tools.example_inputs import materialize
from paradiff.plans import families, family_of
from paradiff.plans.common import Grid
from paradiff.plans.family import Family

# Projection ops: the work a split must divide. Attention kernels are left out on purpose: torch's counter knows
# the CUDA kernels but not the CPU flash kernel, so counting them would compare different kernels, not splits.
PROJECTION_OPS = ("mm", "addmm", "convolution", "_convolution")


def all_examples() -> list[tuple[str, str, str]]:
    """(family module name, example name, class name) of every built-in example."""
    found = []
    for family in families():
        for name, (class_name, _config) in family.examples.items():
            found.append((family.name, name, class_name))
    return found


def family_module(family: str) -> Family:
    """The family declared by plans/<family>.py."""
    for declared in families():
        if declared.name == family:
            return declared
    raise PlanError(f"Unknown plan family {family!r}; families: {[f.name for f in families()]}.")


def model_class(class_name: str) -> type:
    import diffusers

    cls = getattr(diffusers, class_name, None)
    if cls is None:
        raise PlanError(f"diffusers {diffusers.__version__} has no model class {class_name!r}.")
    return cls


def build_example(family: str, example: str, seed: int = 0, config_overrides: dict | None = None) -> nn.Module:
    """The example's model with random weights; biases and norms perturbed too, so a wrong slice cannot hide
    behind zeros or ones."""
    module = family_module(family)
    class_name, config = module.examples[example]
    torch.manual_seed(seed)
    model = model_class(class_name)(**{**config, **(config_overrides or {})})
    with torch.no_grad():
        if module.init_example is not None:  # parameters the class leaves uninitialised (torch.empty)
            module.init_example(model)
        for param in model.parameters():
            if param.is_floating_point():
                param.add_(torch.randn_like(param) * 0.05)
    # a family whose own kernel torch's FLOP counter cannot run (eager flex attention) swaps in an equivalent one,
    # checked equal to the model's in its family's tests
    if module.prepare_example is not None:
        module.prepare_example(model)
    return model.eval()


def example_inputs(family: str, example: str, config: Any, batch: int = 2, grid: Grid = Grid(), seed: int = 1) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return family_inputs(family_module(family), example, config, batch, grid, generator)


def family_inputs(family: Family, example: str, config: Any, batch: int, grid: Grid,
                  generator: torch.Generator) -> dict:
    """The family's inputs for `example`: its `INPUTS` declaration materialized."""
    return materialize(family.example_inputs, example, config, batch, grid, generator)


def output_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor of a model's output, in order: ModelOutputs, tuples, lists (Z-Image's per-sample lists), dicts
    and bare tensors alike."""
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, dict):  # ModelOutput is an OrderedDict
        return [t for value in output.values() for t in output_tensors(value)]
    if isinstance(output, (list, tuple)):
        return [t for value in output for t in output_tensors(value)]
    return []


def relative_difference(actual: Iterable[torch.Tensor], expected: Iterable[torch.Tensor]) -> float:
    """max |actual - expected| / max |expected| over all output tensors; shapes must match."""
    actual, expected = list(actual), list(expected)
    if len(actual) != len(expected):
        raise AssertionError(f"{len(actual)} output tensors, expected {len(expected)}")
    worst, scale = 0.0, 0.0
    for a, e in zip(actual, expected):
        if a.shape != e.shape:
            raise AssertionError(f"output shape {tuple(a.shape)}, expected {tuple(e.shape)}")
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(e).all())):
            return float("inf")  # a NaN would otherwise compare as no difference at all
        worst = max(worst, float((a.double() - e.double()).abs().max()) if a.numel() else 0.0)
        scale = max(scale, float(e.double().abs().max()) if e.numel() else 0.0)
    return worst / max(scale, 1e-30)


def block_stacks(model: nn.Module) -> list[str]:
    """Names of the model's top-level nn.ModuleLists: its stacks of transformer blocks."""
    return [name for name, child in model.named_children() if isinstance(child, nn.ModuleList) and len(child)]


def forward(model: nn.Module, inputs: dict) -> list[torch.Tensor]:
    """The outputs of `model(**inputs)`, or of the model's family's `run_example(model, inputs)` where the family
    defines one (a model run as a sequence of calls, e.g. a cache-filling pass then a pass reading the cache)."""
    family = family_of(model)
    run = None if family is None else family.run_example
    with torch.no_grad():
        return output_tensors(run(model, inputs) if run is not None else model(**inputs))


def forward_with_flops(model: nn.Module, inputs: dict) -> tuple[list[torch.Tensor], int]:
    """The forward's outputs and the projection FLOPs this process spent inside the block stacks."""
    with BlockProjectionFlops(model) as counter:
        outputs = forward(model, inputs)
    return outputs, counter.flops


class BlockProjectionFlops(TorchDispatchMode):
    """The FLOPs of the projection ops (PROJECTION_OPS, by torch's own FLOP formulas) run while a block of one of
    the model's block stacks is in its forward, an op inside n such blocks at once counted n times: what torch's
    FlopCounterMode attributes to those blocks, without its tracking of every module (which cost more than the
    forward itself on the tiny examples)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.flops = 0
        self._active = 0
        self._blocks = [block for name in block_stacks(model) for block in model.get_submodule(name)]
        self._handles: list = []

    def __enter__(self):
        for block in self._blocks:
            self._handles.append(add_hook(block, self._enter, by="flop_count", pre=True))
            self._handles.append(add_hook(block, self._leave, by="flop_count", always_call=True))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._active:  # an exception left a block without its post-hook
            self._active = 0
            super().__exit__(*exc)
        return False

    # The mode is on the dispatch stack only while a block runs: the ops outside the blocks (embeddings, the final
    # projection, the inputs' preparation) pay nothing for being counted.
    def _enter(self, module, args) -> None:
        self._active += 1
        if self._active == 1:
            super().__enter__()

    def _leave(self, module, args, output) -> None:
        self._active -= 1
        if self._active == 0:
            super().__exit__(None, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._active:
            count = _PROJECTION_FLOPS.get(func.overloadpacket)
            if count is not None:
                # torch's formula on shapes: its registered wrapper maps every argument to its shape through a
                # pytree walk, which cost more than the op on the tiny examples; these ops take their tensors as
                # plain arguments and return one tensor, so a flat map gives the formula the same shapes
                self.flops += self._active * count(*[_shape(arg) for arg in args],
                                                   **{key: _shape(value) for key, value in kwargs.items()},
                                                   out_shape=out.shape)
        return out


def _shape(value: Any) -> Any:
    return value.shape if isinstance(value, torch.Tensor) else value


# torch's FLOP formulas on shapes (the registry's entries wrap them: functools.wraps keeps them as __wrapped__)
_PROJECTION_FLOPS = {getattr(torch.ops.aten, name): flop_registry[getattr(torch.ops.aten, name)].__wrapped__
                     for name in PROJECTION_OPS}


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def block_parameter_bytes(model: nn.Module) -> int:
    """Parameter bytes this process holds inside the block stacks (where TP must split the weights)."""
    return sum(parameter_bytes(model.get_submodule(name)) for name in block_stacks(model))
