"""Ring, Ulysses and unified attention over a sequence split unevenly across ranks.

Every function takes this rank's (batch, heads, local_seq, head_dim) query/key/value and returns this rank's output
rows, equal to attention over the full sequence. Masks (bool, True = attend, or an additive float bias) come in two
kinds:
- a key mask (batch, 1 or heads, 1, local_keys), split with the tokens: it travels with its keys;
- a sequence mask (batch, 1 or heads, full_seq, full_seq), query-dependent (causal parts, per-segment blocks), held
  whole by every rank for a sequence split in order (rank r holds the r-th chunk): ring attention takes its local
  rows and, per travelling block, that block's columns; Ulysses, which attends whole sequences, takes all of it.
Uneven lengths are handled by exchanging lengths first: Ulysses uses all-to-all with explicit split sizes, ring pads
each travelling block to the longest and masks the padding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paradiff.distributed.comm import (CommStats, all_gather_int, all_gather_ints, all_gather_uneven, all_to_all_uneven, ring_pass_start, ring_pass_wait)
from paradiff.context_parallel.kernels import Kernel, merge_lse


def even_sizes(total: int, parts: int) -> list[int]:
    """Split `total` into `parts` sizes differing by at most one, larger ones first (works for total < parts)."""
    base, extra = divmod(total, parts)
    return [base + (1 if index < extra else 0) for index in range(parts)]


def local_chunk(tensor: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    sizes = even_sizes(tensor.shape[dim], parts)
    return tensor.narrow(dim, sum(sizes[:index]), sizes[index])


def local_attention(q, k, v, mask, scale, kernel: Kernel) -> torch.Tensor:
    out, _ = kernel(q, k, v, mask, scale)
    return out.to(q.dtype)


def _pad_keys(mask: torch.Tensor, keys: int) -> torch.Tensor:
    """Extend a mask's key dim to `keys` with masked-out columns (False, or -inf for a bias)."""
    pad = keys - mask.shape[-1]
    if pad <= 0:
        return mask
    fill = mask.new_zeros(mask.shape[:-1] + (pad,)) if mask.dtype == torch.bool else \
        mask.new_full(mask.shape[:-1] + (pad,), float("-inf"))
    return torch.cat([mask, fill], dim=-1)


def _check_sequence_mask(mask: torch.Tensor, total: int) -> None:
    if mask.shape[-2] != total or mask.shape[-1] != total:
        raise ValueError(
            f"A query-dependent attention mask must cover the whole sequence of {total} tokens under context "
            f"parallelism (queries x keys = {total} x {total}); got {tuple(mask.shape)}. Leave the mask unsplit in "
            "the context-parallel plan, or use a key-padding mask (batch, 1, 1, keys) split with the tokens."
        )


def _starts(lengths: list[int]) -> list[int]:
    return [sum(lengths[:index]) for index in range(len(lengths))]


def _layout(tensors: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """Byte offsets of `tensors` packed back to back in one buffer, each aligned to 16 bytes (any dtype's view)."""
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append((total, tensor))
        total += -(-tensor.numel() * tensor.element_size() // 16) * 16
    return offsets


def _pack_block(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple]]:
    """One byte buffer holding a travelling block's tensors (keys, values and a key mask of any dtypes), each copied
    once, so that a ring pass is one message; and the layout `_unpack_block` reads it back by."""
    layout = _layout(tensors)
    last_offset, last = layout[-1]
    buffer = torch.empty(last_offset + last.numel() * last.element_size(), dtype=torch.uint8, device=last.device)
    specs = [(offset, tensor.numel() * tensor.element_size(), tensor.dtype, tensor.shape) for offset, tensor in layout]
    for view, (_, tensor) in zip(_unpack_block(buffer, specs), layout):
        view.copy_(tensor)
    return buffer, specs


def _unpack_block(buffer: torch.Tensor, specs: list[tuple]) -> list[torch.Tensor]:
    """The tensors of a packed block, as views into `buffer` (no copy)."""
    return [buffer.narrow(0, offset, nbytes).view(dtype).view(shape) for offset, nbytes, dtype, shape in specs]


def overlaps_compute(device: torch.device) -> bool:
    """Whether a ring pass runs beside the attention on the block in hand (started before it, waited on after).

    Not on CPU: there the ranks' compute fills the cores (a torch thread per core), and gloo carries a pass on
    transport threads of its own, which then get a core only by preempting a rank's compute, for each of the pass's
    handshakes and socket-buffer-sized writes and reads. The pass is waited on at once instead, which leaves the core
    to those threads. (Under the overlap, the ring2 steps of benchmarks/bench_cost_model.py on 2026-12-06 waited
    about 3x what the calibrated links give the pass and the length agreement.) On CUDA the transfer runs on the device's copy engines and NCCL's
    kernels, beside the attention kernels.
    """
    return device.type != "cpu"


def ring_attention(
    q, k, v, key_mask, scale, kernel: Kernel, group: dist.ProcessGroup, stats: CommStats | None = None,
    return_lse: bool = False, sequence_mask: torch.Tensor | None = None,
):
    """K/V blocks travel around the ring, one message per pass (keys, values and a key mask packed in one buffer);
    where the device lets a pass run beside the compute (`overlaps_compute`), the next block's transfer overlaps the
    attention on the current one.

    No rank holds more than two K/V blocks (current and incoming) at once, never the full sequence: two buffers,
    allocated once, take turns (the one just sent receives the next block). A key mask travels with its block; a
    sequence mask stays put and gives each block its own columns. Partial results merge by log-sum-exp in place.
    """
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    lengths = all_gather_int(k.shape[2], group, k.device)
    longest = max(lengths)
    batch = k.shape[0]
    if sequence_mask is not None:
        if q.shape[2] != k.shape[2]:
            raise NotImplementedError("A query-dependent mask under ring attention needs queries and keys of one "
                                      f"sequence (self-attention); got {q.shape[2]} queries and {k.shape[2]} keys.")
        _check_sequence_mask(sequence_mask, sum(lengths))
        starts = _starts(lengths)
        rows = sequence_mask.narrow(-2, starts[rank], q.shape[2])
    elif key_mask is None and any(length < longest for length in lengths):
        # some blocks are padded, and padding must be masked out: every block travels with a key mask
        key_mask = torch.ones(batch, 1, 1, k.shape[2], dtype=torch.bool, device=k.device)
    if k.shape[2] < longest:  # pad so every travelling block has one shape; padding is masked out
        pad = longest - k.shape[2]
        k = torch.cat([k, k.new_zeros(k.shape[:2] + (pad, k.shape[3]))], dim=2)
        v = torch.cat([v, v.new_zeros(v.shape[:2] + (pad, v.shape[3]))], dim=2)
    parts = [k, v]
    if key_mask is not None and sequence_mask is None:
        parts.append(_pad_keys(key_mask, longest).expand(batch, -1, -1, longest))
    if len(parts) == 2 and k.shape == v.shape and k.dtype == v.dtype:  # stacked, one op (a mask, or values of
        # another width than the keys, take the byte buffer)
        current, specs = torch.stack(parts), None
    else:
        current, specs = _pack_block(parts)
    incoming = torch.empty_like(current) if size > 1 else None
    overlap = overlaps_compute(q.device)
    out = lse = None
    for step in range(size):
        passing = step < size - 1
        if passing:
            _, works = ring_pass_start([current], group, stats, into=[incoming])
            if not overlap:
                ring_pass_wait(works)
        block = current.unbind(0) if specs is None else _unpack_block(current, specs)
        source = (rank - step) % size
        if lengths[source] > 0:
            if sequence_mask is not None:
                mask = _pad_keys(rows.narrow(-1, starts[source], lengths[source]), longest)
            else:
                mask = block[2] if len(block) > 2 else None
            block_out, block_lse = kernel(q, block[0], block[1], mask, scale)
            out, lse = merge_lse(out, lse, block_out, block_lse)
        if passing:
            if overlap:
                ring_pass_wait(works)
            current, incoming = incoming, current
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


def _heads_to_sequence(tensors: list[torch.Tensor], lengths: list[int], head_sizes: list[int], group, stats):
    """(batch, heads, local_seq, dim) each -> (len(tensors), batch, my_heads, full_seq, dim) by one all-to-all."""
    rank = dist.get_rank(group)
    count = len(tensors)
    starts = [sum(head_sizes[:j]) for j in range(len(head_sizes))]
    pieces = [t.narrow(1, starts[j], head_sizes[j]) for j in range(len(head_sizes)) for t in tensors]
    send, numels = _pack(pieces)
    per_rank = [sum(numels[count * j : count * (j + 1)]) for j in range(len(head_sizes))]
    batch, dim = tensors[0].shape[0], tensors[0].shape[3]
    recv_shapes = [(count, batch, head_sizes[rank], lengths[i], dim) for i in range(len(lengths))]
    received = all_to_all_uneven(send, per_rank, recv_shapes, group, stats)
    return torch.cat(received, dim=3)


def _sequence_to_heads(out: torch.Tensor, lengths: list[int], head_sizes: list[int], group, stats):
    """(batch, my_heads, full_seq, dim) -> (batch, heads, local_seq, dim): the inverse exchange."""
    rank = dist.get_rank(group)
    send, numels = _pack(list(out.split(lengths, dim=2)))
    recv_shapes = [(out.shape[0], head_sizes[j], lengths[rank], out.shape[3]) for j in range(len(head_sizes))]
    received = all_to_all_uneven(send, numels, recv_shapes, group, stats)
    return torch.cat(received, dim=1)


def _my_heads(mask: torch.Tensor | None, head_sizes: list[int], rank: int) -> torch.Tensor | None:
    """The mask's rows for the heads this rank attends after the exchange (a per-head mask only)."""
    if mask is None or mask.shape[1] == 1:
        return mask
    return mask.narrow(1, sum(head_sizes[:rank]), head_sizes[rank])


def ulysses_attention(
    q, k, v, key_mask, scale, kernel: Kernel, group: dist.ProcessGroup, stats: CommStats | None = None,
    ring_group: dist.ProcessGroup | None = None, sequence_mask: torch.Tensor | None = None,
    extra_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """All-to-all from sequence-split to head-split, attention on whole sequences, all-to-all back.

    Head counts that do not divide the group size are split unevenly (a rank may get no head at all). With
    `ring_group` the attention on the gathered block is itself a ring over that group: unified attention.
    `extra_kv`: keys and values every rank holds whole (all heads), attended besides the split ones and merged
    by log-sum-exp (Cosmos3's replicated text prefix).
    """
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    local_lengths = all_gather_ints([q.shape[2], k.shape[2]], group, q.device)
    lengths, key_lengths = [pair[0] for pair in local_lengths], [pair[1] for pair in local_lengths]
    head_sizes = even_sizes(q.shape[1], size)
    if key_lengths == lengths:  # one sequence (or two split alike): one exchange
        qkv = _heads_to_sequence([q, k, v], lengths, head_sizes, group, stats)
    else:  # cross-attention between two split sequences (LTX-2's audio <-> video): queries and keys apart
        if sequence_mask is not None:
            raise NotImplementedError("A query-dependent mask under Ulysses attention needs queries and keys of one "
                                      "sequence (self-attention); use a key mask for cross-attention.")
        query = _heads_to_sequence([q], lengths, head_sizes, group, stats)
        qkv = [query[0], *_heads_to_sequence([k, v], key_lengths, head_sizes, group, stats)]
    full_mask = None
    if key_mask is not None:
        gathered = all_gather_uneven(key_mask.expand(q.shape[0], -1, 1, k.shape[2]), 3, key_lengths, group, stats)
        full_mask = _my_heads(gathered, head_sizes, rank)
    sequence_mask = _my_heads(sequence_mask, head_sizes, rank)
    if sequence_mask is not None and ring_group is None:
        _check_sequence_mask(sequence_mask, sum(lengths))
        full_mask = sequence_mask
    if qkv[0].shape[1] == 0:  # this rank attends no head
        out = qkv[0].new_zeros(qkv[0].shape)
    elif extra_kv is not None:
        if full_mask is not None:
            raise NotImplementedError("Attention with replicated extra keys takes no mask.")
        if ring_group is not None:
            out, lse = ring_attention(qkv[0], qkv[1], qkv[2], None, scale, kernel, ring_group, stats, return_lse=True)
        else:
            out, lse = kernel(qkv[0], qkv[1], qkv[2], None, scale)
        start = sum(head_sizes[:rank])
        extra_k, extra_v = (t.narrow(1, start, head_sizes[rank]) for t in extra_kv)
        out, _ = merge_lse(out, lse, *kernel(qkv[0], extra_k, extra_v, None, scale))
    elif ring_group is not None:
        out = ring_attention(qkv[0], qkv[1], qkv[2], full_mask, scale, kernel, ring_group, stats,
                             sequence_mask=sequence_mask)
    else:
        out = local_attention(qkv[0], qkv[1], qkv[2], full_mask, scale, kernel)
    return _sequence_to_heads(out.to(q.dtype), lengths, head_sizes, group, stats)
