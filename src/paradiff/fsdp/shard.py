"""Which rows of a weight an FSDP rank holds, and how to read only those from the checkpoint.

FSDP2 (`torch.distributed.fsdp.fully_shard`) shards every parameter along its first dimension the way `torch.chunk`
does: chunks of ceil(rows / size) rows, the last ones shorter or empty. A parameter already split by tensor
parallelism is FSDP-sharded within its TP slice, so the rows to read compose the two.
"""

from __future__ import annotations

from paradiff.tensor_parallel.styles import ShardSpec


def chunk_rows(rows: int, rank: int, size: int) -> tuple[int, int]:
    """(start, length) of the rows `rank` of `size` holds of a dimension of `rows`, as FSDP2 chunks it."""
    step = -(-rows // size) if rows else 0
    start = min(rows, rank * step)
    return start, max(0, min(step, rows - start))


def read_plan(tp_spec: ShardSpec | None, start: int, length: int) -> tuple[ShardSpec | None, tuple[int, int] | None]:
    """The (spec, rows) arguments of `Checkpoint.read` that read rows [start, start + length) of the tensor this
    rank's TP spec gives (the whole tensor when `tp_spec` is None): the rows of a spec along dim 0 become the part of
    its pieces they cover; a spec along another dimension keeps its columns and reads those rows of the file."""
    if tp_spec is None or tp_spec.dim != 0:
        return tp_spec, (start, length)
    pieces, position = [], 0
    for piece_start, piece_length in tp_spec.pieces:
        low, high = max(start, position), min(start + length, position + piece_length)
        if low < high:
            pieces.append((piece_start + low - position, high - low))
        position += piece_length
    return ShardSpec(dim=0, pieces=tuple(pieces)), None
