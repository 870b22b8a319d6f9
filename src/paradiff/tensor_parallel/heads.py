"""Which whole heads each TP rank holds, for any head count.

With H query heads over T ranks each rank holds floor(H/T) or ceil(H/T) contiguous heads (the first H mod T ranks
one more). Grouped-query attention keeps its groups whole: with at least as many K/V heads as ranks the K/V heads
are split that way and each rank holds the query heads of its K/V heads; with fewer, ranks are assigned to K/V
heads in contiguous runs (rank r to head r * KV // T), every rank of a run holds that K/V head and the run splits
the head's query group the same floor/ceil way. Every width an attention module derives from its heads (inner
width, K/V width, per-head parameters) is split by the same counts, so a colwise projection, its rowwise partner,
a norm over the heads and the module's head counters always agree. Widths that are not head-structured (feed-
forward hidden sizes) split floor/ceil by single features.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paradiff.errors import PlanError


def uneven_piece(total: int, rank: int, size: int) -> tuple[int, int]:
    """(start, length) of `rank`'s contiguous share when `total` items are split as evenly as possible."""
    base, extra = divmod(total, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def split_heads(query: int, kv: int, size: int, where: str = "") -> tuple[tuple[tuple[int, int], ...],
                                                                         tuple[tuple[int, int], ...]]:
    """Per rank, (first, count) of its query heads and of its K/V heads."""
    label = f"{where}: " if where else ""
    if query < size:
        raise PlanError(
            f"{label}tp_degree={size} is larger than the {query} attention heads: every rank must hold at least one "
            f"whole head; valid tp degrees: 1 to {query}.")
    if kv <= 0 or query % kv:
        raise PlanError(f"{label}{query} query heads do not form groups over {kv} key/value heads.")
    if kv == query:
        pieces = tuple(uneven_piece(query, rank, size) for rank in range(size))
        return pieces, pieces
    group = query // kv
    if kv >= size:
        kv_pieces = tuple(uneven_piece(kv, rank, size) for rank in range(size))
        return tuple((start * group, count * group) for start, count in kv_pieces), kv_pieces
    owner = [rank * kv // size for rank in range(size)]
    query_pieces, kv_pieces = [], []
    for rank in range(size):
        sharing = [other for other in range(size) if owner[other] == owner[rank]]
        start, count = uneven_piece(group, sharing.index(rank), len(sharing))
        query_pieces.append((owner[rank] * group + start, count))
        kv_pieces.append((owner[rank], 1))
    return tuple(query_pieces), tuple(kv_pieces)


@dataclass(frozen=True)
class HeadSplit:
    """The heads of one attention module (or of a model, for per-head tensors outside its attention modules) over
    the TP ranks, and the widths that are counted in those heads."""

    query: tuple[tuple[int, int], ...]  # per rank: (first query head, count)
    kv: tuple[tuple[int, int], ...]  # per rank: (first K/V head, count)
    query_widths: frozenset[int] = field(default_factory=frozenset)  # H, H * head_dim, ...
    kv_widths: frozenset[int] = field(default_factory=frozenset)  # KV, KV * head_dim, ...

    @classmethod
    def of(cls, query: int, kv: int | None, size: int, head_dim: int | None = None,
           query_widths: tuple[int, ...] = (), kv_widths: tuple[int, ...] = (), where: str = "",
           counts_kv: bool = True) -> "HeadSplit":
        """`counts_kv=False`: only query-head widths are split by heads (a model's heads, for per-head tensors
        outside its attention modules, where a K/V-sized width is a coincidence, not K/V heads)."""
        kv = kv or query
        query_pieces, kv_pieces = split_heads(query, kv, size, where)
        q_widths = {query, *(w for w in query_widths if w and w % query == 0)}
        k_widths = {kv, *(w for w in kv_widths if w and w % kv == 0)} if counts_kv else set()
        if head_dim:
            q_widths.add(query * head_dim)
            if counts_kv:
                k_widths.add(kv * head_dim)
        return cls(query_pieces, kv_pieces, frozenset(q_widths), frozenset(k_widths))

    @property
    def query_heads(self) -> int:
        return sum(count for _, count in self.query)

    @property
    def kv_heads(self) -> int:
        last_start, last_count = self.kv[-1]
        return last_start + last_count

    def piece(self, width: int, rank: int) -> tuple[int, int] | None:
        """(start, length) of `rank`'s part of a head-structured width, or None when `width` is not counted in
        heads (then it splits by single features)."""
        grouped = self.kv_heads != self.query_heads
        if grouped and width in self.kv_widths:
            start, count = self.kv[rank]
            unit = width // self.kv_heads
        elif width in self.query_widths or width in self.kv_widths:
            start, count = self.query[rank]
            unit = width // self.query_heads
        else:
            return None
        return start * unit, count * unit


def width_piece(width: int, rank: int, size: int, heads: HeadSplit | None) -> tuple[int, int]:
    """`rank`'s (start, length) of a split width: by whole heads where `heads` counts it, else by features."""
    piece = None if heads is None else heads.piece(width, rank)
    return piece if piece is not None else uneven_piece(width, rank, size)
