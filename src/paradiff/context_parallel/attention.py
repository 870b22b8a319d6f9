"""Ring, Ulysses and unified attention over a sequence split unevenly across ranks.

Every function takes this rank's (batch, heads, local_seq, head_dim) query/key/value and an optional bool key mask
(batch, 1, 1, local_keys), and returns this rank's output rows, equal to attention over the full sequence.
Uneven lengths are handled by exchanging lengths first: Ulysses uses all-to-all with explicit split sizes, ring pads
each travelling block to the longest and masks the padding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import CommStats, all_gather_int, all_gather_uneven, all_to_all_uneven, ring_pass_start, ring_pass_wait
from .kernels import Kernel, merge_lse


def even_sizes(total: int, parts: int) -> list[int]:
    """Split `total` into `parts` sizes differing by at most one, larger ones first (works for total < parts)."""
    base, extra = divmod(total, parts)
    return [base + (1 if index < extra else 0) for index in range(parts)]


def local_chunk(tensor: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    sizes = even_sizes(tensor.shape[dim], parts)
    return tensor.narrow(dim, sum(sizes[:index]), sizes[index])


def local_attention(q, k, v, key_mask, scale, kernel: Kernel) -> torch.Tensor:
    out, _ = kernel(q, k, v, key_mask, scale)
    return out.to(q.dtype)


def ring_attention(
    q, k, v, key_mask, scale, kernel: Kernel, group: dist.ProcessGroup, stats: CommStats | None = None,
    return_lse: bool = False,
):
    """K/V blocks travel around the ring; the next block's transfer overlaps the attention on the current one.

    No rank holds more than two K/V blocks (current and incoming) at once, never the full sequence.
    """
    size = dist.get_world_size(group)
    lengths = all_gather_int(k.shape[2], group, k.device)
    longest = max(lengths)
    batch = k.shape[0]
    mask_given = key_mask is not None
    if key_mask is None:
        key_mask = torch.ones(batch, 1, 1, k.shape[2], dtype=torch.bool, device=k.device)
    if k.shape[2] < longest:  # pad so every travelling block has one shape; padding is masked out
        pad = longest - k.shape[2]
        k = torch.cat([k, k.new_zeros(k.shape[:2] + (pad, k.shape[3]))], dim=2)
        v = torch.cat([v, v.new_zeros(v.shape[:2] + (pad, v.shape[3]))], dim=2)
        key_mask = torch.cat([key_mask, key_mask.new_zeros(key_mask.shape[:3] + (pad,))], dim=3)
    block = [k.contiguous(), v.contiguous(), key_mask.expand(batch, 1, 1, longest).contiguous()]
    needs_mask = any(length < longest for length in lengths)
    out = lse = None
    rank = dist.get_rank(group)
    for step in range(size):
        works = []
        if step < size - 1:
            incoming, works = ring_pass_start(block, group, stats)
        source = (rank - step) % size
        if lengths[source] > 0:
            mask = block[2] if (needs_mask or mask_given) else None
            block_out, block_lse = kernel(q, block[0], block[1], mask, scale)
            out, lse = merge_lse(out, lse, block_out, block_lse)
        if works:
            ring_pass_wait(works)
            block = incoming
    if out is None:
        out = q.new_zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    return (out, lse) if return_lse else out.to(q.dtype)


def _pack(pieces: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """One flat buffer holding `pieces` back to back, each copied once (they are usually strided views)."""
    numels = [piece.numel() for piece in pieces]
    flat = torch.empty(sum(numels), dtype=pieces[0].dtype, device=pieces[0].device)
    for piece, chunk in zip(pieces, flat.split(numels)):
        chunk.view(piece.shape).copy_(piece)
    return flat, numels


def _heads_to_sequence(q, k, v, lengths: list[int], head_sizes: list[int], group, stats):
    """(batch, heads, local_seq, dim) x3 -> (3, batch, my_heads, full_seq, dim) by one all-to-all."""
    rank = dist.get_rank(group)
    starts = [sum(head_sizes[:j]) for j in range(len(head_sizes))]
    pieces = [t.narrow(1, starts[j], head_sizes[j]) for j in range(len(head_sizes)) for t in (q, k, v)]
    send, numels = _pack(pieces)
    per_rank = [sum(numels[3 * j : 3 * j + 3]) for j in range(len(head_sizes))]
    batch, dim = q.shape[0], q.shape[3]
    recv_shapes = [(3, batch, head_sizes[rank], lengths[i], dim) for i in range(len(lengths))]
    received = all_to_all_uneven(send, per_rank, recv_shapes, group, stats)
    return torch.cat(received, dim=3)


def _sequence_to_heads(out: torch.Tensor, lengths: list[int], head_sizes: list[int], group, stats):
    """(batch, my_heads, full_seq, dim) -> (batch, heads, local_seq, dim): the inverse exchange."""
    rank = dist.get_rank(group)
    send, numels = _pack(list(out.split(lengths, dim=2)))
    recv_shapes = [(out.shape[0], head_sizes[j], lengths[rank], out.shape[3]) for j in range(len(head_sizes))]
    received = all_to_all_uneven(send, numels, recv_shapes, group, stats)
    return torch.cat(received, dim=1)


def ulysses_attention(
    q, k, v, key_mask, scale, kernel: Kernel, group: dist.ProcessGroup, stats: CommStats | None = None,
    ring_group: dist.ProcessGroup | None = None,
):
    """All-to-all from sequence-split to head-split, attention on whole sequences, all-to-all back.

    Head counts that do not divide the group size are split unevenly (a rank may get no head at all). With
    `ring_group` the attention on the gathered block is itself a ring over that group: unified attention.
    """
    size = dist.get_world_size(group)
    if q.shape[2] != k.shape[2]:
        raise NotImplementedError("Ulysses attention needs queries and keys of one sequence (self-attention).")
    lengths = all_gather_int(q.shape[2], group, q.device)
    head_sizes = even_sizes(q.shape[1], size)
    qkv = _heads_to_sequence(q, k, v, lengths, head_sizes, group, stats)
    full_mask = None
    if key_mask is not None:
        full_mask = all_gather_uneven(key_mask.expand(q.shape[0], 1, 1, k.shape[2]), 3, lengths, group, stats)
    if qkv.shape[2] == 0:
        out = qkv[0].new_zeros(qkv[0].shape)
    elif ring_group is not None:
        out = ring_attention(qkv[0], qkv[1], qkv[2], full_mask, scale, kernel, ring_group, stats)
    else:
        out = local_attention(qkv[0], qkv[1], qkv[2], full_mask, scale, kernel)
    return _sequence_to_heads(out.to(q.dtype), lengths, head_sizes, group, stats)
