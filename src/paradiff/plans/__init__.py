"""Built-in plans, one short module per model family, looked up by the model's class name."""

from __future__ import annotations

from types import ModuleType

from torch import nn

from ..errors import PlanError
from . import flux, flux2, qwenimage, wan

_FAMILIES: tuple[ModuleType, ...] = (flux, flux2, qwenimage, wan)

HOW_TO_WRITE_A_PLAN = (
    "Pass plan={...}: a dict mapping module globs to styles, e.g. "
    "{'blocks.*.attn.to_q': 'colwise', 'blocks.*.attn.to_out.0': 'rowwise'} "
    "(styles: 'colwise', 'rowwise', 'rowwise_split_input', PackedColwise(blocks), PackedRowwise(blocks)); "
    "see README.md, 'Writing a plan'."
)


def family_of(model_or_cls: nn.Module | type) -> ModuleType | None:
    cls = model_or_cls if isinstance(model_or_cls, type) else type(model_or_cls)
    for klass in cls.__mro__:
        for family in _FAMILIES:
            if klass.__name__ in family.MODEL_CLASSES:
                return family
    return None


def supported(kind: str) -> list[str]:
    attr = f"{kind}_parallel_plan"
    return sorted(name for family in _FAMILIES if hasattr(family, attr) for name in family.MODEL_CLASSES)


def builtin_plan(model_or_cls: nn.Module | type, config, kind: str):
    """The built-in `kind` ("tensor" or "context") plan for this model, or a PlanError saying how to write one."""
    family = family_of(model_or_cls)
    attr = f"{kind}_parallel_plan"
    name = (model_or_cls if isinstance(model_or_cls, type) else type(model_or_cls)).__name__
    if family is None or not hasattr(family, attr):
        extra = HOW_TO_WRITE_A_PLAN if kind == "tensor" else "Pass cp_plan=ContextParallelPlan(...)."
        raise PlanError(
            f"paradiff has no built-in {kind}-parallel plan for {name}; built-in plans exist for {supported(kind)}. "
            + extra
        )
    return getattr(family, attr)(config)
