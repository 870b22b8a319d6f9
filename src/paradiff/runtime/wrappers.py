"""The one ordered, named registry of the wrappers a paradiff model's forward goes through.

Each wrapper has a fixed place in `ORDER` (outermost first), whatever order the installers run in; a new wrapper
(LoRA, quantization) gets its place by adding its name there. Installing a name already installed replaces that
wrapper in place (installers may run again, e.g. `enable_cache` after a cache was re-enabled).

Two kinds of wrapper:
- "before": called as `fn(args, kwargs)` before the module's call, ahead of every forward pre-hook. They must see
  the arguments whole: context parallelism splits the inputs in pre-hooks on the model itself, and a latent
  checksum taken after that split would differ between the ranks of one replica.
- "around": called as `fn(call, args, kwargs)` around the forward; `call(*args, **kwargs)` runs the next one in.

The registry replaces `model.forward` once (instance attribute, so nn.Module's hooks still run around it) and adds
at most one forward pre-hook, both recorded patches (`runtime/patches.py`); removing the last wrapper of a kind
removes its patch again.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from torch import nn

from paradiff.runtime.patches import add_hook, remove_patch, wrap_forward
from paradiff.runtime.state import model_state
from paradiff.runtime.wrapper_registry import AROUND, BEFORE, KINDS, ORDER, WrapperRegistry  # noqa: F401 - public here


def registry_of(module: nn.Module) -> WrapperRegistry:
    return model_state(module).wrappers


def install_wrapper(module: nn.Module, name: str, wrapper: Callable[..., Any]) -> None:
    """Put `wrapper` at its declared place in `module`'s forward (replacing one of the same name)."""
    if name not in KINDS:
        raise ValueError(f"unknown forward wrapper {name!r}; declared (outermost first): {[n for n, _ in ORDER]}.")
    registry = registry_of(module)
    registry.installed[name] = wrapper
    if KINDS[name] == BEFORE and registry.pre_hook_patch is None:
        registry.pre_hook_patch = add_hook(module, _before_hook(registry), by="wrappers", pre=True, with_kwargs=True,
                                           prepend=True).patch
    if KINDS[name] == AROUND and registry.forward_patch is None:
        registry.plain_forward = module.__dict__.get("forward")
        registry.forward_patch = wrap_forward(module, _registry_forward(module, registry), by="wrappers")


def remove_wrapper(module: nn.Module, name: str) -> None:
    """Take `name` out of `module`'s forward; with no wrapper left of its kind, the plain forward is back."""
    registry = registry_of(module)
    registry.installed.pop(name, None)
    if registry.pre_hook_patch is not None and not registry.of_kind(BEFORE):
        remove_patch(module, registry.pre_hook_patch)
        registry.pre_hook_patch = None
    if registry.forward_patch is not None and not registry.of_kind(AROUND):
        remove_patch(module, registry.forward_patch)  # something wrapped over it since: left in place
        registry.forward_patch = registry.plain_forward = None


def wrappers(module: nn.Module) -> list[str]:
    """The names of the wrappers on `module`'s forward, outermost first."""
    state = model_state(module, create=False)
    return state.wrappers.names() if state is not None else []


def _before_hook(registry: WrapperRegistry) -> Callable[..., None]:
    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        for wrapper in registry.of_kind(BEFORE):
            wrapper(args, kwargs)
        return None

    return hook


def _registry_forward(module: nn.Module, registry: WrapperRegistry) -> Callable[..., Any]:
    plain = registry.plain_forward or type(module).forward.__get__(module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        call = plain
        for wrapper in reversed(registry.of_kind(AROUND)):  # innermost first, each wrapping the ones inside it
            call = _bound(wrapper, call)
        return call(*args, **kwargs)

    # Modular Diffusers' denoise steps pass the transformer only the arguments `inspect.signature(model.forward)`
    # names (Qwen-Image's img_shapes, ...): the registry's forward keeps the model's own signature.
    forward.__signature__ = inspect.signature(plain)
    return forward


def _bound(wrapper: Callable[..., Any], inner: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *args, **kwargs: wrapper(inner, args, kwargs)
