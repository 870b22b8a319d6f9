"""`enable_parallelism`: parallelise a model that is already in memory, in place."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from paradiff.distributed.agreement import config_fingerprint, fingerprint
from paradiff.runtime.caching import check_cache_config
from paradiff.config import as_parallel_config
from paradiff.errors import UnsupportedModelError
from paradiff.distributed.mesh import require_distributed
from paradiff.api.attach import attach  # noqa: F401 - public here
from paradiff.api.load_sequence import Component, Prepared, run_load_sequence
from paradiff.api.parallelisms import REGISTRY, resolve_plans
from paradiff.distributed.parallelism import Registry
from paradiff.runtime.state import get_state


def check_shardable(model: nn.Module) -> None:
    """Refuse model states whose weights are not plain tensors we can slice (or that someone else places)."""
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"enable_parallelism needs an nn.Module, got {type(model).__name__}.")
    if get_state(model) is not None:
        raise UnsupportedModelError(
            f"{type(model).__name__} is already parallelised by paradiff (enable_parallelism or from_pretrained ran "
            "on it); call it once per model, on a fresh model to change the configuration."
        )
    quantizer = getattr(model, "hf_quantizer", None)
    if getattr(model, "is_quantized", False) or quantizer is not None:
        detail = f" by {type(quantizer).__name__}" if quantizer is not None else ""
        raise UnsupportedModelError(
            f"{type(model).__name__} is quantized{detail} (is_quantized={getattr(model, 'is_quantized', False)}); "
            "paradiff shards unquantized float weights only. Load it without quantization_config, in float32, "
            "float16 or bfloat16."
        )
    if getattr(model, "hf_device_map", None):
        raise UnsupportedModelError(
            f"{type(model).__name__} was placed by accelerate (hf_device_map={model.hf_device_map!r}); load it without "
            "device_map before parallelising."
        )
    for name, module in model.named_modules():
        if hasattr(module, "_hf_hook"):
            raise UnsupportedModelError(
                f"{name or 'model'} has an accelerate hook ({type(module._hf_hook).__name__}), e.g. from CPU "
                "offloading; paradiff splits resident weights. Remove it first (pipe.remove_all_hooks() or "
                "accelerate.hooks.remove_hook_from_module(model, recurse=True)) and enable offloading after "
                "paradiff split the model (pipe.enable_model_cpu_offload() on the paradiff pipeline)."
            )
        registry = getattr(module, "_diffusers_hook", None)
        hooks = getattr(registry, "hooks", {}) if registry is not None else {}
        offload = [str(key) for key in hooks if "offload" in str(key)]
        if offload:
            raise UnsupportedModelError(
                f"{name or 'model'} uses diffusers offloading (hooks {offload}); paradiff splits resident "
                f"weights. Remove it first (module._diffusers_hook.remove_hook({offload[0]!r}, recurse=True)) and "
                "enable offloading after paradiff split the model (model.enable_group_offload(...) on the parallel "
                "model or pipeline: each rank offloads its own shards)."
            )
        peft_config = getattr(module, "peft_config", None)
        if "lora_A" in dict(module.named_children()) or peft_config:
            if isinstance(peft_config, dict) and peft_config:
                found = f"peft_config adapters {sorted(peft_config)}"
            else:
                found = "peft_config is set" if peft_config else "it has a 'lora_A' child"
            raise UnsupportedModelError(
                f"{name or 'model'} carries LoRA adapters ({found}); paradiff splits plain nn.Linear weights only. "
                "Parallelise first, then load the adapters (paradiff splits them: docs/lora.md), or fuse them into "
                "the base weights first (fuse_lora() then unload_lora_weights())."
            )


def enable_parallelism(model: nn.Module, config: Any, *, plan: Any = None, cp_plan: Any = None,
                       registry: Registry = REGISTRY) -> nn.Module:
    """Shard (TP) and/or hook (CP) `model` in place, each parallelism of `registry` in its apply order; returns it.

    Every check runs before any collective; then the ranks agree through the store that all passed and that they
    hold the same model configuration, parameter layout and parallel config.
    """
    def prepare() -> Prepared:
        require_distributed()
        check_shardable(model)
        parallel = as_parallel_config(config, dist.get_world_size())
        if getattr(model, "_cache_config", None) is not None:
            check_cache_config(model._cache_config)
        plans = resolve_plans(model, parallel, {"tp": plan, "cp": cp_plan}, registry)  # in its order: TP, CP, FSDP
        facts = {
            "parallel degrees": parallel.degrees(),
            "model class": type(model).__name__,
            "model config": config_fingerprint(getattr(model, "config", None)),
            "parameters": fingerprint([(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]),
        }
        device = next(model.parameters()).device
        component = Component(model, facts, plans.get("tp"), plans.get("cp"), blocks=plans.get("fsdp"), plans=plans)
        return Prepared({"": component}, parallel, device, registry=registry)

    run_load_sequence("paradiff.enable_parallelism", prepare, distributed=True, read="none", eval_mode=False)
    return model
