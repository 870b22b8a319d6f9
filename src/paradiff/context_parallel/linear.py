"""ReLU linear attention (Sana, Sana-Video) over a sequence split across the context-parallel ranks.

For each head, with phi = ReLU and an optional rotary R applied to the numerator's queries and keys:

    out_i = sum_j v_j <R phi(k_j), R phi(q_i)> / (<sum_j phi(k_j), phi(q_i)> + eps)
          = (KV^T R phi(q_i)) / (<K_sum, phi(q_i)> + eps),   KV = sum_j v_j (R phi(k_j))^T,  K_sum = sum_j phi(k_j)

KV and K_sum are sums over the keys: each rank sums its own tokens, one all-reduce adds the ranks' partial sums
(d x (d + 1) numbers per head, whatever the sequence length), and every rank finishes its own queries. Exact.
The processor replaces the model's own for the modules a CP plan lists; under TP it runs on the rank's heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paradiff.distributed.comm import all_reduce_cp_sums
from paradiff.context_parallel.runtime import ContextParallelRuntime

EPS = 1e-15  # added to the normaliser, as Sana does


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) feature pair by its angle; the tables hold every angle twice (pair-interleaved)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class LinearAttentionProcessor:
    def __init__(self, runtime: ContextParallelRuntime) -> None:
        self.runtime = runtime

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb=None) -> torch.Tensor:
        if encoder_hidden_states is not None:
            raise NotImplementedError("Context-parallel linear attention sums over this rank's own tokens: it "
                                      "serves self-attention only; list cross-attention as local_attention.")
        dtype = hidden_states.dtype
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))  # (b, n, h, d)
        query, key = F.relu(query), F.relu(key)
        query_num, key_num = query, key
        if rotary_emb is not None:
            query_num, key_num = (rotate_pairs(t, *rotary_emb).type_as(t) for t in (query, key))
        query, key, value, query_num, key_num = (t.float() for t in (query, key, value, query_num, key_num))
        kv = torch.einsum("bnhd,bnhe->bhde", key_num, value)
        key_sum = key.sum(dim=1)  # (b, h, d)
        sums = all_reduce_cp_sums(torch.cat([kv, key_sum.unsqueeze(-1)], dim=-1), self.runtime.cp_group,
                                  self.runtime.stats)
        kv, key_sum = sums[..., :-1], sums[..., -1]
        numerator = torch.einsum("bnhd,bhde->bnhe", query_num, kv)
        denominator = torch.einsum("bnhd,bhd->bnh", query, key_sum).unsqueeze(-1) + EPS
        out = (numerator / denominator).flatten(2).to(dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        if dtype == torch.float16:
            out = out.clip(-65504, 65504)
        return out
