"""Local attention kernels that also return the log-sum-exp (LSE) of each query row, and the LSE merge.

Ring attention computes a query block against one key/value block at a time; the partial outputs are combined
exactly with their LSEs: out = sum_i exp(lse_i - lse) * out_i, lse = log sum_i exp(lse_i). Merging happens in fp32.

Tensors are (batch, heads, seq, head_dim). A `mask` is None, a bool tensor (True = attend) or an additive float bias,
broadcastable to (batch, heads, queries, keys): key-padding masks are (batch, 1, 1, keys), query-dependent ones
(batch, 1 or heads, queries, keys).
"""

from __future__ import annotations

import importlib.util
import math
from typing import Callable

import torch
import torch.nn.functional as F

from paradiff.errors import ParallelConfigError

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", float], tuple]


def _empty_result(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def _zero_dead_rows(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose keys are all masked have lse = -inf; give them a zero output instead of NaN."""
    dead = torch.isneginf(lse)
    if dead.any():
        out = torch.where(dead.unsqueeze(-1), torch.zeros((), dtype=out.dtype, device=out.device), out)
    return out, lse


def dead_rows(mask: torch.Tensor) -> torch.Tensor:
    """Query rows (mask shape without the key dim) in which every key is masked out."""
    return ~mask.any(dim=-1) if mask.dtype == torch.bool else torch.isneginf(mask).all(dim=-1)


def math_attention(q, k, v, mask, scale):
    """Plain torch, fp32 accumulation, any device: the reference every other kernel is tested against."""
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return _empty_result(q, v)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return _zero_dead_rows(torch.matmul(weights, v.float()), lse)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill(~mask, float("-inf"))


def aligned_bias(bias: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """`bias` as a view into a buffer whose rows are padded to `multiple` elements: CUDA's memory-efficient kernel
    needs every stride but the last to be a multiple of 8 (half) or 4 (fp32), which a mask over, say, 131 keys is
    not (found on an H200: "attn_bias is not correctly aligned (strideB)")."""
    keys = bias.shape[-1]
    if keys % multiple == 0:
        return bias
    padded = bias.new_zeros(*bias.shape[:-1], keys + (-keys) % multiple)
    padded[..., :keys] = bias
    return padded[..., :keys]


def _unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor with its features (last dim) adjacent in memory. The fused kernels below read rows of the last dim
    as dense vectors and are called directly (F.scaled_dot_product_attention checks this and falls back to its math
    path; these ops do not check): a view whose features are strided, e.g. heads cut from a channels-first VAE
    activation, would be read as other memory."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def native_attention(q, k, v, mask, scale):
    """PyTorch's own SDPA kernels that expose the LSE: flash-for-CPU on CPU; flash / memory-efficient on CUDA."""
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return _empty_result(q, v)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=_additive(mask, q.dtype), scale=scale
        )
        lse = lse.float()
        if mask is not None:
            # this kernel reports lse = 0 (not -inf) for rows with every key masked; an LSE merge needs -inf
            lse = lse.masked_fill(dead_rows(mask).expand_as(lse), float("-inf"))
        return _zero_dead_rows(out.float(), lse)
    if q.device.type == "cuda":
        if mask is None and q.dtype in (torch.float16, torch.bfloat16):
            result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
            return result[0].float(), result[1].float()
        bias = _additive(mask, q.dtype)
        if bias is not None:
            bias = aligned_bias(bias).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        result = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False, scale=scale)
        out, lse = result[0].float(), result[1][..., : q.shape[-2]].float()
        return _zero_dead_rows(out, lse)
    return math_attention(q, k, v, mask, scale)


def flash_attn_attention(q, k, v, mask, scale):
    """The flash-attn package (CUDA, fp16/bf16, no mask)."""
    if mask is not None:
        raise ParallelConfigError("backend 'flash' takes no attention mask; use 'native' or 'math' for masked models.")
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, return_attn_probs=True
    )
    return out.transpose(1, 2).float(), lse.float()


def sdpa_attention(q, k, v, mask, scale):
    """torch's public SDPA: fastest kernel choice, but no LSE, so it can only serve Ulysses and local attention."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)  # SDPA takes a bias of the query's dtype only
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out, None


BACKENDS: dict[str, Kernel] = {
    "native": native_attention,
    "math": math_attention,
    "flash": flash_attn_attention,
    "sdpa": sdpa_attention,
}
RETURNS_LSE = {"native": True, "math": True, "flash": True, "sdpa": False}


def available_backends() -> list[str]:
    names = ["native", "math", "sdpa"]
    if importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available():
        names.append("flash")
    return names


def check_backend(name: str, mode: str) -> None:
    """A backend must exist here and, for ring and unified attention, return the LSE."""
    if name not in BACKENDS:
        raise ParallelConfigError(f"Unknown attention backend {name!r}; valid backends: {sorted(BACKENDS)}.")
    if name not in available_backends():
        raise ParallelConfigError(
            f"Attention backend {name!r} is not available here (needs CUDA and the flash-attn package); "
            f"available: {available_backends()}."
        )
    if mode in ("ring", "unified") and not RETURNS_LSE[name]:
        can = [b for b in available_backends() if RETURNS_LSE[b]]
        raise ParallelConfigError(
            f"Attention backend {name!r} returns no log-sum-exp, which {mode} attention needs to merge blocks; "
            f"backends that can serve {mode}: {can}."
        )


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def merge_lse(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention results over disjoint key sets (fp32)."""
    if out is None:
        return block_out.float(), block_lse.float()
    new_lse = torch.logaddexp(lse, block_lse)
    dead = torch.isneginf(new_lse)
    safe = torch.where(dead, torch.zeros_like(new_lse), new_lse)
    keep_old = torch.where(dead, torch.zeros_like(lse), torch.exp(lse - safe)).unsqueeze(-1)
    keep_new = torch.where(dead, torch.zeros_like(block_lse), torch.exp(block_lse - safe)).unsqueeze(-1)
    return out * keep_old + block_out.float() * keep_new, new_lse
