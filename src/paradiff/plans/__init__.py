"""Built-in plans, one short module per model family, found by the model's class name.

Every module in this package (and in `text_encoders/`) that ends with `FAMILY = Family.of(__name__)` is a family;
`Family` (plans/family.py) is a frozen dataclass of what the module declares under these names (the data ones in
capitals: `MODEL_CLASSES`, `EXAMPLES`, `INPUTS`, `EXTRA_MODES`), None where it declares nothing:
- `model_classes`: the diffusers / transformers class names it knows;
- `tensor_parallel_plan(config) -> TensorParallelPlan` and `context_parallel_plan(config) -> ContextParallelPlan`
  (text-encoder families take `model_class=` too);
- `examples`: {example name: (class name, tiny config kwargs)} and `example_inputs`, the module's `INPUTS`
  (forward inputs declared as data, records of `plans/inputs.py`), the smallest configurations and forward inputs
  that exercise every block type; `paradiff check-plan` and the test suite run every plan on them;
- `init_example(model)`: initialises (from torch's seeded generator) the parameters an example's class leaves
  uninitialised, e.g. expert banks created with torch.empty; `prepare_example(model)`: swaps in a kernel torch's
  FLOP counter can run;
- `run_example(model, inputs)`: runs the example forward where one call is not the whole story (Wan-Animate 2's
  cache-filling reference pass, then a denoising step reading the cache); `INPUTS` then declares whatever it
  takes, and its outputs are compared;
- `extra_modes`: {example name: modes beyond tp2 / ulysses2 / ring2 / tp2 x ulysses2, e.g. ("tp4",)} the test
  suite also runs (tests/rank_cases_families.py names the modes).
The module-level declarations stay where they are; `Family.of` only collects them. The example hooks are code and
live in `models/<family>.py`, imported by the family module under their field names.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from functools import lru_cache
from typing import Any
from torch import nn

from paradiff.errors import PlanError
from paradiff.plans.family import Family

HOW_TO_WRITE_A_PLAN = (
    "Pass plan={...}: a dict mapping module globs to styles, e.g. "
    "{'blocks.*.attn.to_q': 'colwise', 'blocks.*.attn.to_out.0': 'rowwise'} "
    "(styles: 'colwise', 'rowwise', 'rowwise_split_input', 'norm_across_heads', PackedColwise(blocks), "
    "PackedRowwise(blocks), ColwiseHeads(head_dim)), or plan='auto' to derive one from the model's structure; "
    "see docs/tensor-parallel.md, 'Writing a plan'."
)


@lru_cache(maxsize=None)
def families() -> tuple[Family, ...]:
    """Every family of this package, in module name order (imported once; the tuple never changes)."""
    return _discover(__name__, __path__)


@lru_cache(maxsize=None)
def text_encoder_families() -> tuple[Family, ...]:
    """The text-encoder families (`plans/text_encoders/`), found the same way."""
    from paradiff.plans import text_encoders

    return _discover(text_encoders.__name__, text_encoders.__path__)


def _discover(package: str, path) -> tuple[Family, ...]:
    found = []
    for info in sorted(pkgutil.iter_modules(path), key=lambda info: info.name):
        if info.name.startswith("_") or info.ispkg:
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        family = getattr(module, "FAMILY", None)  # helper modules (common, auto, vae) declare none
        if isinstance(family, Family):
            found.append(family)
    return tuple(found)


def family_of(model_or_cls: nn.Module | type) -> Family | None:
    return _match(model_or_cls)[0]


def _match(model_or_cls: nn.Module | type) -> tuple[Family | None, str | None]:
    """The family and the class name it knows, nearest in the MRO first."""
    cls = model_or_cls if isinstance(model_or_cls, type) else type(model_or_cls)
    for klass in cls.__mro__:
        for family in families() + text_encoder_families():
            if klass.__name__ in family.model_classes:
                return family, klass.__name__
    return None, None


def supported(kind: str) -> list[str]:
    return sorted(name for family in families() if family.plan(kind) is not None for name in family.model_classes)


def model_config(model_cls: type, config: Any) -> Any:
    """The config `model_cls` is built from: its family's `model_config` of the folder's config, or that config."""
    family, known_class = _match(model_cls)
    return config if family is None or family.model_config is None else family.model_config(config, known_class)


def builtin_plan(model_or_cls: nn.Module | type, config, kind: str):
    """The built-in `kind` ("tensor" or "context") plan for this model, or a PlanError saying how to write one."""
    family, known_class = _match(model_or_cls)
    name = (model_or_cls if isinstance(model_or_cls, type) else type(model_or_cls)).__name__
    build = None if family is None else family.plan(kind)
    if build is None:
        extra = (HOW_TO_WRITE_A_PLAN if kind == "tensor"
                 else "Pass cp_plan=ContextParallelPlan(...) or cp_plan='auto'.")
        raise PlanError(
            f"paradiff has no built-in {kind}-parallel plan for {name}; built-in plans exist for "
            f"{len(supported(kind))} classes ({', '.join(supported(kind))}). " + extra
        )
    # text-encoder families take the class name too: their layout differs by class (see plans/text_encoders/)
    if "model_class" in inspect.signature(build).parameters:
        return build(config, model_class=known_class)
    return build(config)


def plan_for(model: nn.Module, given, kind: str):
    """The plan a user asked for: their own (a plan, or a function of the model config returning one), the
    built-in one (None), or one derived from the structure ("auto")."""
    if isinstance(given, str) and given == "auto":
        from paradiff.plans.auto import auto_plan

        return auto_plan(model, kind)
    if given is None:
        return builtin_plan(model, getattr(model, "config", None), kind)
    if callable(given):  # a plan module's tensor_parallel_plan / context_parallel_plan, called with the config
        return given(getattr(model, "config", None))
    return given
