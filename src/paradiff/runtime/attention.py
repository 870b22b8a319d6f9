"""`paradiff.set_attention_backend(model, name)`: the kernel that runs a model's attention, chosen by one name with
or without context parallelism (the backends: `attention/backends.py`).

With CP the choice is the one CP's ring / Ulysses attention calls for its local attention; without, the model's
SDPA calls are routed to it. Either way it is one recorded patch on the model (`paradiff.describe` lists it,
`paradiff.remove_patches` undoes it); choosing again replaces it.
"""

from __future__ import annotations

import torch
from torch import nn

from paradiff.attention.backends import check_supported
from paradiff.attention.route import AttentionRoute
from paradiff.context_parallel.kernels import check_backend
from paradiff.context_parallel.runtime import require_native_processors
from paradiff.runtime.patches import remove_patches_by, route_attention, set_attribute
from paradiff.runtime.state import get_state

BY = "attention"


def _device_and_dtype(model: nn.Module) -> tuple[torch.device | None, torch.dtype | None]:
    """Where the model computes: its first floating parameter's device and dtype (None for either when unknown)."""
    for parameter in model.parameters():
        if parameter.is_floating_point() and parameter.device.type != "meta":
            return parameter.device, parameter.dtype
    return None, None


def set_attention_backend(model: nn.Module, name: str) -> None:
    """Run `model`'s attention on backend `name` ("native", "math", "sdpa", "sdpa-flash", "sdpa-efficient",
    "sdpa-cudnn", "flex", "flash"), with or without context parallelism. Raises a ParallelConfigError naming the
    backends that can run when `name` cannot: unknown, not on this machine, not on the model's device or dtype, or
    without the log-sum-exp a ring merges by. Nothing runs and no collective is issued."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"set_attention_backend takes an nn.Module (a diffusers transformer), got "
                        f"{type(model).__name__}.")
    state = get_state(model)
    runtime = state.context if state is not None else None
    device, dtype = _device_and_dtype(model)
    if runtime is not None:
        check_backend(name, runtime.mode)  # the CP mode's own refusals first (a ring merges by the LSE)
        # so does attention over a replicated key prefix, in any mode (Cosmos3)
        needs_lse = runtime.mode != "ulysses" or bool(getattr(state.cp_plan, "prefix_attention", None))
        check_supported(name, device=device, dtype=dtype, needs_lse=needs_lse)
        set_attribute(runtime, "backend", name, by=BY, owner=model, what=f"attention backend {name!r} (in CP's "
                      f"{runtime.mode} attention)")
        return
    backend = check_supported(name, device=device, dtype=dtype)
    require_native_processors(model)
    remove_patches_by(model, BY)
    modules = [module for module in model.modules() if hasattr(module, "processor")]  # those CP intercepts too
    route_attention(model, AttentionRoute(backend), modules, by=BY,
                    what=f"attention backend {name!r} in {len(modules)} attention modules")
