"""Step caches on a parallel model: diffusers' cache hooks, with every skip / compute decision taken by all ranks alike.

A first-block cache skips the remaining blocks when the first block's residual barely changed since the last
computed step. Under context parallelism each rank holds only its own tokens, so a rank measuring alone may skip
while its peers compute: they then issue different collectives and hang, or silently diverge. Here the measure is
summed over the ranks that compute one forward together (one all-reduce of three numbers), so every rank reads the
same number and takes the same decision, the one a single process holding every token would take.

The relative change of the residual is mean(|r - r_prev|) / mean(|r_prev|) (ParaAttention's first-block cache, as
diffusers computes it); a mean over all tokens is a sum over all ranks divided by the total count, so the reduced
value equals the single-process one up to summation order. TaylorSeer decides from the step count alone, which is
the same on every rank, so it needs no reduction; its decisions are recorded all the same.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, FBCBlockHook, FBCHeadBlockHook
from diffusers.hooks.hooks import StateManager
from diffusers.hooks.taylorseer_cache import TaylorSeerCacheHook
from torch import nn

from paradiff.runtime.patches import remove_patches_by, set_attribute
from paradiff.runtime.repeated_blocks import COMPILED_ATTR, block_identifiers, repeated_blocks
from paradiff.distributed.comm import all_reduce_metric
from paradiff.errors import ParallelConfigError
from paradiff.runtime.state import get_state, model_state
from paradiff.runtime.wrappers import install_wrapper

SUPPORTED = ("FirstBlockCacheConfig", "TaylorSeerCacheConfig")


@dataclass
class CacheDecision:
    context: str  # the pipeline's cache context ("cond", "uncond", ...)
    call: int  # index of this forward within its context since the monitor was cleared
    computed: bool  # False: the cached (skipped or predicted) path ran
    metric: float | None = None  # the decision's measure, reduced over the model group (first-block cache)
    local_metric: float | None = None  # what this rank alone would have measured


@dataclass
class CacheMonitor:
    """Where one model's cache decisions are taken and recorded."""

    group: dist.ProcessGroup | None  # the ranks of one forward; None for a single rank
    decisions: list[CacheDecision] = field(default_factory=list)
    # Sums the local measures over `group`; a seam for the test kit (paradiff_testkit.caching), which shows what
    # disagreement would do.
    reduce: Callable[[torch.Tensor, dist.ProcessGroup | None], list[float]] = all_reduce_metric
    # Called with every decision before it takes effect; None in normal use (the test kit checks agreement here).
    verify: Callable[[CacheDecision], None] | None = None
    state_managers: list = field(default_factory=list)  # of the cache hooks, to tell whether a context is set
    calls: dict[str, int] = field(default_factory=dict)  # forwards per context since the last clear

    def record(self, context: str, computed: bool, metric: float | None = None,
               local_metric: float | None = None) -> CacheDecision:
        decision = CacheDecision(context, self.calls.get(context, 0), computed, metric, local_metric)
        if self.verify is not None:
            self.verify(decision)
        self.calls[context] = decision.call + 1
        self.decisions.append(decision)
        return decision

    def computed_steps(self, context: str | None = None) -> list[int]:
        """Indices of the forwards (per context) that ran every block."""
        return [d.call for d in self.decisions if d.computed and (context is None or d.context == context)]

    def clear(self) -> None:
        """Forget the decisions recorded so far (e.g. after each generation); call indices start again at 0."""
        self.decisions.clear()
        self.calls.clear()


def cache_monitor(model: nn.Module) -> CacheMonitor | None:
    """The monitor of a model whose cache went through paradiff (None otherwise)."""
    state = model_state(model, create=False)
    return state.cache_monitor if state is not None else None


def check_cache_config(config: Any) -> None:
    name = type(config).__name__
    if name not in SUPPORTED:
        raise ParallelConfigError(
            f"{name} is not supported on a paradiff model; supported step caches: {list(SUPPORTED)} "
            "(diffusers.FirstBlockCacheConfig(threshold=...), diffusers.TaylorSeerCacheConfig(...))."
        )


def enable_cache(model: nn.Module, config: Any, group: dist.ProcessGroup | None = None) -> CacheMonitor:
    """Enable a diffusers step cache on `model` with decisions agreed over `group` (the model's ranks by default).

    On a paradiff-parallel model `model.enable_cache(config)` does the same. Returns the monitor recording every
    decision (also `paradiff.cache_monitor(model)`).
    """
    check_cache_config(config)
    if not hasattr(type(model), "enable_cache"):
        raise ParallelConfigError(f"{type(model).__name__} has no diffusers cache support (no enable_cache).")
    if group is None:
        state = get_state(model)
        group = state.mesh.model_group if state is not None else None
    if type(config).__name__ == "FirstBlockCacheConfig":
        _check_first_block_cache_fits(model)
    type(model).enable_cache(model, config)
    refuse_hooks_inside_compiled_blocks(model, config)
    if type(config).__name__ == "FirstBlockCacheConfig":
        _repair_joint_tail(model)
    monitor = CacheMonitor(group=group)
    model_state(model).cache_monitor = monitor
    agree_on_decisions(model, monitor)
    _default_cache_context(model)
    return monitor


def _check_first_block_cache_fits(model: nn.Module) -> None:
    """diffusers 0.42's first-block cache reads each block's inputs and outputs through its TransformerBlockRegistry;
    a block class it does not list fails there (at enable time, or at the first step for a missing `hidden_states`
    argument) with a message that does not say what to do instead. Say it here, before any hook is placed."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
    from diffusers.hooks._helpers import TransformerBlockRegistry

    fix = ("TaylorSeer caches every family: TaylorSeerCacheConfig(..., cache_identifiers="
           "paradiff.block_identifiers(model)), or `--cache taylorseer:INTERVAL` on the command line.")
    blocks = [(f"{name}.{index}", block) for name, child in model.named_children()
              if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, nn.ModuleList)
              for index, block in enumerate(child)]
    if len(blocks) < 2:
        raise ParallelConfigError(
            f"FirstBlockCacheConfig cannot run on {type(model).__name__}: diffusers' first-block cache needs at least "
            f"two blocks in lists it knows by name ({sorted(_ALL_TRANSFORMER_BLOCK_IDENTIFIERS)}), found "
            f"{len(blocks)}. {fix}")
    for name, block in blocks:
        block_class = type(block)
        try:
            TransformerBlockRegistry.get(block_class)
        except ValueError:
            raise ParallelConfigError(
                f"FirstBlockCacheConfig cannot run on {type(model).__name__}: diffusers 0.42's first-block cache does "
                f"not know how {block_class.__name__} (`{name}`) takes and returns its hidden states (the class is not "
                f"in diffusers' TransformerBlockRegistry). {fix}") from None
        if "hidden_states" not in inspect.signature(block_class.forward).parameters:
            raise ParallelConfigError(
                f"FirstBlockCacheConfig cannot run on {type(model).__name__}: diffusers' first-block cache passes "
                f"`hidden_states` to {block_class.__name__} (`{name}`), whose forward has no such argument. {fix}")


def refuse_hooks_inside_compiled_blocks(model: nn.Module, config: Any) -> None:
    """A cache hook on a module inside a block paradiff.compile compiled would put the hook's decision (a graph break
    by nature) inside the block's one graph: disable the cache again and say how to cache whole blocks instead."""
    compiled = [name for name, block in repeated_blocks(model) if getattr(block, COMPILED_ATTR, False)]
    if not compiled:
        return
    for name, module in model.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        if not getattr(registry, "hooks", None):
            continue
        block = next((block for block in compiled if name.startswith(block + ".")), None)
        if block is None:
            continue
        model.disable_cache()
        raise ParallelConfigError(
            f"{type(config).__name__} hooks `{name}`, inside the compiled block `{block}`: a block compiled by "
            "paradiff.compile runs as one graph, with no room for a per-step cache decision inside it. Cache whole "
            f"blocks instead, e.g. {type(config).__name__}(..., cache_identifiers=paradiff.block_identifiers(model)) "
            f"(here {block_identifiers(model)}), or enable the cache on an uncompiled model."
        )


def install_agreed_caching(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Route `model.enable_cache(config)` through `enable_cache`, so diffusers' usual call is safe on every rank."""

    def enable_cache_on_model(config: Any) -> None:
        enable_cache(model, config, group)

    set_attribute(model, "enable_cache", enable_cache_on_model, by="cache")
    if getattr(model, "_cache_config", None) is not None:  # enabled before the model was parallelised
        check_cache_config(model._cache_config)
        monitor = CacheMonitor(group=group)
        model_state(model).cache_monitor = monitor
        agree_on_decisions(model, monitor)


def _default_cache_context(model: nn.Module) -> None:
    """Give a forward called outside any cache context the context "cond".

    diffusers' cache hooks raise without a context, and some pipelines (FLUX.2's, which runs no true CFG) never set
    one. The model's "cache_decisions" forward wrapper (installing it again replaces it); calls inside a pipeline's
    own `cache_context` pass straight through.
    """

    def default_context(call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        monitor = cache_monitor(model)
        managers = monitor.state_managers if monitor is not None and model._cache_config is not None else []
        if not managers or any(manager._context is not None for manager in managers):
            return call(*args, **kwargs)
        with model.cache_context("cond"):
            return call(*args, **kwargs)

    install_wrapper(model, "cache_decisions", default_context)


def agree_on_decisions(model: nn.Module, monitor: CacheMonitor) -> None:
    """Replace the decision of every cache hook registered on `model` by one that is recorded and, where it depends
    on data, taken from the measure reduced over `monitor.group`."""
    first_taylorseer = True
    for module in model.modules():
        remove_patches_by(module, "cache_hooks")  # those of hooks an earlier enable_cache registered
        registry = getattr(module, "_diffusers_hook", None)
        for hook in getattr(registry, "hooks", {}).values():
            monitor.state_managers.extend(
                value for value in vars(hook).values() if isinstance(value, StateManager))
            if isinstance(hook, FBCHeadBlockHook):
                set_attribute(hook, "_should_compute_remaining_blocks", _first_block_decision(hook, monitor),
                              by="cache_hooks", owner=module)
            elif isinstance(hook, TaylorSeerCacheHook):
                # every TaylorSeer hook follows the same step schedule; the first one speaks for the forward
                set_attribute(hook, "_measure_should_compute", _taylorseer_decision(hook, monitor,
                                                                                    record=first_taylorseer),
                              by="cache_hooks", owner=module)
                first_taylorseer = False
                _taylorseer_passes_nones(hook, module)


def _repair_joint_tail(model: nn.Module) -> None:
    """Swap diffusers' tail hook for `JointTailBlockHook` when the head block returns two streams and the tail block
    one joint sequence (FLUX.2's single-stream blocks). diffusers 0.42's hook subtracts the head's pair of outputs
    from the tail's one tensor there and raises a TypeError on the first step, in a single process too."""
    head = tail = None
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for hook in getattr(registry, "hooks", {}).values():
            if isinstance(hook, FBCHeadBlockHook):
                head = hook
            elif isinstance(hook, FBCBlockHook) and hook.is_tail:
                tail, tail_registry = hook, registry
    if head is None or tail is None:
        return
    two_streams = head._metadata.return_encoder_hidden_states_index is not None
    if two_streams and tail._metadata.return_encoder_hidden_states_index is None:
        tail_registry.remove_hook(_FBC_BLOCK_HOOK, recurse=False)
        tail_registry.register_hook(JointTailBlockHook(tail.state_manager, is_tail=True), _FBC_BLOCK_HOOK)


class JointTailBlockHook(FBCBlockHook):
    """Tail of a first-block cache whose tail block returns the joint [text, image] sequence: the residuals the head
    block adds back on a skipped step are split into the two streams the head block returns."""

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = self.state_manager.get_state()
        if not state.should_compute:
            return super().new_forward(module, *args, **kwargs)  # passes its input through
        output = self.fn_ref.original_forward(*args, **kwargs)
        image, text = state.head_block_output  # the head hook stores [hidden, encoder]
        if output.shape[1] != image.shape[1] + text.shape[1]:
            raise ValueError(
                f"first-block cache: the tail block returned {output.shape[1]} tokens, not the joint sequence of "
                f"{text.shape[1]} text + {image.shape[1]} image tokens the head block's outputs make."
            )
        state.tail_block_residuals = (output[:, text.shape[1]:] - image, output[:, : text.shape[1]] - text)
        return output


def relative_change(sums: list[float], dtype: torch.dtype) -> float:
    """mean|r - r_prev| / mean|r_prev| from (sum|r - r_prev|, sum|r_prev|, count), each mean rounded to the
    residual's dtype as a single process computing `.mean()` in that dtype would."""
    diff, previous, count = sums
    diff_mean = torch.tensor(diff / count, dtype=torch.float64).to(dtype)
    previous_mean = torch.tensor(previous / count, dtype=torch.float64).to(dtype)
    return float(diff_mean / previous_mean)


def _first_block_decision(hook: Any, monitor: CacheMonitor) -> Callable[[torch.Tensor], bool]:
    @torch.compiler.disable
    def should_compute(residual: torch.Tensor) -> bool:
        state_manager = hook.state_manager
        previous = state_manager.get_state().head_block_residual
        context = state_manager.context.name
        if previous is None:  # first step of this context: nothing to compare with, every rank computes
            return monitor.record(context, True).computed
        local = torch.stack([
            (residual - previous).abs().sum(dtype=torch.float64),
            previous.abs().sum(dtype=torch.float64),
            torch.tensor(float(residual.numel()), dtype=torch.float64, device=residual.device),
        ])
        local_sums = local.tolist()
        metric = relative_change(monitor.reduce(local, monitor.group), residual.dtype)
        local_metric = relative_change(local_sums, residual.dtype)
        return monitor.record(context, metric > hook.threshold, metric, local_metric).computed

    return should_compute


def _taylorseer_passes_nones(hook: Any, module: nn.Module) -> None:
    """Let a TaylorSeer hook cache a module whose output tuple holds None (Kandinsky 6's video blocks return
    (video, None) with no audio): diffusers 0.42's hook fits a Taylor series to every output and fails on the None.
    Here the tensors are fitted and predicted as diffusers does, and each None is given back in its place."""
    nones: list[int] = []  # positions of None in the module's output, from its last computed step

    def new_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        should_compute, state = hook._measure_should_compute()
        if should_compute:
            outputs = hook.fn_ref.original_forward(*args, **kwargs)
            if isinstance(outputs, torch.Tensor):
                state.update((outputs,))
                nones.clear()
            else:
                nones[:] = [index for index, value in enumerate(outputs) if value is None]
                state.update(type(outputs)(value for value in outputs if value is not None))
            return outputs
        predicted = list(state.predict())
        if not nones:
            return predicted[0] if len(predicted) == 1 else tuple(predicted)
        for index in nones:
            predicted.insert(index, None)
        return tuple(predicted)

    set_attribute(hook.fn_ref, "forward", functools.partial(new_forward, module), by="cache_hooks", owner=module)


def _taylorseer_decision(hook: Any, monitor: CacheMonitor, record: bool) -> Callable[[], tuple]:
    schedule = hook._measure_should_compute

    @torch.compiler.disable
    def measure() -> tuple:
        computed, state = schedule()
        if record:
            monitor.record(hook.state_manager.context.name, bool(computed))
        return computed, state

    return measure
