"""The one way paradiff changes a module: a recorded, removable `Patch`.

Every change paradiff makes to a model, pipeline, VAE or encoder goes through a function here: replace a child
module, swap a class, wrap a forward, shadow another attribute, set an attention processor, add a forward hook or
pre-hook, move hooks from one module to another. Each returns nothing new to its caller but the handle the caller
needs (a hook's `RemovableHandle`, the patch itself) and records a `Patch` (its kind, target, what was put there,
the mechanism that asked, and how to undo it) in the changed module's own list, in the order applied.

- `patches(model)` lists them, module by module in `named_modules` order, each module's in the order applied
  (`paradiff.describe(model)` prints them);
- `remove_patches(model)` undoes them all, last first, and gives back the original objects: the class, the forward,
  the processor, the child module, the hook dicts as they were;
- `remove_patch(module, patch)` undoes one (a wrapper taken out, a hook a mechanism no longer needs).

The list is kept on the module itself (`object.__setattr__`, outside nn.Module's registries), never in a global: two
models in one process stay independent, and a child replaced by a patch takes its own patches along. Nothing else in
paradiff assigns a `forward`, a `__class__` or a hook dict (`tests/test_patches.py` greps for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

# paradiff keeps what it holds on another library's object (a model, a pipeline) under names with this prefix
PRIVATE_PREFIX = "_paradiff_"
PATCHES_ATTR = PRIVATE_PREFIX + "patches"
_MISSING = object()

# The kinds, in the order a forward meets them: a replaced child or class first, then what shadows the forward
# (wrappers, attributes, processors), then the hooks around it.
KINDS = ("replace_module", "replace_parameter", "class_swap", "wrap_forward", "set_attribute", "processor",
         "route_attention", "pre_hook", "hook", "moved_hooks")


@dataclass(eq=False)
class Patch:
    """One change to one module: `kind` (one of KINDS), `target` (the attribute, child or hook dict changed), `what`
    (the name of what was put there), `by` (the mechanism: "tp", "cp", "vae", "cfg", "cache", ...), `handle` (a hook's
    RemovableHandle, or None) and `undo` (restores what was there before)."""

    kind: str
    target: str
    what: str
    by: str
    undo: Callable[[], None] = field(repr=False)
    handle: Any = None
    subject: Any = field(default=None, repr=False)  # the object changed, where not the module holding the patch

    def __str__(self) -> str:
        return f"{self.kind} {self.target}: {self.what} (by {self.by})"


def module_patches(module: Any) -> list[Patch]:
    """The patches recorded on `module` itself, in the order applied (the list itself: read it, don't change it)."""
    return module.__dict__.get(PATCHES_ATTR, [])


def patches(model: Any) -> list[tuple[str, Patch]]:
    """Every patch on `model` and its submodules: (submodule path, "" for the model, patch), in `named_modules`
    order, each module's in the order applied. A pipeline (not a module) gives its own, then each component's,
    the path starting with the component's name."""
    return [(where, patch) for where, holder in _holders(model) for patch in module_patches(holder)]


def _holders(model: Any) -> list[tuple[str, Any]]:
    if isinstance(model, nn.Module):
        return list(model.named_modules(remove_duplicate=False))
    found = [("", model)]
    for name, component in (getattr(model, "components", None) or {}).items():
        if isinstance(component, nn.Module):
            found += [(f"{name}.{where}" if where else name, module)
                      for where, module in component.named_modules(remove_duplicate=False)]
        elif component is not None and hasattr(component, "__dict__"):
            found.append((name, component))
    return found


def remove_patch(module: Any, patch: Patch) -> None:
    """Undo one patch recorded on `module` and forget it (nothing if it was already removed)."""
    recorded = module_patches(module)
    if any(entry is patch for entry in recorded):
        recorded[:] = [entry for entry in recorded if entry is not patch]
        patch.undo()


def remove_patches_by(module: Any, by: str) -> None:
    """Undo the patches `by` recorded on `module` itself (last first): a mechanism putting its patches again."""
    for patch in reversed([patch for patch in module_patches(module) if patch.by == by]):
        remove_patch(module, patch)


def remove_patches(model: Any) -> int:
    """Undo every patch on `model` and its submodules (a pipeline: and its components'), last applied first,
    deepest module first; return how many.

    A replaced child comes back with whatever patches it held before it was replaced: they are undone on the next
    pass, until none is left. Then what paradiff kept on each object besides its patches, always under a
    `PRIVATE_PREFIX` name (its parallel state and wrapper registry, a VAE's split, a pipeline's state, the patch
    lists themselves), goes too: nothing of paradiff is left to describe or to act on."""
    removed = 0
    while True:
        holders = list({id(holder): holder for _, holder in _holders(model) if module_patches(holder)}.values())
        if not holders:
            break
        for module in reversed(holders):
            recorded = module_patches(module)
            while recorded:
                recorded.pop().undo()
                removed += 1
    for _, holder in _holders(model):
        for name in [name for name in vars(holder) if name.startswith(PRIVATE_PREFIX)]:
            del holder.__dict__[name]
    return removed


def record(module: Any, patch: Patch) -> Patch:
    """Add `patch` (already applied) to `module`'s list."""
    if patch.kind not in KINDS:
        raise ValueError(f"unknown patch kind {patch.kind!r}; the kinds are {list(KINDS)}.")
    recorded = module.__dict__.get(PATCHES_ATTR)
    if recorded is None:
        recorded = []
        object.__setattr__(module, PATCHES_ATTR, recorded)
    recorded.append(patch)
    return patch


def name_of(thing: Any) -> str:
    name = getattr(thing, "__qualname__", None) or getattr(getattr(thing, "func", None), "__qualname__", None)
    return (name or type(thing).__qualname__).replace(".<locals>", "")


# ---------------------------------------------------------------------------------------------------------------
# The changes


@dataclass(eq=False)
class HookHandle:
    """What `add_hook` returns: `remove()` takes the hook off and its patch out of the module's list."""

    module: Any
    patch: Patch

    def remove(self) -> None:
        remove_patch(self.module, self.patch)


def add_hook(module: nn.Module, hook: Callable[..., Any], *, by: str, pre: bool = False,
             **options: Any) -> HookHandle:
    """`register_forward_pre_hook` (pre=True) or `register_forward_hook` with `options` (with_kwargs, prepend,
    always_call), recorded; the patch holds torch's RemovableHandle."""
    register = module.register_forward_pre_hook if pre else module.register_forward_hook
    handle = register(hook, **options)
    patch = record(module, Patch("pre_hook" if pre else "hook", "forward", name_of(hook), by, handle.remove, handle))
    return HookHandle(module, patch)


def set_attribute(module: Any, name: str, value: Any, *, by: str, kind: str = "set_attribute",
                  owner: Any = None, what: str | None = None) -> Patch:
    """Set `module.name = value` on the instance (shadowing its class's attribute: a method, a forward), recorded on
    `owner` (default: the module itself; another library's object, e.g. a diffusers hook, records on the module it
    serves). Undo puts back the instance attribute that was there, or none; a value set over ours since is left.
    Setting again what the same mechanism set (a stage's weights quantized again) replaces its earlier patch."""
    holder = module if owner is None else owner
    same = (kind, name, by)
    for earlier in [patch for patch in module_patches(holder)
                    if (patch.kind, patch.target, patch.by) == same and patch.subject is module]:
        remove_patch(holder, earlier)
    before = module.__dict__.get(name, _MISSING)
    object.__setattr__(module, name, value)

    def undo() -> None:
        if module.__dict__.get(name, _MISSING) is not value:  # something was set over ours: leave it
            return
        if before is _MISSING:
            del module.__dict__[name]
        else:
            object.__setattr__(module, name, before)

    return record(holder, Patch(kind, name, what or name_of(value), by, undo, subject=module))


def wrap_forward(module: nn.Module, forward: Callable[..., Any], *, by: str) -> Patch:
    """Put `forward` on the instance over its class's (nn.Module's hooks still run around it)."""
    return set_attribute(module, "forward", forward, by=by, kind="wrap_forward")


def route_attention(model: nn.Module, mode: Any, modules: list[nn.Module], *, by: str, what: str) -> Patch:
    """Run each of `modules` (the model's attention modules) inside `mode`, a TorchFunctionMode sending
    `F.scaled_dot_product_attention` to an attention backend: a pre-hook enters it, a hook leaves it, and a hook on
    `model` that runs even when the forward raises leaves it where an exception skipped the module's own (hooks that
    always run, inside a compiled block, would make Dynamo guard on every module's hook ids). One patch on `model`,
    its `subject` the mode; undo removes every hook."""
    def enter(_module, _args):
        mode.__enter__()

    def leave(_module, _args, _output):
        mode.__exit__(None, None, None)

    def leave_leftover(_module, _args, _output):
        stack = torch.overrides._get_current_function_mode_stack()
        while stack and stack[-1] is mode:
            stack.pop().__exit__(None, None, None)

    handles = []
    for module in modules:
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    handles.append(model.register_forward_hook(leave_leftover, always_call=True))

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return record(model, Patch("route_attention", "F.scaled_dot_product_attention", what, by, undo, handles,
                               subject=mode))


def swap_class(module: nn.Module, cls: type, *, by: str) -> Patch:
    """Make `module` an instance of `cls` (a subclass of its class mixing paradiff's behaviour in), state kept."""
    before = type(module)
    object.__setattr__(module, "__class__", cls)
    return record(module, Patch("class_swap", "__class__", f"{cls.__name__} over {before.__name__}", by,
                                lambda: object.__setattr__(module, "__class__", before)))


def set_processor(module: nn.Module, processor: Any, *, by: str, through_setter: bool = False) -> Patch:
    """Set an attention module's processor: by assignment (nn.Module's, which registers a processor that is itself
    a module), or through diffusers' own `set_processor` with `through_setter`; undo sets the one it replaced."""
    before = getattr(module, "processor", None)
    if through_setter:
        module.set_processor(processor)
        restore = lambda: module.set_processor(before)  # noqa: E731
    else:
        setattr(module, "processor", processor)
        restore = lambda: setattr(module, "processor", before)  # noqa: E731
    return record(module, Patch("processor", "processor", type(processor).__name__, by, restore))


def replace_module(parent: nn.Module, name: str, child: nn.Module, *, by: str, release: bool = False,
                   shapes: dict[str, tuple[int, ...]] | None = None) -> Patch:
    """Put `child` at `parent`'s direct child `name` (the one it replaces keeps its own patches, back on undo).

    With `release` the replaced module's tensors go to the meta device: a quantized layer replacing a full-precision
    one must free its weights (the point of quantizing), so undo gives back the layer's structure, not its weights.
    `shapes`: the declared shape of a tensor the replaced module holds only a slice of (read shard-on-read), by its
    name in that module: its meta tensor takes that shape, so the layer given back loads the checkpoint's tensors."""
    before = parent._modules[name]
    parent._modules[name] = child
    if release:
        _release(before, shapes or {})
    what = f"{type(child).__name__} over {type(before).__name__}" + (" (its weights released)" if release else "")
    return record(parent, Patch("replace_module", name, what, by, lambda: parent._modules.__setitem__(name, before)))


def _release(module: nn.Module, shapes: dict[str, tuple[int, ...]]) -> None:
    """Give `module`'s tensors up: each is swapped for a meta tensor of its shape (or of its declared shape in
    `shapes`, by name in `module`) in the module's own dicts (a tensor it shares, a tied table, stays with its other
    holders)."""
    for prefix, holder in module.named_modules():
        for table in (holder._parameters, holder._buffers):
            for key, tensor in table.items():
                if tensor is not None:
                    shape = shapes.get(f"{prefix}.{key}" if prefix else key, tensor.shape)
                    empty = torch.empty(shape, dtype=tensor.dtype, device="meta")
                    table[key] = nn.Parameter(empty, requires_grad=False) if table is holder._parameters else empty


def replace_parameter(module: nn.Module, name: str, parameter: nn.Parameter | None, *, by: str,
                      release: bool = False, shape: tuple[int, ...] | None = None) -> Patch:
    """Put `parameter` in `module`'s parameter `name` (a rank's slice of it); undo puts the one it replaced back.
    With `release` the one replaced is not kept (a full tensor split over the ranks: holding it would keep the whole
    model on every rank); undo puts back a meta tensor of its shape (`shape`: its declared one, where the parameter
    replaced was already a slice, read shard-on-read), to be loaded again."""
    before = module._parameters[name]
    if release and before is not None:
        before = nn.Parameter(torch.empty(before.shape if shape is None else shape, dtype=before.dtype, device="meta"),
                              requires_grad=False)
    module._parameters[name] = parameter
    held = "None" if parameter is None else "x".join(map(str, parameter.shape))
    return record(module, Patch("replace_parameter", name, f"parameter of shape {held}", by,
                                lambda: module._parameters.__setitem__(name, before)))


# nn.Module's forward hook dicts, all keyed by the same handle ids (the with_kwargs and always_call sets too)
HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called")


def forward_hooks(module: nn.Module) -> tuple[dict, dict]:
    """`module`'s forward pre-hooks and forward hooks, by handle id (to read, not to change)."""
    return module._forward_pre_hooks, module._forward_hooks


def has_hooks(module: nn.Module) -> bool:
    return any(getattr(module, name) for name in HOOK_DICTS)


def move_hooks(source: nn.Module, destination: nn.Module, *, by: str) -> Patch | None:
    """Move `source`'s forward hook dicts whole onto `destination` (a layer wrapping it, standing in its place), so
    every RemovableHandle still finds its hook; recorded on `destination`, undo moves them back. None when `source`
    has no hooks; a ValueError when `destination` has hooks of its own (they would be lost)."""
    if not any(getattr(source, name) for name in HOOK_DICTS):
        return None
    if any(getattr(destination, name) for name in HOOK_DICTS):
        raise ValueError(f"{type(destination).__name__} has forward hooks of its own; the hooks of "
                         f"{type(source).__name__} cannot be moved onto it.")
    moved = {name: getattr(source, name) for name in HOOK_DICTS}
    empty = {name: getattr(destination, name) for name in HOOK_DICTS}
    for name in HOOK_DICTS:  # plain attributes of nn.Module: object.__setattr__ is what nn.Module.__setattr__ does
        object.__setattr__(destination, name, moved[name])
        object.__setattr__(source, name, empty[name])

    def undo() -> None:
        for name in HOOK_DICTS:
            object.__setattr__(source, name, moved[name])
            object.__setattr__(destination, name, empty[name])

    count = len(moved["_forward_pre_hooks"]) + len(moved["_forward_hooks"])
    return record(destination, Patch("moved_hooks", "forward hooks", f"{count} from {type(source).__name__}", by,
                                     undo))


def share_hooks(source: nn.Module, destination: nn.Module, *, by: str) -> Patch:
    """Give `destination` (about to replace `source`) `source`'s forward hook dicts themselves: a handle removes a
    hook from both; recorded on `destination`, undo gives it back empty dicts of its own."""
    own = {name: getattr(destination, name) for name in HOOK_DICTS}
    for name in HOOK_DICTS:
        object.__setattr__(destination, name, getattr(source, name))

    def undo() -> None:
        for name in HOOK_DICTS:
            object.__setattr__(destination, name, own[name])

    return record(destination, Patch("moved_hooks", "forward hooks", f"shared with {type(source).__name__}", by, undo))
