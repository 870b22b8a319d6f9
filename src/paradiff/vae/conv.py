"""Convolutions over rows split across ranks, exact: the local convolution plus a few recomputed edge rows.

Each rank first convolves its own rows exactly as the model padded them, as if its edges were the image's. Only the
output rows whose window crosses an inner edge are wrong; they are recomputed from small windows holding the
neighbours' rows (the halo, exchanged point to point while the local convolution runs) and written over the wrong
ones in place. No rank copies its whole input, so the memory of a split convolution is the local one's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paradiff.distributed.comm import halo_exchange_start, halo_exchange_wait
from paradiff.vae.layout import ConvRows, HaloPlan, Rows
from paradiff.vae.runtime import VaeRuntime

_FUNCTIONAL = {nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}  # rows are dim -2 of (B, C, [T,] H, W)


def needs_halo(conv: nn.Module, prepad: tuple[int, int]) -> bool:
    """A convolution that reads only its own row (1 row, stride 1, no padding) needs no neighbour."""
    return conv.kernel_size[-2] != 1 or conv.stride[-2] != 1 or conv.padding[-2] != 0 or any(prepad)


class HaloConv:
    """Stands in for one convolution's `_conv_forward` (which receives the input after the model's own padding, and
    pads it itself when the convolution's padding_mode is not "zeros")."""

    def __init__(self, runtime: VaeRuntime, name: str, conv: nn.Module, prepad: tuple[int, int], prepad_mode: str):
        self.runtime = runtime
        self.name = name
        self.conv = conv
        self.original = conv._conv_forward
        self.prepad = prepad  # rows the model padded before the call: part of the input
        kernel, dilation, stride, padding = (conv.kernel_size[-2], conv.dilation[-2], conv.stride[-2],
                                             conv.padding[-2])
        self.rows = ConvRows(extent=dilation * (kernel - 1) + 1, stride=stride, pad_top=prepad[0] + padding,
                             pad_bottom=prepad[1] + padding)
        # the rows next to the image's edges made in a mode (zeros, copies or mirror images of image rows): the
        # model's, or those of a convolution that pads in a mode itself (the two never stack: see the check)
        zeros = conv.padding_mode == "zeros"
        self.edge_rows, self.edge_mode = (prepad, prepad_mode) if zeros else ((padding, padding), conv.padding_mode)
        other = tuple(conv.padding[:-2]) + (0, conv.padding[-1])
        self.window_padding = other if zeros else (0,) * len(other)
        # a convolution padding in a mode pads the other axes of a window in that mode itself, as its forward does
        self.window_pad = None if zeros else tuple(
            amount for axis in reversed(range(len(other))) for amount in (other[axis], other[axis]))
        self.functional = next(fn for cls, fn in _FUNCTIONAL.items() if isinstance(conv, cls))

    def __call__(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.runtime.active is None:
            return self.original(input, weight, bias)
        top, bottom = self.prepad
        plan = self.runtime.halo_plan(self.name, input.shape[-2] - top - bottom, self.rows, input.device)
        rank = self.runtime.rank
        start = plan.in_ranges[rank][0]

        def own(rows: Rows) -> torch.Tensor:
            return input.narrow(-2, top + rows[0] - start, rows[1] - rows[0])

        shape = list(input.shape)
        receive_shapes = []
        for peer, rows in plan.receives:
            shape[-2] = rows[1] - rows[0]
            receive_shapes.append((peer, tuple(shape)))
        received, works = halo_exchange_start([(peer, own(rows)) for peer, rows in plan.sends], receive_shapes,
                                              self.runtime.group, input.dtype, input.device, self.runtime.stats)
        mine = plan.mine
        local = self.original(input, weight, bias) if mine.local_out else None
        halo_exchange_wait(works)
        halos = {peer: (rows, block) for (peer, rows), block in zip(plan.receives, received)}
        fixed = [(fix, self._window(plan, fix, own, halos, weight, bias)) for fix in mine.fixes]
        self.runtime.active.last_conv_rows = mine.out_rows + (plan.out_ranges[-1][1],)
        return self._assemble(plan, local, fixed, input, weight, bias)

    def _window(self, plan: HaloPlan, fix: Rows, own, halos, weight, bias) -> torch.Tensor:
        """Convolve the output rows `fix` from their window: padding at the image's edges, rows of every holder."""
        low, high = self.rows.reads(*fix)
        real = (max(low, 0), min(high, plan.height))
        blocks = []
        for rank, (start, stop) in enumerate(plan.in_ranges):
            rows = (max(real[0], start), min(real[1], stop))
            if rows[0] >= rows[1]:
                continue
            if rank == self.runtime.rank:
                blocks.append(own(rows))
            else:
                held, block = halos[rank]
                blocks.append(block.narrow(-2, rows[0] - held[0], rows[1] - rows[0]))
        real = torch.cat(blocks, dim=-2)
        above = self._edge_padding(real, low, min(high, 0), first=True)
        below = self._edge_padding(real, max(low, plan.height), high, first=False, height=plan.height)
        window = torch.cat(above + [real] + below, dim=-2)
        if self.window_pad is not None:
            window = F.pad(window, self.window_pad, mode=self.edge_mode)
        out = self.functional(window, weight, bias, self.conv.stride, self.window_padding, self.conv.dilation,
                              self.conv.groups)
        if out.shape[-2] != fix[1] - fix[0]:
            raise AssertionError(f"{self.name}: window gave {out.shape[-2]} rows for {fix}")
        return out

    def _edge_padding(self, real: torch.Tensor, low: int, high: int, first: bool,
                      height: int = 0) -> list[torch.Tensor]:
        """The padding rows [low, high) past the image's top (first) or bottom edge, next to the window's image rows
        `real`: the rows made in a mode next to the image (zeros, copies of the edge row, or its mirror images), the
        convolution's zero padding beyond."""
        if high <= low:
            return []
        moded = self.edge_rows[0 if first else 1]
        if first:
            zero_rows = max(0, min(high, -moded) - low)  # rows above -moded: the convolution's zeros
            mode_rows = high - low - zero_rows
        else:
            mode_rows = max(0, min(high, height + moded) - low)
            zero_rows = high - low - mode_rows
        edge = real.narrow(-2, 0 if first else real.shape[-2] - 1, 1)
        if self.edge_mode == "replicate":
            made = edge.expand(_with_rows(edge, mode_rows))
        elif self.edge_mode == "reflect":  # row -j is row j, row height - 1 + j is row height - 1 - j
            made = real.narrow(-2, 1 if first else real.shape[-2] - 1 - mode_rows, mode_rows).flip(-2)
        else:
            made = edge.new_zeros(_with_rows(edge, mode_rows))
        zeros = edge.new_zeros(_with_rows(edge, zero_rows))
        return [zeros, made] if first else [made, zeros]

    def _assemble(self, plan: HaloPlan, local, fixed, input, weight, bias) -> torch.Tensor:
        mine = plan.mine
        first, last = mine.out_rows
        if first == last:  # no output rows here (only when a layer has fewer rows than ranks)
            window = input.new_zeros(_with_rows(input, self.rows.extent))
            if self.window_pad is not None:
                window = F.pad(window, self.window_pad)
            out = self.functional(window, weight, bias, self.conv.stride, self.window_padding, self.conv.dilation,
                                  self.conv.groups)
            return out.narrow(-2, 0, 0)
        covered = (mine.local_first, mine.local_first + mine.local_out)
        inside = local is not None and covered[0] <= first and last <= covered[1]
        if inside:
            for (fix_first, fix_last), rows in fixed:
                local.narrow(-2, fix_first - covered[0], fix_last - fix_first).copy_(rows)
            if (first, last) == covered:
                return local
            return local.narrow(-2, first - covered[0], last - first)
        pieces = [rows for fix, rows in fixed if fix[0] < mine.keep[0]]
        if mine.keep[0] < mine.keep[1]:
            pieces.append(local.narrow(-2, mine.keep[0] - covered[0], mine.keep[1] - mine.keep[0]))
        pieces += [rows for fix, rows in fixed if fix[0] >= mine.keep[1]]
        return torch.cat(pieces, dim=-2)


def _with_rows(row: torch.Tensor, count: int) -> tuple[int, ...]:
    shape = list(row.shape)
    shape[-2] = count
    return tuple(shape)


class AgreedFramePieces:
    """Stands in for the forward of a convolution that runs its frames in pieces (`paradiff.vae.plan.FramePieces`):
    while split, the piece count is the one of the whole input (every rank's rows), so every rank convolves as many
    pieces, overlapping as the model overlaps them, as one device would."""

    def __init__(self, runtime: VaeRuntime, name: str, conv: nn.Module, count, overlap) -> None:
        self.runtime = runtime
        self.name = name
        self.conv = conv
        self.count = count
        self.overlap = overlap
        self.original = conv.forward
        # the convolution itself, without the model's piecewise forward
        self.convolve = next(cls.forward for cls in type(conv).__mro__ if cls in _FUNCTIONAL).__get__(conv)

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        if self.runtime.active is None:
            return self.original(input)
        full = list(input.shape)
        full[-2] = sum(self.runtime.band_heights(self.name, input.shape[-2], input.device))
        count = self.count(self.conv, tuple(full))
        if count <= 1:
            return self.convolve(input)
        pieces = torch.chunk(input, count, dim=2)
        overlap = self.overlap(self.conv)
        if overlap > 0:
            pieces = [pieces[0]] + [torch.cat([_last_frames(before, overlap), piece], dim=2)
                                    for before, piece in zip(pieces, pieces[1:])]
        return torch.cat([self.convolve(piece) for piece in pieces], dim=2)


def _last_frames(piece: torch.Tensor, count: int) -> torch.Tensor:
    count = min(count, piece.shape[2])
    return piece.narrow(2, piece.shape[2] - count, count)
