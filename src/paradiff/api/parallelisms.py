"""The model face of each registered parallelism (`distributed/parallelism.py` declares their dimensions and
degrees): how it checks and resolves its plan for a model, and what it puts on a loaded model. Each wraps its
mechanism, unchanged: TP in `tensor_parallel/`, CP in `context_parallel/`, FSDP in `fsdp/` (via `api/fsdp.py`).

`REGISTRY` is `PARALLELISMS` with these bound: same names, dimensions and order. `resolve_plans` (prepare, before
anything is read) and `apply_parallelisms` (attach) walk it in its declared apply order, TP, CP, FSDP, CFG, data;
both take another registry (a test's, with a parallelism of its own) in its place.

What the load sequence does between the two stays where the read needs it (`api/load_sequence.py`): FSDP shards the
transformer on the meta device before the read (so each rank reads its rows), TP swaps in its sharded linears after
the read (before it, with FSDP). CFG is put on a pipeline's transformers by `api/pipeline.py` (it needs the
pipeline's CFG rule), data parallelism splits the inputs (`api/data_parallel.py`): neither changes the model here.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from paradiff.distributed.mesh import rank_coordinates
from paradiff.distributed.parallelism import (PARALLELISMS, ContextParallelism, FsdpParallelism, Registry,
                                              TensorParallelism)
from paradiff.api.fsdp import check_fsdp
from paradiff.plans import plan_for
from paradiff.tensor_parallel.plan import as_plan, resolve_plan


class TensorParallelModel(TensorParallelism):
    """TP: this rank's slices of the family's tensor plan (or the caller's). Its sharded linears are swapped in by
    the load sequence once the weights are read; the resolved plan is kept in the model's state."""

    def resolve_plan(self, config: Any, model: nn.Module, plan: Any, coordinates: Any) -> Any:
        return resolve_plan(model, as_plan(plan_for(model, plan, "tensor")), coordinates.tp_rank, config.tp_degree)


class ContextParallelModel(ContextParallelism):
    """CP: the family's context plan (or the caller's) resolved on the model; applied as recorded hooks
    (`context_parallel/apply.py: apply_context_parallel`)."""

    def resolve_plan(self, config: Any, model: nn.Module, plan: Any, coordinates: Any) -> Any:
        from paradiff.context_parallel.apply import resolve_cp_plan

        return resolve_cp_plan(model, plan_for(model, plan, "context"))

    def apply(self, model: nn.Module, resolved: Any, mesh: Any, state: Any) -> None:
        if resolved is not None:
            from paradiff.context_parallel.apply import apply_context_parallel

            apply_context_parallel(model, state, resolved)


class FsdpModel(FsdpParallelism):
    """FSDP: its plan is the repeated blocks it shards one unit each (`check_fsdp` refuses, by name, what FSDP2
    cannot hold); the sharding itself runs in the load sequence, before the read."""

    def enabled(self, config: Any) -> bool:
        return config.fsdp_degree > 1  # (its own dimension is 1 where it shares the CP ranks)

    def resolve_plan(self, config: Any, model: nn.Module, plan: Any, coordinates: Any) -> Any:
        return check_fsdp(model, config)


REGISTRY = PARALLELISMS.binding(TensorParallelModel(), ContextParallelModel(), FsdpModel())


def resolve_plans(model: nn.Module, config: Any, given: dict[str, Any] | None = None,
                  registry: Registry = REGISTRY) -> dict[str, Any]:
    """Each parallelism `config` uses, validated and resolved for `model` on this rank, in apply order: name -> its
    resolved plan (None where it resolves none). `given`: the caller's plans by name ("tp", "cp"); None takes the
    model family's. Runs while preparing: no weight read, no collective."""
    coordinates = rank_coordinates(config)
    resolved = {}
    for parallelism in registry.in_apply_order():
        if parallelism.enabled(config):
            plan = (given or {}).get(parallelism.name)
            parallelism.validate(config, model, plan)
            resolved[parallelism.name] = parallelism.resolve_plan(config, model, plan, coordinates)
    return resolved


def apply_parallelisms(model: nn.Module, mesh: Any, state: Any, resolved: dict[str, Any],
                       registry: Registry = REGISTRY) -> None:
    """Put each parallelism's changes on `model`, in the registry's apply order; `resolved`: name -> its resolved
    plan (absent or None: nothing resolved for it)."""
    for parallelism in registry.in_apply_order():
        parallelism.apply(model, resolved.get(parallelism.name), mesh, state)
