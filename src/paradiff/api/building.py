"""What building a model before any weight is read needs, shared by `from_pretrained` (`model.py`), GGUF files
(`single_file.py`) and FSDP (`fsdp.py`): parameters on the meta device, the dtype each parameter is read in, and
the prepared model a rank has checked.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from paradiff.io.checkpoint import Checkpoint
from paradiff.io.weights import target_dtype  # noqa: F401 - public here (single_file.py, fsdp.py)
from paradiff.tensor_parallel.plan import ResolvedPlan


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device while keeping buffers and tensor attributes real.

    Rotary tables (Wan's `rope.freqs_*`, Qwen's `pos_freqs`) are computed in `__init__` and are not in the checkpoint,
    so a plain `torch.device("meta")` context would lose them. This swaps `register_parameter` for the duration of
    construction only (the same technique accelerate's init_empty_weights uses); construction is single-threaded.

    Each meta parameter is marked initialised (`_is_hf_initialized`, the flag transformers' weight initialisation
    skips a tensor on): a transformers model's `post_init` would otherwise fill every meta parameter through torch's
    Python reference kernels, a quarter of a tiny pipeline's load, for nothing (the checkpoint's tensors replace
    them). Buffers stay real and are initialised as before.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            if param.device.type != "meta":
                param = module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            param._is_hf_initialized = True

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


@dataclass
class _Prepared:
    model: nn.Module
    checkpoint: Checkpoint
    parallel: Any
    resolved: ResolvedPlan | None
    cp_resolved: Any
    dtype: torch.dtype
    device: torch.device
    facts: dict
    source: Any  # io.weights.WeightSource: reads `checkpoint` into `model`
    quantization: Any = None  # quant.schemes.QuantScheme: quantized on each rank's slice after the read
