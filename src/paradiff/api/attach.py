"""The last step of the load sequence: what paradiff puts on a model it has loaded or parallelised."""

from __future__ import annotations

from typing import Any

from torch import nn

from paradiff.distributed.failures import guarded_call
from paradiff.runtime.caching import install_agreed_caching
from paradiff.runtime.patches import set_attribute
from paradiff.runtime.state import ParallelState, set_state
from paradiff.runtime.wrappers import install_wrapper
from paradiff.api.lora import install_lora_support
from paradiff.runtime.offload import install_offload_support
from paradiff.api.parallelisms import REGISTRY, apply_parallelisms, enabled_parallelisms
from paradiff.distributed.parallelism import Registry


def attach(model: nn.Module, mesh: Any, resolved: Any, cp_resolved: Any, fsdp_blocks: list[str] = (), *,
           registry: Registry = REGISTRY, plans: dict[str, Any] | None = None) -> nn.Module:
    """Record the parallel state on the model, put on each parallelism's changes in the registry's order (CP's
    hooks: `api/parallelisms.py`), and guard its forward against peer failures. `plans`: resolved plans of other
    parallelisms of `registry`, by name. The parallelisms `registry` enables are kept in the state: their step
    hooks run per denoising step of a pipeline (`runtime/steps.py`)."""
    state = ParallelState(mesh=mesh, tp_plan=resolved, fsdp_blocks=list(fsdp_blocks),
                          parallelisms=enabled_parallelisms(mesh.config, registry))
    set_state(model, state)
    resolved_plans = {**(plans or {}), "tp": resolved, "cp": cp_resolved, "fsdp": list(fsdp_blocks)}
    apply_parallelisms(model, mesh, state, resolved_plans, registry)
    install_wrapper(model, "failure_guard", guarded_call)
    install_agreed_caching(model, mesh.model_group)
    install_lora_support(model)
    install_offload_support(model)
    if resolved is not None and hasattr(model, "save_config"):
        install_gathered_saving(model)
    return model


def install_gathered_saving(model: nn.Module) -> None:
    """A tensor-parallel model's own `save_pretrained` (diffusers') would write each rank's slices as if they were the
    weights, a checkpoint nothing loads: on the instance it writes through `paradiff.save_pretrained` instead (the
    full tensors gathered, rank 0 writing), and refuses by name the options that one does not take."""
    from paradiff.errors import UnsupportedModelError
    from paradiff.io.saving import save_pretrained

    def gathered(save_directory, is_main_process: bool = True, save_function=None, safe_serialization: bool = True,
                 variant=None, max_shard_size="10GB", push_to_hub: bool = False, **kwargs) -> None:
        refused = {name: value for name, value in (("save_function", save_function), ("variant", variant),
                                                   ("push_to_hub", push_to_hub or None)) if value is not None}
        if not safe_serialization:
            refused["safe_serialization"] = False
        refused.update(kwargs)
        if refused:
            raise UnsupportedModelError(
                f"{type(model).__name__}.save_pretrained on a tensor-parallel model writes through "
                f"paradiff.save_pretrained (each tensor gathered, rank 0 writing safetensors), which takes no "
                f"{sorted(refused)}; save it with those defaults, then post-process the folder")
        save_pretrained(model, save_directory, max_shard_size=max_shard_size)

    set_attribute(model, "save_pretrained", gathered, by="tp")
