"""paradiff: tensor, context, CFG and data parallelism for diffusers transformers, on GPUs (NCCL) and CPUs (gloo)."""

from paradiff.runtime.import_noise import quiet_optional_backend_imports

quiet_optional_backend_imports()  # before diffusers (and through it peft, torchao, bitsandbytes) is imported


from paradiff.runtime.repeated_blocks import block_identifiers
from paradiff.runtime.caching import CacheMonitor, cache_monitor, enable_cache
from paradiff.runtime.compilation import compile
from paradiff.config import ContextParallelConfig, ParallelConfig, TensorParallelConfig
from paradiff.context_parallel.apply import set_attention_backend
from paradiff.context_parallel.plan import ContextParallelPlan, Count, Split, TokenGroups
from paradiff.errors import (CheckpointError, DistributedError, ParadiffError, ParallelConfigError, PlanError, UnsupportedModelError)
from paradiff.api.model import from_pretrained
from paradiff.api.parallelize import enable_parallelism
from paradiff.api.data_parallel import split_between_processes
from paradiff.api.pipeline import load_pipeline
from paradiff.io.saving import save_pretrained
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import (ColwiseHeads, HeadNorm, PackedColwise, PackedColwiseParallel, PackedRowwise, PackedRowwiseParallel, SplitParameter)
from paradiff.api.vae import parallelize_vae

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
