"""paradiff: tensor, context, CFG and data parallelism for diffusers transformers, on GPUs (NCCL) and CPUs (gloo)."""

from .blocks import block_identifiers
from .caching import CacheMonitor, cache_monitor, enable_cache
from .compilation import compile
from .config import ContextParallelConfig, ParallelConfig, TensorParallelConfig
from .context_parallel.apply import set_attention_backend
from .context_parallel.plan import ContextParallelPlan, Count, Split, TokenGroups
from .errors import (
    CheckpointError,
    DistributedError,
    ParadiffError,
    ParallelConfigError,
    PlanError,
    UnsupportedModelError,
)
from .loading import from_pretrained
from .parallel import enable_parallelism
from .pipeline import load_pipeline, split_between_processes
from .saving import save_pretrained
from .tensor_parallel.plan import TensorParallelPlan
from .tensor_parallel.styles import (
    ColwiseHeads,
    HeadNorm,
    PackedColwise,
    PackedColwiseParallel,
    PackedRowwise,
    PackedRowwiseParallel,
    SplitParameter,
)
from .vae_api import parallelize_vae

__all__ = [
    "CacheMonitor",
    "CheckpointError",
    "ColwiseHeads",
    "HeadNorm",
    "ContextParallelConfig",
    "ContextParallelPlan",
    "Count",
    "DistributedError",
    "PackedColwise",
    "PackedColwiseParallel",
    "PackedRowwise",
    "PackedRowwiseParallel",
    "ParadiffError",
    "ParallelConfig",
    "ParallelConfigError",
    "PlanError",
    "Split",
    "SplitParameter",
    "TensorParallelConfig",
    "TensorParallelPlan",
    "TokenGroups",
    "UnsupportedModelError",
    "block_identifiers",
    "cache_monitor",
    "compile",
    "enable_cache",
    "enable_parallelism",
    "from_pretrained",
    "load_pipeline",
    "parallelize_vae",
    "save_pretrained",
    "set_attention_backend",
    "split_between_processes",
]
__version__ = "0.1.0"
