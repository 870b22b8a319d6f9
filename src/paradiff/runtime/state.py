"""What paradiff attaches to a model: one typed ModelState, under one attribute.

Its `parallel` part (mesh, resolved TP plan, CP runtime, hooks and plan) exists on a parallelised model only; the
cache monitor and the forward wrappers can sit on any model paradiff touches (`paradiff.enable_cache` on a plain
diffusers model). Stored on the model instance (never in a module-level global), so two models in one process stay
independent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from paradiff.distributed.mesh import ParallelMesh
from paradiff.runtime.patches import PRIVATE_PREFIX
from paradiff.runtime.wrapper_registry import WrapperRegistry
from paradiff.tensor_parallel.plan import ResolvedPlan

STATE_ATTR = PRIVATE_PREFIX + "state"


@dataclass
class ParallelState:
    mesh: ParallelMesh
    tp_plan: ResolvedPlan | None = None
    context: Any = None  # context_parallel.runtime.ContextParallelRuntime when CP is on
    cp_plan: Any = None  # context_parallel.apply.ResolvedContextPlan when CP is on
    cp_hooks: list[Any] = field(default_factory=list)  # runtime.patches.HookHandle: CP's hooks, each a recorded patch
    fsdp_blocks: list[str] = field(default_factory=list)  # the blocks FSDP2 shards, one unit each (fsdp/apply.py)
    # the parallelisms (distributed.parallelism.Parallelism) its config enables, in the registry's apply order: those
    # attach applied, whose step hooks a pipeline runs (runtime/steps.py)
    parallelisms: tuple[Any, ...] = ()


@dataclass
class ModelState:
    parallel: ParallelState | None = None
    cache_monitor: Any = None  # runtime.caching.CacheMonitor once a step cache went through paradiff
    wrappers: WrapperRegistry = field(default_factory=WrapperRegistry)
    adapter_bank: Any = None  # api.lora_slots.AdapterBank once per-sample adapter slots are enabled


@dataclass
class PipelineState:
    """What paradiff keeps on a loaded pipeline (`ParallelPipelineMixin`)."""

    base_name: str  # the diffusers pipeline class it was loaded as (picks the CFG rule)
    modular: bool = False  # a Modular Diffusers pipeline (blocks, guider components)
    guided: bool = False  # guidance through guider components (modular pipelines, PipelineSpec.guider)
    # runtime.cfg.CfgSplitter / BatchCfgSplitter, one per transformer (Wan 2.2 A14B has two); a guided pipeline's
    # one runtime.cfg.GuidedBranches
    cfgs: tuple[Any, ...] = ()
    check_latents: bool = False  # set at each call: the next transformer call compares the initial latents
    stages: Any = None  # runtime.stages.StageRunner
    steps: Any = None  # runtime.steps.StepHooks: the parallelisms' per-step hooks (None: none has any)


def model_state(model: nn.Module, create: bool = True) -> ModelState | None:
    state = getattr(model, STATE_ATTR, None)
    if state is None and create:
        state = ModelState()
        # object.__setattr__ keeps the state out of nn.Module's submodule/parameter registries
        object.__setattr__(model, STATE_ATTR, state)
    return state


def get_state(model: nn.Module) -> ParallelState | None:
    state = getattr(model, STATE_ATTR, None)
    return state.parallel if state is not None else None


def set_state(model: nn.Module, state: ParallelState) -> None:
    model_state(model).parallel = state
