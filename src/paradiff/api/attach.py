"""The last step of the load sequence: what paradiff puts on a model it has loaded or parallelised."""

from __future__ import annotations

from typing import Any

from torch import nn

from paradiff.distributed.failures import guarded_call
from paradiff.runtime.caching import install_agreed_caching
from paradiff.runtime.state import ParallelState, set_state
from paradiff.runtime.wrappers import install_wrapper
from paradiff.api.lora import install_lora_support
from paradiff.runtime.offload import install_offload_support


def attach(model: nn.Module, mesh: Any, resolved: Any, cp_resolved: Any, fsdp_blocks: list[str] = ()) -> nn.Module:
    """Record the parallel state on the model, hook CP in, and guard its forward against peer failures."""
    state = ParallelState(mesh=mesh, tp_plan=resolved, fsdp_blocks=list(fsdp_blocks))
    set_state(model, state)
    if cp_resolved is not None:
        from paradiff.context_parallel.apply import apply_context_parallel

        apply_context_parallel(model, state, cp_resolved)
    install_wrapper(model, "failure_guard", guarded_call)
    install_agreed_caching(model, mesh.model_group)
    install_lora_support(model)
    install_offload_support(model)
    return model
