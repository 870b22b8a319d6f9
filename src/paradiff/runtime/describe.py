"""`paradiff.describe(model)`: every change paradiff has made to a model, as found on it.

A first step towards recording each change as a patch when it is made: until then the changes are read back from
the model, which finds them whatever installed them. Found:

- the model's state (`runtime/state.py`): the mesh's degrees, the TP plan's sharded layers, the CP plan, FSDP's
  blocks, the step cache's monitor;
- its forward wrappers (`runtime/wrappers.py`), outermost first;
- on every submodule: a class paradiff swapped in (its class defined in paradiff), an instance `forward` set over
  the class's (by paradiff, or by diffusers' hooks or torch.compile where paradiff installed them: the module that
  defined it is named), an attention processor defined in paradiff, and the forward hooks and pre-hooks whose
  function is paradiff's.

Hooks and processors of other libraries (diffusers' own hooks, peft's layers) are not listed.
Reading only: nothing on the model is changed.

Besides what is found, `Description.patches` holds every change recorded as a `Patch` when it was made
(`runtime/patches.py`), module by module in the order applied: what `paradiff.remove_patches(model)` undoes.
"""

from __future__ import annotations

import functools
import types
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from paradiff.runtime.patches import Patch, forward_hooks, patches
from paradiff.runtime.state import model_state


@dataclass(frozen=True)
class Change:
    """One change: where (a submodule's path, "" for the model itself), what kind, and what it is."""

    where: str
    kind: str  # "state", "wrapper", "class", "forward", "processor", "pre-hook", "hook"
    what: str

    def __str__(self) -> str:
        return f"{self.where or '(model)'}: {self.kind}: {self.what}"


@dataclass
class Description:
    """The changes found on one model, in the order a forward meets them (state and wrappers first, then the
    submodules in `named_modules` order); `str()` gives one line a change and a count by kind."""

    model: str
    changes: list[Change] = field(default_factory=list)
    patches: list[tuple[str, Patch]] = field(default_factory=list)  # (submodule path, patch), as recorded

    def counts(self) -> dict[str, int]:
        return dict(Counter(change.kind for change in self.changes))

    def __str__(self) -> str:
        if not self.changes and not self.patches:
            return f"{self.model}: no changes by paradiff"
        counts = ", ".join(f"{count} {kind}" for kind, count in self.counts().items())
        lines = [f"{self.model}: {len(self.changes)} changes by paradiff ({counts})",
                 *(f"  {change}" for change in self.changes)]
        if self.patches:
            kinds = ", ".join(f"{count} {kind}" for kind, count in Counter(p.kind for _, p in self.patches).items())
            lines += [f"{len(self.patches)} recorded patches, removable ({kinds}):",
                      *(f"  {where or '(model)'}: {patch}" for where, patch in self.patches)]
        return "\n".join(lines)


def describe(model: nn.Module) -> Description:
    """What paradiff changed on `model` (see the module's docstring); `print(paradiff.describe(model))`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"paradiff.describe takes an nn.Module, got {type(model).__name__}.")
    description = Description(type(model).__name__)
    description.changes += _state_changes(model)
    for where, module in model.named_modules():
        description.changes += _module_changes(where, module)
    description.patches = patches(model)
    return description


def _state_changes(model: nn.Module) -> list[Change]:
    state = model_state(model, create=False)
    if state is None:
        return []
    found = []
    parallel = state.parallel
    if parallel is not None:
        degrees = ", ".join(f"{name} {size}" for name, size in parallel.mesh.config.degrees().items() if size > 1)
        found.append(Change("", "state", f"parallel on a mesh of {degrees or 'one rank'}"))
        if parallel.tp_plan is not None:
            found.append(Change("", "state", f"TP plan: {len(parallel.tp_plan.linears)} layers split"))
        if parallel.cp_plan is not None:
            found.append(Change("", "state", f"CP plan: {len(parallel.cp_hooks)} hooks held with their handles"))
        if parallel.fsdp_blocks:
            found.append(Change("", "state", f"FSDP: {len(parallel.fsdp_blocks)} blocks sharded"))
    if state.cache_monitor is not None:
        found.append(Change("", "state", f"step cache monitor ({type(state.cache_monitor).__name__})"))
    found += [Change("", "wrapper", name) for name in state.wrappers.names()]
    return found


def _module_changes(where: str, module: nn.Module) -> list[Change]:
    found = []
    cls = type(module)
    if _is_paradiff(cls):
        base = next((klass for klass in cls.__mro__ if not _is_paradiff(klass)), object)
        found.append(Change(where, "class", f"{cls.__name__} (paradiff) over {base.__name__}"))
    forward = module.__dict__.get("forward")
    if forward is not None:  # whoever set it: paradiff, or diffusers' hooks and torch.compile that paradiff installed
        found.append(Change(where, "forward", f"{_name_of(forward)} ({_owner(forward)})"))
    processor = getattr(module, "processor", None)
    if processor is not None and _is_paradiff(type(processor)):
        found.append(Change(where, "processor", type(processor).__name__))
    pre_hooks, hooks_after = forward_hooks(module)
    for kind, hooks in (("pre-hook", pre_hooks), ("hook", hooks_after)):
        found += [Change(where, kind, _name_of(hook)) for hook in hooks.values() if _is_paradiff(hook)]
    return found


def _owner(thing: object) -> str:
    """The module defining `thing`: a class's, a function's, a bound method's object's class's, a partial's function's,
    a callable object's class's."""
    while isinstance(thing, functools.partial):
        thing = thing.func
    if isinstance(thing, type):
        return thing.__module__
    bound = getattr(thing, "__self__", None)
    if bound is not None and not isinstance(bound, types.ModuleType):
        return type(bound).__module__
    if isinstance(thing, types.FunctionType):
        return thing.__module__
    return type(thing).__module__


def _is_paradiff(thing: object) -> bool:
    owner = _owner(thing)
    return owner == "paradiff" or owner.startswith("paradiff.")


def _name_of(thing: object) -> str:
    while isinstance(thing, functools.partial):
        thing = thing.func
    name = getattr(thing, "__qualname__", None) or type(thing).__qualname__
    return name.replace(".<locals>", "")
