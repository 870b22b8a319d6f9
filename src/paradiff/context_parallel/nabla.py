"""NABLA block-sparse self-attention (Kandinsky 6 SR) over a sequence split across the context-parallel ranks.

NABLA picks, per head and per block of 64 query tokens, the key blocks that hold the top `threshold` share of a
softmax over block means (q-block mean . k-block mean / sqrt(d)), plus a fixed sliding-tile prior. The choice
depends on every block's mean, so a rank's own tokens cannot decide it: each rank sums its tokens' queries and
keys per global block, one all-reduce adds the partial sums (blocks x heads x d numbers, not the tokens), and every
rank then builds the same block mask. Expanded to tokens it is a whole-sequence mask, which the context-parallel
attention (ring, Ulysses) takes like any other; diffusers' flex BlockMask attends whole selected blocks, which is
exactly what the expanded mask keeps. The processor replaces the model's own for the modules a CP plan lists;
with no runtime it is the single-process computation (on SDPA, which torch's FLOP counter can run, unlike eager
flex attention).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from paradiff.distributed.comm import all_gather_int, all_reduce_cp_sums
from paradiff.context_parallel.runtime import ContextParallelRuntime

BLOCK = 64  # tokens per NABLA block (diffusers' Kandinsky 6 SR: one 8 x 8 spatial tile)


def block_means(x: torch.Tensor, start: int, blocks: int, runtime: ContextParallelRuntime | None) -> torch.Tensor:
    """(batch, heads, blocks, d) means over each global block of a (batch, tokens, heads, d) chunk starting at
    `start`, summed over the ranks."""
    index = torch.arange(start, start + x.shape[1], device=x.device) // BLOCK
    sums = x.new_zeros(x.shape[0], blocks, *x.shape[2:]).index_add_(1, index, x)
    if runtime is not None:
        sums = all_reduce_cp_sums(sums, runtime.cp_group, runtime.stats)
    return (sums / BLOCK).transpose(1, 2)


def block_mask(query_means, key_means, prior: torch.Tensor, threshold: float) -> torch.Tensor:
    """(batch, heads, blocks, blocks) bool: each query block keeps the fewest key blocks whose softmax weights add
    up to `threshold`, and the prior's blocks."""
    weights = torch.softmax(query_means @ key_means.transpose(-2, -1) / math.sqrt(query_means.shape[-1]), dim=-1)
    ascending, order = weights.sort(dim=-1)
    keep_sorted = ascending.cumsum(dim=-1) >= 1 - threshold
    keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return keep | prior.bool()


class NablaAttentionProcessor:
    def __init__(self, runtime: ContextParallelRuntime | None = None) -> None:
        self.runtime = runtime

    def __call__(self, attn, hidden_states: torch.Tensor, rotary_emb: torch.Tensor, sparse_params: dict):
        from diffusers.models.transformers.transformer_kandinsky6_sr import apply_rotary

        query, key, value = (layer(hidden_states).unflatten(-1, (attn.num_heads, -1))
                             for layer in (attn.to_query, attn.to_key, attn.to_value))
        query = apply_rotary(attn.query_norm(query.float()).type_as(query), rotary_emb)
        key = apply_rotary(attn.key_norm(key.float()).type_as(key), rotary_emb)
        runtime = self.runtime
        if runtime is None:
            total, start = query.shape[1], 0
        else:
            lengths = all_gather_int(query.shape[1], runtime.cp_group, query.device)
            total, start = sum(lengths), sum(lengths[:runtime.cp_rank])
        if total % BLOCK:
            raise ValueError(f"NABLA attention takes whole blocks of {BLOCK} tokens; the sequence has {total}.")
        blocks = total // BLOCK
        keep = block_mask(block_means(query, start, blocks, runtime), block_means(key, start, blocks, runtime),
                          sparse_params["sta_mask"], sparse_params["threshold"])
        mask = keep.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)  # whole-sequence token mask
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                             attn_mask=mask)
        return attn.out_layer(out.transpose(1, 2).flatten(2, 3))
