"""One attention-backend interface, the same with or without context parallelism, and the registry of backends.

An `AttentionBackend` is a named local kernel (`kernels.py`) plus where it can run: `available()` says whether this
machine has what it needs (CUDA, a package), `supports(...)` whether it can run one call (device, dtype, mask, LSE,
head size), and `attend(q, k, v, mask, scale, return_lse)` runs it. Ring and Ulysses call it for their local
attention (`context_parallel/attention.py`, as `backend(q, k, v, mask, scale) -> (out, lse)`); a model without CP
has its attention routed to it by one recorded patch (`route.py`, `runtime/attention.py`). `refusal` is the one
error for a backend that cannot run: it names the backend, the reason, and the backends that can.

Adding a kernel: write it in `kernels.py` with the `(q, k, v, mask, scale) -> (out, lse or None)` contract, add an
`AttentionBackend` to `BACKENDS` below with its limits; `tests/test_kernels.py` compares every backend available
here with the math reference.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from paradiff.attention import kernels
from paradiff.errors import ParallelConfigError

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", float], tuple]
HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class AttentionBackend:
    """A local attention kernel and the conditions it runs under. `devices`: device types it runs on (None: any);
    `dtypes`: on CUDA, the dtypes it takes (None: any float); `masks`: whether it takes a mask or bias on CUDA;
    `max_head_dim`: on CUDA, the largest head size; `package`: a package it needs besides torch."""

    name: str
    kernel: Kernel
    summary: str
    returns_lse: bool = True
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    masks: bool = True
    max_head_dim: int | None = None
    package: str | None = None

    def available(self) -> str | None:
        """Why this machine cannot run the backend at all, or None when it can."""
        if self.package is not None and importlib.util.find_spec(self.package) is None:
            return f"needs the {self.package} package"
        if self.devices is not None and self.devices == ("cuda",) and not torch.cuda.is_available():
            return "needs a CUDA device"
        return None

    def supports(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 mask: bool = False, needs_lse: bool = False, head_dim: int | None = None) -> str | None:
        """Why the backend cannot run attention of this kind, or None when it can. Unknown conditions (None) are not
        checked; `mask`: whether the call has a mask or bias; `needs_lse`: whether the caller merges partial results
        by log-sum-exp (ring, unified, a replicated key prefix)."""
        reason = self.available()
        if reason is not None:
            return reason
        if needs_lse and not self.returns_lse:
            return "returns no log-sum-exp"
        kind = None if device is None else torch.device(device).type
        if kind is not None and self.devices is not None and kind not in self.devices:
            return f"runs on {' or '.join(self.devices)} only, not {kind}"
        if kind != "cuda":
            return None
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"takes {names} on CUDA, not {str(dtype).removeprefix('torch.')}"
        if mask and not self.masks:
            return "takes no attention mask on CUDA"
        if head_dim is not None and self.max_head_dim is not None and head_dim > self.max_head_dim:
            return f"takes heads of up to {self.max_head_dim} channels on CUDA, not {head_dim}"
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
               scale: float | None = None, return_lse: bool = False):
        """Attention of (batch, heads, queries, dim) q over k / v, in q's dtype; with `return_lse` also the fp32
        log-sum-exp of each query row (a backend without one is refused)."""
        reason = self.supports(q.device, q.dtype, mask is not None, return_lse, q.shape[-1])
        if reason is not None:
            raise refusal(self.name, reason, device=q.device, dtype=q.dtype, mask=mask is not None,
                          needs_lse=return_lse, head_dim=q.shape[-1])
        out, lse = self.kernel(q, k, v, mask, kernels.default_scale(q.shape[-1]) if scale is None else scale)
        return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)

    def __call__(self, q, k, v, mask, scale):
        """The kernel contract ring and Ulysses use: (out, lse or None), out in fp32 where the kernel merges."""
        return self.kernel(q, k, v, mask, scale)


BACKENDS: dict[str, AttentionBackend] = {backend.name: backend for backend in (
    AttentionBackend("native", kernels.native_attention,
                     "PyTorch's kernels that return the LSE: flash-for-CPU on CPU; flash (no mask, fp16/bf16) or "
                     "memory-efficient on CUDA; the math kernel elsewhere"),
    AttentionBackend("math", kernels.math_attention, "plain torch in fp32, any device: the reference"),
    AttentionBackend("flash", kernels.flash_attn_attention, "the flash-attn package", devices=("cuda",),
                     dtypes=HALF, masks=False, max_head_dim=256, package="flash_attn"),
    AttentionBackend("sdpa", kernels.sdpa_attention, "torch's SDPA, its own kernel choice; no LSE", returns_lse=False),
    AttentionBackend("sdpa-flash", kernels.sdpa_flash_attention,
                     "SDPA's flash kernel: flash-for-CPU on CPU; on CUDA fp16/bf16, no mask",
                     devices=("cpu", "cuda"), dtypes=HALF, masks=False, max_head_dim=256),
    AttentionBackend("sdpa-efficient", kernels.sdpa_efficient_attention, "SDPA's memory-efficient kernel (CUDA)",
                     devices=("cuda",), dtypes=FLOATS[:3]),
    AttentionBackend("sdpa-cudnn", kernels.sdpa_cudnn_attention, "SDPA's cuDNN kernel (CUDA, fp16/bf16)",
                     devices=("cuda",), dtypes=HALF),
    AttentionBackend("flex", kernels.flex_attention_kernel,
                     "torch's flex attention (unfused in eager mode; fused under paradiff.compile)",
                     devices=("cpu", "cuda")),
)}
RETURNS_LSE = {name: backend.returns_lse for name, backend in BACKENDS.items()}


def available_backends() -> list[str]:
    """The backends this machine can run (in registry order)."""
    return [name for name, backend in BACKENDS.items() if backend.available() is None]


def backend_named(name: str) -> AttentionBackend:
    """The registered backend `name`; a ParallelConfigError naming the valid ones for anything else."""
    if name not in BACKENDS:
        raise ParallelConfigError(f"Unknown attention backend {name!r}; valid backends: {sorted(BACKENDS)}.")
    return BACKENDS[name]


def check_available(name: str) -> AttentionBackend:
    """The registered backend `name` if this machine can run it, else an error naming the ones it can."""
    backend = backend_named(name)
    reason = backend.available()
    if reason is not None:
        raise ParallelConfigError(
            f"Attention backend {name!r} is not available here ({reason}); available: {available_backends()}."
        )
    return backend


def check_choice(name: str, ring: int = 1) -> AttentionBackend:
    """A backend chosen for a run: one this machine runs and, with ring > 1, one that returns the log-sum-exp (the
    device and dtype are checked by each rank before it reads a weight)."""
    return check_supported(name, needs_lse=True) if ring > 1 else check_available(name)


def able_backends(**conditions) -> list[str]:
    """The backends that can run attention of this kind (`AttentionBackend.supports`'s arguments)."""
    return [name for name, backend in BACKENDS.items() if backend.supports(**conditions) is None]


def refusal(name: str, reason: str, **conditions) -> ParallelConfigError:
    """The error for backend `name`, which cannot run attention of this kind (`supports`'s arguments) because
    `reason`: it names the backends that can."""
    return ParallelConfigError(f"Attention backend {name!r} cannot run here: it {reason}; backends that can: "
                               f"{able_backends(**conditions)}.")


def check_supported(name: str, **conditions) -> AttentionBackend:
    """The backend `name` if it can run attention of this kind, else its refusal."""
    backend = check_available(name)
    reason = backend.supports(**conditions)
    if reason is not None:
        raise refusal(name, reason, **conditions)
    return backend
