"""Every collective paradiff issues, each a named function taking an explicit process group.

Keeping them here makes the communication of a step countable (see `CommStats`) and easy to audit.
"""

from __future__ import annotations

import json
import math

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._C._distributed_c10d import _resolve_process_group


@dataclass
class CommStats:
    """Counts collectives and bytes; attach one to a model to measure a step (benchmarks only)."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def record(self, name: str, tensor: torch.Tensor) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.bytes[name] = self.bytes.get(name, 0) + tensor.numel() * tensor.element_size()


def _record(stats: CommStats | None, name: str, tensor: torch.Tensor) -> None:
    if stats is not None:
        stats.record(name, tensor)


def all_reduce_tp(tensor: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None = None) -> torch.Tensor:
    """Sum the partial outputs of a rowwise projection (or a partial statistic) over the TP group, in place.

    Under torch.compile the sum goes through a functional collective, which Dynamo records as a graph op (an in-place
    c10d call is opaque to it); copying the result back keeps the in-place contract callers rely on.
    """
    _record(stats, "all_reduce_tp", tensor)
    if torch.compiler.is_compiling():
        return tensor.copy_(funcol.all_reduce(tensor, "sum", group))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_heads_tp(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup,
                        stats: CommStats | None = None, sizes: list[int] | None = None) -> torch.Tensor:
    """Concatenate the TP ranks' blocks of heads along `dim` (an attention output a model uses unprojected);
    `sizes`: every rank's width along `dim`, where ranks hold different numbers of heads."""
    if sizes is not None and len(set(sizes)) > 1:
        return all_gather_uneven(tensor, dim, sizes, group, stats, name="all_gather_heads_tp")
    _record(stats, "all_gather_heads_tp", tensor)
    if torch.compiler.is_compiling():  # traced as a graph op (see all_reduce_tp)
        return funcol.all_gather_tensor(tensor.contiguous(), gather_dim=dim, group=group)
    pieces = [torch.empty_like(tensor.contiguous()) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def all_reduce_cp_sums(tensor: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None = None) -> torch.Tensor:
    """Sum per-rank partial sums over the context-parallel group (linear attention's K^T V and key sums)."""
    tensor = tensor.contiguous()
    _record(stats, "all_reduce_cp_sums", tensor)
    if torch.compiler.is_compiling():  # traced as a graph op (see all_reduce_tp)
        return funcol.all_reduce(tensor, "sum", group)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_token_sums(tensor: torch.Tensor, group: dist.ProcessGroup,
                          stats: CommStats | None = None) -> torch.Tensor:
    """Sum per-rank partial sums over the tokens of a VAE split by rows (linear attention's V K^T), in place."""
    tensor = tensor.contiguous()
    _record(stats, "all_reduce_token_sums", tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_metric(values: torch.Tensor, group: dist.ProcessGroup | None,
                      stats: CommStats | None = None) -> list[float]:
    """Sum a few float64 scalars over `group` (one small all-reduce) and return them as Python floats.

    Used where ranks take a decision from data (e.g. a step cache's skip test): an all-reduce leaves identical bytes
    on every member, so every member decides the same. `group=None` is a one-rank group: values come back unchanged.
    """
    values = values.to(torch.float64).contiguous()
    if group is not None and dist.get_world_size(group) > 1:
        _record(stats, "all_reduce_metric", values)
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return [float(v) for v in values.cpu().tolist()]


def all_reduce_row_extrema(extrema: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The elementwise maximum over the TP group, in place: at load, the negated minima and the maxima of the rows of
    every column-split weight, in one small float32 tensor, so that each rank quantizes its columns with the scale of
    the whole row (per-output-channel int8 / fp8 scales depend on nothing else)."""
    dist.all_reduce(extrema, op=dist.ReduceOp.MAX, group=group)
    return extrema


def group_name(group: dist.ProcessGroup | None) -> str:
    """The registered name of a process group ("" for none): how a group crosses a torch.library custom op."""
    return "" if group is None else group.group_name


def group_from_name(name: str) -> dist.ProcessGroup | None:
    return _resolve_process_group(name) if name else None


def all_gather_int(value: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """Every rank's integer (sequence lengths before an uneven exchange)."""
    size = dist.get_world_size(group)
    local = torch.tensor([value], dtype=torch.int64, device=device)
    out = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(out, local, group=group)
    return [int(v) for v in torch.cat(out).tolist()]


def all_true(flag: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether `flag` holds on every rank of the group: a check on local data that all ranks must act on alike."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())


def all_gather_uneven(
    tensor: torch.Tensor, dim: int, sizes: list[int], group: dist.ProcessGroup, stats: CommStats | None = None,
    name: str = "all_gather_seq",
) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim` when ranks hold different lengths (`sizes`, in rank order).

    gloo only gathers equal shapes, so each piece is padded to the longest and trimmed after.
    """
    dim = dim % tensor.dim()
    tensor = _padded_to(tensor, dim, max(sizes))
    pieces = [torch.empty_like(tensor) for _ in sizes]
    _record(stats, name, tensor)
    dist.all_gather(pieces, tensor, group=group)
    return torch.cat([piece.narrow(dim, 0, size) for piece, size in zip(pieces, sizes)], dim=dim)


def all_to_all_uneven(
    send: torch.Tensor,
    send_numels: list[int],
    recv_shapes: list[tuple[int, ...]],
    group: dist.ProcessGroup,
    stats: CommStats | None = None,
) -> list[torch.Tensor]:
    """Send the consecutive pieces of the flat `send` buffer (`send_numels[j]` elements to rank j) and receive one
    tensor of `recv_shapes[i]` from each rank i.

    Built on all_to_all_single with split sizes, which both gloo and NCCL implement for uneven splits (the Ulysses
    exchange with head counts or lengths that do not divide evenly). Callers fill `send` in place, so each element
    is copied once on the way out.
    """
    out_splits = [_numel(shape) for shape in recv_shapes]
    recv = torch.empty(sum(out_splits), dtype=send.dtype, device=send.device)
    _record(stats, "all_to_all_ulysses", send)
    dist.all_to_all_single(recv, send, out_splits, send_numels, group=group)
    return [piece.view(shape) for piece, shape in zip(recv.split(out_splits), recv_shapes)]


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def ring_pass_start(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, stats: CommStats | None = None,
    into: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[dist.Work]]:
    """Send `tensors` to the next rank of the ring and start receiving the previous rank's, without waiting: one
    message per tensor (ring attention packs a block into one). The previous rank's arrive in `into` (tensors of the
    same shapes, e.g. the buffers a pass before this one sent from) or in new ones.

    The caller computes on the current block while this runs, or waits first where nothing runs beside it; then
    calls `ring_pass_wait`.
    """
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    next_rank = dist.get_global_rank(group, (rank + 1) % size)
    prev_rank = dist.get_global_rank(group, (rank - 1) % size)
    received = [torch.empty_like(t) for t in tensors] if into is None else into
    ops = []
    for send, recv in zip(tensors, received):
        _record(stats, "ring_pass", send)
        ops.append(dist.P2POp(dist.isend, send.contiguous(), next_rank, group))
        ops.append(dist.P2POp(dist.irecv, recv, prev_rank, group))
    return received, dist.batch_isend_irecv(ops)


def ring_pass_wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


class _Works(dist.Work):
    """One handle on several works: waiting on it waits on each."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: object = None) -> bool:
        for work in self._works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def all_gather_in_place(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                        async_op: bool = False) -> dist.Work | None:
    """Fill `output` (1-D, one equal slot per rank of `group`, in rank order) with every rank's `input`, by
    point-to-point sends from this rank's slot and receives straight into the others' (FSDP2's all-gather over gloo,
    `fsdp/apply.py`). `all_gather_into_tensor` over gloo gathers into a whole-output buffer of its own and copies it
    back: one more output's worth of memory while each gather is in flight, and a copy of it. Returns a work to wait
    on when `async_op`, else None once done."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    slot = output.numel() // size
    mine = output.narrow(0, rank * slot, slot)
    if input.data_ptr() != mine.data_ptr():
        mine.copy_(input)
    ops = []
    for peer in range(size):
        if peer != rank:
            global_peer = dist.get_global_rank(group, peer)
            ops.append(dist.P2POp(dist.isend, mine, global_peer, group))
            ops.append(dist.P2POp(dist.irecv, output.narrow(0, peer * slot, slot), global_peer, group))
    work = _Works(dist.batch_isend_irecv(ops) if ops else [])
    if async_op:
        return work
    work.wait()
    return None


def all_gather_object(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    size = dist.get_world_size(group)
    out: list[object] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def all_gather_pieces(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int = 0,
                      sizes: list[int] | None = None) -> list[torch.Tensor]:
    """Every rank's `tensor`, in rank order; `sizes`: every rank's length along `dim` where they differ (shards of
    uneven head splits), padded for the gather and trimmed after."""
    if sizes is None or len(set(sizes)) == 1:
        pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, tensor.contiguous(), group=group)
        return pieces
    padded = _padded_to(tensor, dim, max(sizes))
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded, group=group)
    return [piece.narrow(dim, 0, size) for piece, size in zip(pieces, sizes)]


def all_gather_any_shape(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's `tensor` in rank order, whatever its shape (the same dtype and number of dimensions): the shapes
    are gathered first, then the data, flattened and padded to the largest where they differ (two CFG branches
    whose outputs carry prompts of different lengths)."""
    world = dist.get_world_size(group)
    shape = torch.tensor(tensor.shape, dtype=torch.int64, device=tensor.device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    sizes = [tuple(int(n) for n in item.tolist()) for item in shapes]
    if len(set(sizes)) == 1:
        pieces = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(pieces, tensor.contiguous(), group=group)
        return pieces
    counts = [math.prod(size) for size in sizes]
    flat = tensor.contiguous().reshape(-1)
    padded = torch.cat([flat, flat.new_zeros(max(counts) - flat.numel())])
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded, group=group)
    return [piece[:count].reshape(size) for piece, count, size in zip(pieces, counts, sizes)]


def all_gather_cfg_batch(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole batch of a batch-CFG transformer call: every cfg rank's share (equal sizes), concatenated along the
    batch in rank order."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces, dim=0)


def broadcast_cfg_branch(tensor: torch.Tensor, owner: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The prediction of one guidance branch, from the cfg rank `owner` (its rank in `group`) that computed it, to
    every cfg rank; the others pass a tensor of the same shape and dtype. Returns the (contiguous) received tensor."""
    tensor = tensor.contiguous()
    dist.broadcast(tensor, src=dist.get_global_rank(group, owner), group=group)
    return tensor


def barrier(group: dist.ProcessGroup | None = None) -> None:
    dist.barrier(group=group)


def all_gather_ints(values: list[int], group: dist.ProcessGroup, device: torch.device,
                    stats: CommStats | None = None, name: str = "all_gather_ints") -> list[list[int]]:
    """Every rank's list of integers (the same length on every rank): shapes to agree on, local heights."""
    local = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    _record(stats, name, local)
    dist.all_gather(out, local, group=group)
    return [[int(v) for v in piece.tolist()] for piece in out]


def all_gather_norm_stats(moments: torch.Tensor, group: dist.ProcessGroup,
                          stats: CommStats | None = None) -> torch.Tensor:
    """(ranks, *moments.shape): every rank's per-group (count, mean, M2) of a group norm split by rows."""
    out = [torch.empty_like(moments) for _ in range(dist.get_world_size(group))]
    _record(stats, "all_gather_norm_stats", moments)
    dist.all_gather(out, moments.contiguous(), group=group)
    return torch.stack(out)


def halo_exchange_start(
    sends: list[tuple[int, torch.Tensor]],
    receives: list[tuple[int, tuple[int, ...]]],
    group: dist.ProcessGroup,
    dtype: torch.dtype,
    device: torch.device,
    stats: CommStats | None = None,
) -> tuple[list[torch.Tensor], list[dist.Work]]:
    """Send each (peer, rows) block to that peer (group ranks) and start receiving each (peer, shape) block, without
    waiting: the caller convolves its own rows meanwhile, then calls `halo_exchange_wait`.

    Point to point, so a rank talks only to the neighbours whose rows its convolution windows read.
    """
    ops, received = [], []
    for peer, block in sends:
        _record(stats, "halo_exchange", block)
        ops.append(dist.P2POp(dist.isend, block.contiguous(), dist.get_global_rank(group, peer), group))
    for peer, shape in receives:
        buffer = torch.empty(shape, dtype=dtype, device=device)
        received.append(buffer)
        ops.append(dist.P2POp(dist.irecv, buffer, dist.get_global_rank(group, peer), group))
    return received, (dist.batch_isend_irecv(ops) if ops else [])


def halo_exchange_wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def gather_uneven_to(
    tensor: torch.Tensor, dim: int, sizes: list[int], dst: int, group: dist.ProcessGroup,
    stats: CommStats | None = None,
) -> torch.Tensor | None:
    """Like `all_gather_uneven`, but only group rank `dst` receives (and returns) the concatenation; others get None."""
    dim = dim % tensor.dim()
    tensor = _padded_to(tensor, dim, max(sizes))
    me = dist.get_rank(group)
    pieces = [torch.empty_like(tensor) for _ in sizes] if me == dst else None
    _record(stats, "gather_rows", tensor)
    dist.gather(tensor, pieces, dst=dist.get_global_rank(group, dst), group=group)
    if pieces is None:
        return None
    return torch.cat([piece.narrow(dim, 0, size) for piece, size in zip(pieces, sizes)], dim=dim)


def _padded_to(tensor: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """`tensor` zero-padded along `dim` to `length`, contiguous: gloo gathers equal shapes only."""
    if tensor.shape[dim] < length:
        pad_shape = list(tensor.shape)
        pad_shape[dim] = length - tensor.shape[dim]
        tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)
    return tensor.contiguous()


def broadcast_json(value: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    """`value` (JSON data) of global rank `src` on every rank of `group`, as its UTF-8 JSON text in a uint8 tensor
    (length first): what crosses is data, never pickle. The other ranks pass anything (ignored). CPU tensors: `group`
    is a gloo group."""
    data = json.dumps(value).encode() if dist.get_rank() == src else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(length, src=src, group=group)
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
              else torch.empty(int(length.item()), dtype=torch.uint8))
    dist.broadcast(buffer, src=src, group=group)
    return json.loads(buffer.numpy().tobytes())


def all_gather_json(value: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's `value` (JSON data) in rank order, as UTF-8 JSON text (no pickle); `group` is a gloo group."""
    data = json.dumps(value).encode()
    size = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [torch.empty_like(length) for _ in range(size)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(item.item()) for item in lengths)
    buffer = torch.zeros(longest, dtype=torch.uint8)
    buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    pieces = [torch.empty_like(buffer) for _ in range(size)]
    dist.all_gather(pieces, buffer, group=group)
    return [json.loads(piece[:int(n.item())].numpy().tobytes()) for piece, n in zip(pieces, lengths)]


def broadcast_flag(flag: bool, src: int, group: dist.ProcessGroup | None) -> bool:
    """Global rank `src`'s `flag` on every rank of `group` (a gloo group): a decision one rank takes for all, such as
    stopping a cancelled request at this denoising step."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.broadcast(value, src=src, group=group)
    return bool(value.item())


def broadcast_object(obj: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    """`obj` of rank `src` (global rank) on every rank of `group`; the other ranks pass anything (ignored)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def abort_process_groups() -> None:
    """End this rank's part of every process group at once, so peers blocked in a collective with it fail now instead
    of at their timeout (a server recovering from a fault; `destroy_process_group` keeps the connections open while
    any group object is referenced). The default group can be initialised again afterwards."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        try:
            abort(None)
            return
        except Exception:  # noqa: BLE001 - an abort that fails leaves the destroy below
            pass
    dist.destroy_process_group()
