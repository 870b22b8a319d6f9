"""`paradiff.compile`: torch.compile the repeated transformer blocks of a (parallel) model, each as one graph.

Regional compilation: every block is compiled with `fullgraph=True`, so a graph break inside a block is an error
rather than a silent slowdown, and blocks of one class share their compiled code (Dynamo caches per code object and
treats the block's parameters as inputs). What runs between blocks stays eager: embeddings, the context-parallel
split and gather hooks, the CFG exchange and the step-cache decisions, which are data-dependent by nature and
cheap. Inside a block, tensor-parallel all-reduces are traced as functional collectives and context-parallel
attention is one custom op (`paradiff::cp_attention`), reached through the same SDPA interception as in eager mode.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paradiff.runtime.patches import set_attribute, wrap_forward
from paradiff.runtime.repeated_blocks import COMPILED_ATTR, repeated_blocks
from paradiff.runtime.caching import cache_monitor, enable_cache, refuse_hooks_inside_compiled_blocks
from paradiff.errors import ParallelConfigError

def compile(  # noqa: A001 - mirrors torch.compile
    model: nn.Module,
    *,
    backend: str | Any = "inductor",
    mode: str | None = None,
    dynamic: bool | None = False,
    options: dict | None = None,
    fullgraph: bool = True,
) -> nn.Module:
    """Compile `model`'s repeated blocks in place and return the model to call.

    Works on a plain model and on any paradiff-parallel one (TP, ring, Ulysses, unified, TP x CP, CFG). Call it
    after `enable_parallelism` / `from_pretrained`; a step cache enabled before is re-enabled around the compiled
    blocks (its decisions must stay eager). Keyword arguments go to `torch.compile` for every block.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"paradiff.compile needs an nn.Module, got {type(model).__name__}.")
    if mode is not None and options is not None:
        raise ValueError(f"give torch.compile either mode={mode!r} or options, not both.")
    blocks = repeated_blocks(model)
    if not blocks:
        raise ParallelConfigError(
            f"{type(model).__name__} has no repeated blocks to compile: it declares no `_repeated_blocks` and has no "
            "top-level nn.ModuleList."
        )
    already = [name for name, block in blocks if getattr(block, COMPILED_ATTR, False)]
    if already:
        raise ParallelConfigError(f"{type(model).__name__} is already compiled by paradiff.compile (e.g. {already[0]}).")
    cache_config = getattr(model, "_cache_config", None)
    if cache_config is not None:
        model.disable_cache()  # its hooks wrap the blocks' forward; they must wrap the compiled forward instead
    kwargs = dict(backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    if mode is not None:
        kwargs["mode"] = mode
    if options is not None:
        kwargs["options"] = options
    for _name, block in blocks:
        wrap_forward(block, torch.compile(block.forward, **kwargs), by="compile")
        set_attribute(block, COMPILED_ATTR, True, by="compile")
    if cache_config is not None:
        if cache_monitor(model) is not None:
            enable_cache(model, cache_config)  # as it was enabled: with paradiff's agreed decisions
        else:
            model.enable_cache(cache_config)
            refuse_hooks_inside_compiled_blocks(model, cache_config)
    return model
