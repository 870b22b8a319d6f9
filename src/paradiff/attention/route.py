"""A model's `F.scaled_dot_product_attention` calls run by a chosen backend, without context parallelism.

diffusers' processors end in SDPA when their attention backend is diffusers' "native" (the default), whatever the
processor class, so a TorchFunctionMode active inside each attention module (a module with a `processor`, as context
parallelism intercepts them) reaches every attention of every model without knowing its processors.
`runtime/attention.py` puts it on a model as one recorded patch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from paradiff.attention.backends import AttentionBackend, refusal
from paradiff.attention.kernels import default_scale


def sdpa_call(backend: AttentionBackend, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
              scale=None, enable_gqa=False):
    """What `F.scaled_dot_product_attention(query, key, value, ...)` returns, computed by `backend`: any number of
    leading dims, a bool or additive mask broadcast as SDPA broadcasts it, `is_causal`, grouped K/V heads."""
    if dropout_p != 0.0:
        raise NotImplementedError(f"Attention backend {backend.name!r} runs inference attention: dropout_p must be "
                                  f"0, got {dropout_p} (put the model in eval mode, or use no backend).")
    if is_causal:
        if attn_mask is not None:
            raise ValueError("scaled_dot_product_attention takes attn_mask or is_causal=True, not both.")
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
    if enable_gqa and key.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]  # every query head its K/V head, as SDPA's enable_gqa does
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
    reason = backend.supports(query.device, query.dtype, attn_mask is not None, False, query.shape[-1])
    if reason is not None:
        raise refusal(backend.name, reason, device=query.device, dtype=query.dtype, mask=attn_mask is not None,
                      head_dim=query.shape[-1])
    scale = default_scale(query.shape[-1]) if scale is None else scale
    lead, rows = query.shape[:-2], query.shape[-2]
    mask = attn_mask
    if query.dim() == 4:
        if mask is not None and mask.dim() < 4:
            mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        q, k, v = query, key, value
    else:  # (..., tokens, dim): the leading dims as heads of one sample, the mask broadcast over them first
        q, k, v = (t.reshape(1, -1, *t.shape[-2:]) for t in (query, key, value))
        if mask is not None:
            mask = mask.expand(*lead, *mask.shape[-2:]).reshape(1, -1, *mask.shape[-2:])
    out, _ = backend(q, k, v, mask, scale)
    return out.to(query.dtype).reshape(*lead, rows, value.shape[-1])


class AttentionRoute(TorchFunctionMode):
    """Active inside the model's attention modules: their SDPA calls go to `backend`."""

    def __init__(self, backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return sdpa_call(self.backend, *args, **kwargs)
        if func is torch.Tensor.unflatten and torch.compiler.is_compiling():
            # Dynamo inlines every call routed through a mode; Tensor.unflatten's Python wrapper calls
            # super().unflatten, which it cannot trace, while the functional form is an ordinary graph op.
            func = torch.unflatten
        return func(*args, **kwargs)
