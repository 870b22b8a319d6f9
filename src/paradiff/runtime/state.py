"""What paradiff attaches to a parallelised model: its mesh, resolved TP plan and CP runtime.

Stored on the model instance (never in a module-level global), so two models in one process stay independent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from paradiff.distributed.mesh import ParallelMesh
from paradiff.tensor_parallel.plan import ResolvedPlan

STATE_ATTR = "_paradiff_state"


@dataclass
class ParallelState:
    mesh: ParallelMesh
    tp_plan: ResolvedPlan | None = None
    context: Any = None  # context_parallel.runtime.ContextParallelRuntime when CP is on
    extras: dict[str, Any] = field(default_factory=dict)


def get_state(model: nn.Module) -> ParallelState | None:
    return getattr(model, STATE_ATTR, None)


def set_state(model: nn.Module, state: ParallelState) -> None:
    # object.__setattr__ keeps the state out of nn.Module's submodule/parameter registries
    object.__setattr__(model, STATE_ATTR, state)
