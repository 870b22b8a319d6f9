"""Run on every rank by tests/test_cp_mechanisms.py: linear attention and halo convolutions on their own, against
the single-process diffusers / torch computation."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paradiff.distributed.comm import CommStats
from paradiff.context_parallel.attention import local_chunk
from paradiff.context_parallel.grid import grid_layout, halo_conv_hooks, split_grid
from paradiff.context_parallel.linear import LinearAttentionProcessor
from paradiff.context_parallel.plan import GridSplit
from paradiff.context_parallel.runtime import ContextParallelRuntime


def _runtime() -> ContextParallelRuntime:
    return ContextParallelRuntime(mode="ring", cp_group=dist.group.WORLD, ring_group=dist.group.WORLD,
                                  ulysses_group=None, stats=CommStats())


def linear_attention(rotary: bool) -> dict:
    """Sana's (rotary: Sana-Video's) linear attention over 13 tokens split across the ranks equals the diffusers
    processor on the whole sequence, with one all-reduce."""
    from diffusers.models.attention_processor import Attention, SanaLinearAttnProcessor2_0
    from diffusers.models.transformers.transformer_sana_video import SanaLinearAttnProcessor3_0

    torch.manual_seed(0)
    attn = Attention(query_dim=32, heads=4, dim_head=8, kv_heads=4, qk_norm="rms_norm_across_heads", bias=True,
                     processor=SanaLinearAttnProcessor3_0() if rotary else SanaLinearAttnProcessor2_0()).eval()
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 13, 32, generator=generator)
    kwargs = {}
    if rotary:
        angles = torch.randn(13, 4, generator=generator).repeat_interleave(2, dim=-1)[None, :, None]
        kwargs["rotary_emb"] = (angles.cos(), angles.sin())
    with torch.no_grad():
        expected = attn(hidden, **kwargs)
        runtime = _runtime()
        attn.processor = LinearAttentionProcessor(runtime)
        rank, size = dist.get_rank(), dist.get_world_size()
        local = {name: (local_chunk(cos, 1, rank, size), local_chunk(sin, 1, rank, size))
                 for name, (cos, sin) in kwargs.items()}
        actual = attn(local_chunk(hidden, 1, rank, size), **local)
    wanted = local_chunk(expected, 1, rank, size)
    return {"diff": float((actual - wanted).abs().max() / wanted.abs().max()), "calls": dict(runtime.stats.calls)}


def halo_convolution(kernel: tuple[int, int], rows: int) -> dict:
    """A 'same'-size convolution over rows split by GridSplit equals the whole convolution's rows of this rank."""
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 6, kernel, padding=(kernel[0] // 2, kernel[1] // 2), groups=6)
    grid = torch.randn(2, 6, rows, 4, generator=torch.Generator().manual_seed(1))
    expected = F.conv2d(grid, conv.weight, conv.bias, padding=conv.padding, groups=6)
    runtime = _runtime()
    full, chunks, local_rows = grid_layout([rows, 4], runtime, "grid")
    tokens = grid.flatten(2).transpose(1, 2)  # (batch, rows x width, channels), as a model holds them
    mine = split_grid(tokens, GridSplit(1), (full, chunks), runtime.cp_rank)
    widen, trim = halo_conv_hooks(conv, "conv", runtime)
    conv.register_forward_pre_hook(widen)
    conv.register_forward_hook(trim)
    with torch.no_grad():
        actual = conv(mine.transpose(1, 2).unflatten(2, (local_rows, 4)))
    start = sum(chunks[: runtime.cp_rank]) // 4
    wanted = expected.narrow(2, start, local_rows)
    return {"rows": local_rows, "diff": float((actual - wanted).abs().max()), "calls": dict(runtime.stats.calls)}


def gathered_cross_attention(text: int) -> dict:
    """Cross-attention from split queries to another split stream (keys gathered) equals SDPA over all keys, also on
    a rank holding none of the keys, whose key mask arrives as the model cut it ([-0:], every column)."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 9, 8, generator=generator)
    k, v = (torch.randn(2, 4, text, 8, generator=generator) for _ in range(2))
    mask = torch.ones(2, 1, 1, text, dtype=torch.bool)
    mask[-1, ..., -1] = False
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    runtime = _runtime()
    rank, size = dist.get_rank(), dist.get_world_size()
    local_k, local_v, local_mask = (local_chunk(t, dim, rank, size) for t, dim in ((k, 2), (v, 2), (mask, 3)))
    if local_k.shape[2] == 0:
        local_mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)  # what `mask[..., -0:]` of a wider mask gives
    actual = runtime.attention(local_chunk(q, 2, rank, size), local_k, local_v, attn_mask=local_mask,
                               gather_keys=True)
    wanted = local_chunk(expected, 2, rank, size)
    return {"keys": local_k.shape[2], "diff": float((actual - wanted).abs().max())}


def prefix_attention(mode: str) -> dict:
    """Keys [a replicated prefix, split tokens] (Cosmos3's text then generation tokens) attended by split queries,
    and the prefix's own causal attention computed whole, both equal SDPA over the whole sequence."""
    generator = torch.Generator().manual_seed(4)
    prefix, tokens = 5, 11
    q_prefix, k_prefix, v_prefix = (torch.randn(1, 4, prefix, 8, generator=generator) for _ in range(3))
    q, k, v = (torch.randn(1, 4, tokens, 8, generator=generator) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, torch.cat([k_prefix, k], 2), torch.cat([v_prefix, v], 2))
    expected_causal = F.scaled_dot_product_attention(q_prefix, k_prefix, v_prefix, is_causal=True)
    world = dist.group.WORLD
    runtime = ContextParallelRuntime(mode=mode, cp_group=world, ring_group=world if mode == "ring" else None,
                                     ulysses_group=world if mode == "ulysses" else None)
    rank, size = dist.get_rank(), dist.get_world_size()
    local = [local_chunk(t, 2, rank, size) for t in (q, k, v)]
    actual = runtime.attention(local[0], torch.cat([k_prefix, local[1]], 2), torch.cat([v_prefix, local[2]], 2),
                               prefix=prefix)
    causal = runtime.attention(q_prefix, k_prefix, v_prefix, is_causal=True, prefix=prefix)
    return {"diff": float((actual - local_chunk(expected, 2, rank, size)).abs().max()),
            "causal": float((causal - expected_causal).abs().max())}
