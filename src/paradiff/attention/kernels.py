"""The local attention kernels: (batch, heads, queries, head_dim) queries against (batch, heads, keys, head_dim)
keys / values, each returning (output, log-sum-exp of each query row) or (output, None) for a kernel without one.

A `mask` is None, a bool tensor (True = attend) or an additive float bias, broadcastable to (batch, heads, queries,
keys): key-padding masks are (batch, 1, 1, keys), query-dependent ones (batch, 1 or heads, queries, keys). Kernels
that return the LSE give a row whose keys are all masked a zero output and lse = -inf (neutral in a ring's merge).
`backends.py` names them and says where each can run.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from paradiff.errors import ParallelConfigError


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _empty_result(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def _zero_dead_rows(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose keys are all masked have lse = -inf; give them a zero output instead of NaN."""
    dead = torch.isneginf(lse)
    # compiled (a model without CP: its attention traced into the graph), branch-free: Dynamo cannot branch on data
    if torch.compiler.is_compiling() or dead.any():
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


def _cpu_flash(q, k, v, mask, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=_additive(mask, q.dtype), scale=scale
    )
    lse = lse.float()
    if mask is not None:
        # this kernel reports lse = 0 (not -inf) for rows with every key masked; an LSE merge needs -inf
        lse = lse.masked_fill(dead_rows(mask).expand_as(lse), float("-inf"))
    return _zero_dead_rows(out.float(), lse)


def _cuda_flash(q, k, v, scale):
    result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    return result[0].float(), result[1].float()


def _cuda_efficient(q, k, v, mask, scale):
    bias = _additive(mask, q.dtype)
    if bias is not None:
        bias = aligned_bias(bias).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    result = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False, scale=scale)
    out, lse = result[0].float(), result[1][..., : q.shape[-2]].float()
    return _zero_dead_rows(out, lse)


def native_attention(q, k, v, mask, scale):
    """PyTorch's own SDPA kernels that expose the LSE: flash-for-CPU on CPU; flash / memory-efficient on CUDA."""
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return _empty_result(q, v)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    if q.device.type == "cpu":
        return _cpu_flash(q, k, v, mask, scale)
    if q.device.type == "cuda":
        if mask is None and q.dtype in (torch.float16, torch.bfloat16):
            return _cuda_flash(q, k, v, scale)
        return _cuda_efficient(q, k, v, mask, scale)
    return math_attention(q, k, v, mask, scale)


def sdpa_flash_attention(q, k, v, mask, scale):
    """SDPA's flash kernel alone: flash-for-CPU (masks, any float dtype) on CPU, as `native_attention` runs it; on
    CUDA fp16 / bf16, no mask."""
    if q.device.type != "cuda":
        return native_attention(q, k, v, mask, scale)
    if mask is not None:  # CUDA's flash kernel has no mask argument: it would attend to every key
        raise ParallelConfigError("backend 'sdpa-flash' takes no attention mask on CUDA; use 'native' or "
                                  "'sdpa-efficient' for masked attention.")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return _empty_result(q, v)
    return _cuda_flash(_unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v), scale)


def sdpa_efficient_attention(q, k, v, mask, scale):
    """SDPA's memory-efficient kernel alone (CUDA): masks and biases, fp32 / fp16 / bf16."""
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return _empty_result(q, v)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    return _cuda_efficient(q, k, v, mask, scale)


def sdpa_cudnn_attention(q, k, v, mask, scale):
    """SDPA's cuDNN kernel alone (CUDA, fp16 / bf16)."""
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return _empty_result(q, v)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    bias = _additive(mask, q.dtype)
    if bias is not None:
        bias = aligned_bias(bias).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, False, False, scale=scale)
    lse = result[1].float().reshape(q.shape[:-1])  # some cuDNN versions give (batch, heads, queries, 1)
    return _zero_dead_rows(result[0].float(), lse)


def flex_attention_kernel(q, k, v, mask, scale):
    """torch's flex attention, the mask as a score modification. Eager, it is an unfused reference that holds the
    whole score matrix (torch warns once; silenced here); compiled (`paradiff.compile`), Inductor fuses it."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return _empty_result(q, v)
    score_mod = None
    if mask is not None:
        bias = _additive(mask, torch.float32).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])

        def score_mod(score, batch, head, query, key):
            return score + bias[batch, head, query, key]

    if torch.compiler.is_compiling():
        out, aux = flex_attention(q, k, v, score_mod=score_mod, scale=scale, return_aux=AuxRequest(lse=True))
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out, aux = flex_attention(q, k, v, score_mod=score_mod, scale=scale, return_aux=AuxRequest(lse=True))
    return _zero_dead_rows(out.float(), aux.lse.float())


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
