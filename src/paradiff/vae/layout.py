"""Which image rows each rank holds, and which rows a convolution needs from its neighbours.

Pure arithmetic on row ranges (no tensors, no collectives), so every rank derives the same exchange from the same
list of local heights. Rows are global indices along the height of the tensor a convolution reads, before padding.

A convolution along the height is described by its extent (dilated kernel size), stride and the rows of padding on
either side: the caller's own padding (`F.pad`, `nn.ZeroPad2d`, a causal pad) plus the convolution's zero padding.
Output row `o` reads padded rows `[o*stride, o*stride + extent)`, i.e. unpadded rows from `o*stride - pad_top`.
"""

from __future__ import annotations

from dataclasses import dataclass

Rows = tuple[int, int]  # [start, stop) global rows


def split_rows(height: int, parts: int, unit: int = 1) -> list[Rows]:
    """Contiguous ranges of whole `unit`s of rows, as even as possible (larger shares first); the rows past the last
    whole unit go to the last rank, so a strided encoder sees every rank start on a multiple of its downsampling."""
    units = height // unit
    base, extra = divmod(units, parts)
    sizes = [(base + (1 if index < extra else 0)) * unit for index in range(parts)]
    sizes[-1] += height - units * unit
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges


def ranges_from_heights(heights: list[int]) -> list[Rows]:
    ranges, start = [], 0
    for height in heights:
        ranges.append((start, start + height))
        start += height
    return ranges


@dataclass(frozen=True)
class ConvRows:
    """A convolution's geometry along the height."""

    extent: int
    stride: int
    pad_top: int
    pad_bottom: int

    def out_height(self, height: int) -> int:
        return (height + self.pad_top + self.pad_bottom - self.extent) // self.stride + 1

    def reads(self, first: int, stop: int) -> Rows:
        """Unpadded input rows (may reach past either edge, into the padding) read by outputs [first, stop)."""
        return first * self.stride - self.pad_top, (stop - 1) * self.stride - self.pad_top + self.extent

    def out_ranges(self, in_ranges: list[Rows], height: int) -> list[Rows]:
        """Output rows per rank: output `o` belongs to the rank holding input row `o*stride` (clamped into the
        image), so a stride-1 convolution keeps the split and a stride-s one divides it by s."""
        out_height = self.out_height(height)
        bounds = []
        for start, _stop in in_ranges[1:]:
            # first o with o*stride >= start
            bounds.append(min(out_height, max(0, -(-start // self.stride))))
        starts = [0] + bounds
        stops = bounds + [out_height]
        return list(zip(starts, stops))


@dataclass(frozen=True)
class RankConv:
    """One rank's share of a convolution: what its local convolution gets right and what it must recompute.

    The local convolution runs on the rank's rows as the model padded them, as if its edges were the image's edges.
    Rows `keep` of its output are exact; the rank's other output rows read padding made up at an inner edge (or fall
    outside the local output) and are recomputed from small windows in `fixes`, which include neighbours' rows.
    """

    out_rows: Rows
    local_out: int  # rows the local convolution produces (0: it is not run)
    local_first: int  # global output row of local output row 0
    keep: Rows  # global output rows taken from the local convolution
    fixes: tuple[Rows, ...]  # global output row ranges recomputed from windows


def plan_rank(conv: ConvRows, in_ranges: list[Rows], out_ranges: list[Rows], height: int, rank: int) -> RankConv:
    start, stop = in_ranges[rank]
    first, last = out_ranges[rank]
    local_height = stop - start + conv.pad_top + conv.pad_bottom
    if start % conv.stride or local_height < conv.extent or first >= last:
        return RankConv((first, last), 0, 0, (first, first), ((first, last),) if first < last else ())
    local_out = (local_height - conv.extent) // conv.stride + 1
    local_first = start // conv.stride
    trusted_low = -conv.pad_top if start == 0 else start
    trusted_high = height + conv.pad_bottom if stop == height else stop

    def exact(row: int) -> bool:
        low, high = conv.reads(row, row + 1)
        return local_first <= row < local_first + local_out and low >= trusted_low and high <= trusted_high

    good = [row for row in range(first, last) if exact(row)]
    if not good:
        return RankConv((first, last), 0, 0, (first, first), ((first, last),))
    keep = (good[0], good[-1] + 1)
    fixes = tuple(rows for rows in ((first, keep[0]), (keep[1], last)) if rows[0] < rows[1])
    return RankConv((first, last), local_out, local_first, keep, fixes)


@dataclass(frozen=True)
class HaloPlan:
    """Everything one rank needs for one convolution call: its own share, what it sends and receives."""

    conv: ConvRows
    height: int
    in_ranges: tuple[Rows, ...]
    out_ranges: tuple[Rows, ...]
    mine: RankConv
    sends: tuple[tuple[int, Rows], ...]  # (peer, global input rows) this rank sends
    receives: tuple[tuple[int, Rows], ...]  # (peer, global input rows) this rank receives


def plan_halo(conv: ConvRows, heights: list[int], rank: int) -> HaloPlan:
    in_ranges = ranges_from_heights(heights)
    height = in_ranges[-1][1]
    out_ranges = conv.out_ranges(in_ranges, height)
    shares = [plan_rank(conv, in_ranges, out_ranges, height, r) for r in range(len(heights))]

    def needed(reader: int, owner: int) -> Rows | None:
        """Rows of `owner` that `reader`'s fixes read, as one range (a neighbour sits on one side only)."""
        low, high = None, None
        for fix in shares[reader].fixes:
            read_low, read_high = conv.reads(*fix)
            rows = (max(read_low, in_ranges[owner][0], 0), min(read_high, in_ranges[owner][1], height))
            if rows[0] < rows[1]:
                low = rows[0] if low is None else min(low, rows[0])
                high = rows[1] if high is None else max(high, rows[1])
        return None if low is None else (low, high)

    sends, receives = [], []
    for peer in range(len(heights)):
        if peer == rank:
            continue
        outgoing = needed(peer, rank)
        if outgoing is not None:
            sends.append((peer, outgoing))
        incoming = needed(rank, peer)
        if incoming is not None:
            receives.append((peer, incoming))
    return HaloPlan(conv, height, tuple(in_ranges), tuple(out_ranges), shares[rank], tuple(sends), tuple(receives))
