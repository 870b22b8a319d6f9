"""Test-only tools for step caches: read diffusers' own decisions, and make paradiff's ranks decide alone."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from paradiff.distributed.agreement import agree
from paradiff.runtime.caching import CacheDecision, CacheMonitor


def _cache_hooks(model: nn.Module) -> list:
    return [hook for module in model.modules()
            for hook in getattr(getattr(module, "_diffusers_hook", None), "hooks", {}).values()]


@contextmanager
def stock_decisions(model: nn.Module, decisions: list[bool]) -> Iterator[None]:
    """Append, after every forward of `model`, whether diffusers' own (unpatched) cache hooks ran every block."""
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook
    from diffusers.hooks.taylorseer_cache import TaylorSeerCacheHook

    hooks = _cache_hooks(model)
    head = next((hook for hook in hooks if isinstance(hook, FBCHeadBlockHook)), None)
    taylor = next((hook for hook in hooks if isinstance(hook, TaylorSeerCacheHook)), None)
    if head is None and taylor is None:
        raise ValueError("the model has no first-block cache or TaylorSeer hook to observe")

    def after(_module, _args, _output):
        if head is not None:
            decisions.append(bool(head.state_manager.get_state().should_compute))
        else:
            state = taylor.state_manager.get_state()
            decisions.append(state.last_update_step == state.current_step)

    handle = model.register_forward_hook(after)
    try:
        yield
    finally:
        handle.remove()


def decide_alone(monitor: CacheMonitor, ranks: list[int]) -> None:
    """Take the reduction out: each rank decides from its own measure, as a naive parallel cache would.

    Before each decision takes effect the ranks compare it through the store (`agree`), so a disagreement ends in a
    DistributedError naming each rank's decision rather than in ranks hanging on different collectives.
    """

    def local_only(values: torch.Tensor, _group) -> list[float]:
        return values.tolist()

    def check(decision: CacheDecision) -> None:
        agree("cache decision", {"compute the remaining blocks": decision.computed}, ranks=ranks)

    monitor.reduce = local_only
    monitor.verify = check
