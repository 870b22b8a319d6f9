"""paradiff: tensor, context, CFG and data parallelism for diffusers transformers, on GPUs (NCCL) and CPUs (gloo).

The public names are imported on first use (PEP 562): `import paradiff` alone does not import torch or diffusers,
so the `paradiff` command answers a bad flag, and starts its workers, without paying the seconds those imports
take; `paradiff.from_pretrained` and the rest import what they need when first touched.
"""

from __future__ import annotations

import importlib
from typing import Any

from paradiff.runtime.import_noise import quiet_optional_backend_imports

quiet_optional_backend_imports()  # before diffusers (and through it peft, torchao, bitsandbytes) is imported

# public name -> the module defining it
_EXPORTS = {
    "block_identifiers": "paradiff.runtime.repeated_blocks",
    "CacheMonitor": "paradiff.runtime.caching",
    "cache_monitor": "paradiff.runtime.caching",
    "enable_cache": "paradiff.runtime.caching",
    "compile": "paradiff.runtime.compilation",
    "describe": "paradiff.runtime.describe",
    "patches": "paradiff.runtime.patches",
    "remove_patches": "paradiff.runtime.patches",
    "ContextParallelConfig": "paradiff.config",
    "ParallelConfig": "paradiff.config",
    "TensorParallelConfig": "paradiff.config",
    "set_attention_backend": "paradiff.runtime.attention",
    "ContextParallelPlan": "paradiff.context_parallel.plan",
    "Count": "paradiff.context_parallel.plan",
    "Split": "paradiff.context_parallel.plan",
    "TokenGroups": "paradiff.context_parallel.plan",
    "CheckpointError": "paradiff.errors",
    "DistributedError": "paradiff.errors",
    "ParadiffError": "paradiff.errors",
    "ParallelConfigError": "paradiff.errors",
    "PlanError": "paradiff.errors",
    "UnsupportedModelError": "paradiff.errors",
    "from_pretrained": "paradiff.api.model",
    "from_single_file": "paradiff.api.model",
    "enable_parallelism": "paradiff.api.parallelize",
    "split_between_processes": "paradiff.api.data_parallel",
    "load_pipeline": "paradiff.api.pipeline",
    "save_pretrained": "paradiff.io.saving",
    "TensorParallelPlan": "paradiff.tensor_parallel.plan",
    "ColwiseHeads": "paradiff.tensor_parallel.styles",
    "HeadNorm": "paradiff.tensor_parallel.styles",
    "PackedColwise": "paradiff.tensor_parallel.styles",
    "PackedColwiseParallel": "paradiff.tensor_parallel.styles",
    "PackedRowwise": "paradiff.tensor_parallel.styles",
    "PackedRowwiseParallel": "paradiff.tensor_parallel.styles",
    "SplitParameter": "paradiff.tensor_parallel.styles",
    "parallelize_vae": "paradiff.api.vae",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paradiff' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
