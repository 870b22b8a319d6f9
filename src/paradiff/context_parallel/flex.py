"""Self-attention that diffusers runs on flex attention with a mask function (AnyFlow FAR's chunk-causal BlockMask),
over a sequence split across the context-parallel ranks.

The BlockMask is built over the whole (128-padded) sequence and passed to every block whole. Its mask function,
evaluated on the real tokens, is a whole-sequence boolean mask, which the context-parallel attention (ring, Ulysses)
takes like any other; the rotary tables, also whole, are cut to this rank's rows. With no runtime it is the
single-process computation on SDPA, which torch's FLOP counter can run (eager flex attention cannot).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

from paradiff.distributed.comm import all_gather_int
from paradiff.context_parallel.runtime import ContextParallelRuntime


def dense_mask(block_mask, tokens: int, device: torch.device) -> torch.Tensor:
    """(1, 1, tokens, tokens) bool: the BlockMask's mask function on the first `tokens` queries and keys."""
    return create_mask(block_mask.mask_mod, None, None, tokens, tokens, device=device)


class MaskModAttentionProcessor:
    """For Wan-style attention modules (to_q/to_k/to_v, norm_q/norm_k over all heads, to_out) taking a
    {"query": table, "key": table} complex rotary dict of shape (1, 1, tokens, head_dim / 2)."""

    def __init__(self, runtime: ContextParallelRuntime | None = None) -> None:
        self.runtime = runtime

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None, kv_cache=None, kv_cache_flag=None) -> torch.Tensor:
        from diffusers.models.transformers.transformer_anyflow_far import apply_rotary_emb

        if encoder_hidden_states is not None or kv_cache is not None:
            raise NotImplementedError("The mask-function attention processor serves cache-free self-attention only.")
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        query, key = query.to(hidden_states.dtype), key.to(hidden_states.dtype)
        query, key, value = (t.unflatten(2, (attn.heads, -1)).transpose(1, 2) for t in (query, key, value))
        local = query.shape[2]
        if self.runtime is None:
            total, start = local, 0
        else:
            lengths = all_gather_int(local, self.runtime.cp_group, query.device)
            total, start = sum(lengths), sum(lengths[:self.runtime.cp_rank])
        if rotary_emb is not None:
            query = apply_rotary_emb(query, rotary_emb["query"].narrow(2, start, local))
            key = apply_rotary_emb(key, rotary_emb["key"].narrow(2, start, local))
        mask = None if attention_mask is None else dense_mask(attention_mask, total, query.device)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))
