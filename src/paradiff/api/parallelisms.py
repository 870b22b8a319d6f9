"""The model face of each registered parallelism (`distributed/parallelism.py` declares their dimensions and
degrees): how it checks and resolves its plan for a model, what it puts on a model while it is loaded and once it
is, on a loaded pipeline, and per denoising step. Each wraps its mechanism, unchanged: TP in `tensor_parallel/`, CP
in `context_parallel/`, FSDP in `fsdp/` (via `api/fsdp.py`), CFG in `runtime/cfg.py`.

`REGISTRY` is `PARALLELISMS` with these bound: same names, dimensions and order. Every entry point takes another
registry (a test's, with a parallelism of its own) in its place, and every phase walks it in its apply order (TP,
CP, FSDP, CFG, data):
- resolve (`resolve_plans`: while preparing, before anything is read). `from_pretrained` and `load_pipeline` resolve
  TP, CP and FSDP in their loaders (`api/model.py`, `api/pipeline_components.py`: checked against the checkpoint
  headers, a text encoder's TP over its own group) and hand those in as `known`; every other is resolved here;
- load time (`before_read`, `after_read`, in `api/load_sequence.py`): shard-on-read stays shard-on-read: FSDP shards
  the component on the meta device before the read, so each rank reads its rows; TP swaps in its sharded linears
  after the read (each rank read only its slices; with FSDP, FSDP swapped them before the read);
- attach (`apply_parallelisms`): CP's hooks;
- pipeline (`apply_to_pipelines`, by `api/pipeline.py`): CFG on the pipeline's transformers (it needs the
  pipeline's CFG rule); data parallelism splits the inputs (`api/data_parallel.py`), nothing on the model;
- per step (`runtime/steps.py`): CFG closes each step's pair of two-call branches.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from paradiff.distributed.mesh import rank_coordinates
from paradiff.distributed.parallelism import (PARALLELISMS, CfgParallelism, ContextParallelism, FsdpParallelism,
                                              Registry, TensorParallelism)
from paradiff.api.fsdp import check_fsdp, shard_component
from paradiff.plans import plan_for
from paradiff.tensor_parallel.plan import as_plan, resolve_plan
from paradiff.tensor_parallel.shard import swap_in_sharded_linears


class TensorParallelModel(TensorParallelism):
    """TP: this rank's slices of the family's tensor plan (or the caller's). Its sharded linears are swapped in by
    the load sequence once the weights are read; the resolved plan is kept in the model's state."""

    def resolve_plan(self, config: Any, model: nn.Module, plan: Any, coordinates: Any) -> Any:
        return resolve_plan(model, as_plan(plan_for(model, plan, "tensor")), coordinates.tp_rank, config.tp_degree)

    def after_read(self, component: Any, mesh: Any, read: str) -> None:
        # a component with a TP plan (a text encoder split over the CP ranks too); FSDP swapped its linears already
        if component.resolved is not None and component.blocks is None:
            swap_in_sharded_linears(component.model, component.resolved, component.group,
                                    weights_are_local=read == "all")


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

    def before_read(self, component: Any, mesh: Any, device: Any, read: str) -> None:
        if component.blocks is not None:  # on the meta device (read next) or in memory: no collective yet
            shard_component(component, mesh, component.group, read == "all", device)


class CfgModel(CfgParallelism):
    """CFG: the branches' exchange on each transformer of a pipeline, by the pipeline's CFG rule (two calls, one
    batch) or through its guiders (`runtime/cfg.py`); per step, a two-call pair is closed (`CfgSplitter.step_done`).
    A bare model (`from_pretrained`) has no rule to follow: nothing is put on it."""

    def apply_to_pipeline(self, pipeline: Any, models: list[nn.Module], mesh: Any) -> None:
        from paradiff.api.modular import install_guided_cfg
        from paradiff.plans.pipelines import pipeline_spec
        from paradiff.runtime.cfg import install_cfg_parallel

        state, group = pipeline._paradiff_pipeline, mesh.group("cfg")
        if state.guided:
            state.cfgs = (install_guided_cfg(models, group),)
        else:
            state.cfgs = tuple(install_cfg_parallel(model, group, pipeline_spec(state.base_name).cfg)
                               for model in models)

    def after_step(self, model: nn.Module, step: int) -> None:
        from paradiff.runtime.cfg import cfg_step_done

        cfg_step_done(model, step)


REGISTRY = PARALLELISMS.binding(TensorParallelModel(), ContextParallelModel(), FsdpModel(), CfgModel())


def resolve_plans(model: nn.Module, config: Any, given: dict[str, Any] | None = None,
                  registry: Registry = REGISTRY, known: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each parallelism `config` uses, validated and resolved for `model` on this rank, in apply order: name -> its
    resolved plan (None where it resolves none). `given`: the caller's plans by name ("tp", "cp"); None takes the
    model family's. `known`: plans a loader resolved already, by name (taken as they are). Runs while preparing: no
    weight read, no collective."""
    coordinates = rank_coordinates(config)
    resolved = {}
    for parallelism in registry.in_apply_order():
        if known is not None and parallelism.name in known:
            resolved[parallelism.name] = known[parallelism.name]
        elif parallelism.enabled(config):
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


def enabled_parallelisms(config: Any, registry: Registry = REGISTRY) -> tuple[Any, ...]:
    """The parallelisms of `registry` that `config` uses, in its apply order."""
    return tuple(parallelism for parallelism in registry.in_apply_order() if parallelism.enabled(config))


def apply_to_pipelines(pipeline: Any, models: list[nn.Module], mesh: Any, registry: Registry = REGISTRY) -> None:
    """Put each enabled parallelism's pipeline changes on `pipeline` (its attached transformers: `models`), in the
    registry's apply order."""
    for parallelism in enabled_parallelisms(mesh.config, registry):
        parallelism.apply_to_pipeline(pipeline, models, mesh)
