"""Token grids split by whole slices, for models that convolve over their tokens (Sana's GLUMBConv feed-forward,
Sana-Video's temporal convolution).

A convolution over a grid split by tokens would need rows cut in the middle; split by whole slices of the grid's
first axis (rows, or frames), a 'same'-size convolution needs only the `padding` edge slices of each neighbour.
Each rank borrows them, convolves the widened block, and drops the output slices it borrowed: at the image's own
edges it has no neighbour and the convolution's zero padding applies, as in one process. Exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from paradiff.distributed.comm import halo_exchange_start, halo_exchange_wait
from paradiff.errors import PlanError
from paradiff.context_parallel.attention import even_sizes
from paradiff.context_parallel.plan import GridSplit
from paradiff.context_parallel.runtime import ContextParallelRuntime


def grid_layout(sizes: list[int], runtime: ContextParallelRuntime, what: str) -> tuple[int, list[int], int]:
    """(full tokens, tokens per rank, this rank's first-axis slices) of a grid of `sizes` split by first-axis slices."""
    if sizes[0] < runtime.cp_size:
        # every rank sees the same sizes, so all of them raise here, before any collective of this forward
        raise ValueError(
            f"{what}: the grid's first axis has {sizes[0]} slices, fewer than the {runtime.cp_size} context-parallel "
            f"ranks; each rank needs at least one. Use a larger input or fewer CP ranks."
        )
    unit = math.prod(sizes[1:])
    slices = even_sizes(sizes[0], runtime.cp_size)
    return sizes[0] * unit, [count * unit for count in slices], slices[runtime.cp_rank]


def split_grid(value: Any, split: GridSplit, layout: tuple[int, list[int]], rank: int) -> Any:
    """This rank's slices of a tensor (or tuple / list of them) holding the full grid along `split.dim`."""
    if isinstance(value, (tuple, list)):
        return type(value)(split_grid(item, split, layout, rank) for item in value)
    full, chunks = layout
    if not torch.is_tensor(value) or value.dim() == 0 or value.shape[split.dim % value.dim()] != full:
        return value
    return value.narrow(split.dim % value.dim(), sum(chunks[:rank]), chunks[rank])


def check_halo_conv(conv: nn.Module, name: str) -> int:
    """The number of edge slices a 'same'-size, stride-1 convolution reads past each end of dim -2."""
    kind = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    if not isinstance(conv, kind) and type(conv).__name__ != "ShardedConv":
        raise PlanError(f"Context-parallel plan lists {name!r} as a halo convolution, but it is {type(conv).__name__}.")
    kernel, stride, dilation, padding = conv.weight.shape[-2], conv.stride[-2], conv.dilation[-2], conv.padding
    if isinstance(padding, str) or stride != 1 or 2 * padding[-2] != dilation * (kernel - 1):
        raise PlanError(
            f"{name}: a halo convolution must keep the size of the split axis (stride 1, padding = dilation x "
            f"(kernel - 1) / 2); it has kernel {kernel}, stride {stride}, dilation {dilation}, padding {padding}."
        )
    return padding[-2]


def halo_conv_hooks(conv: nn.Module, name: str, runtime: ContextParallelRuntime):
    """(pre-hook, hook): widen the input by the neighbours' edge slices, then drop the borrowed output slices."""
    halo = check_halo_conv(conv, name)
    borrowed: list[tuple[int, int]] = []  # (top, bottom) of the call in flight; calls of one module never nest

    def widen(_module, args):
        x = args[0]
        rank, size = runtime.cp_rank, runtime.cp_size
        if halo == 0 or size == 1:
            borrowed.append((0, 0))
            return None
        if x.shape[-2] < halo:
            raise ValueError(f"{name}: this rank holds {x.shape[-2]} slices of the split axis, fewer than the "
                             f"{halo} its convolution reads from each neighbour; use fewer CP ranks.")
        edge = list(x.shape)
        edge[-2] = halo
        neighbours = [peer for peer in (rank - 1, rank + 1) if 0 <= peer < size]
        sends = [(peer, x.narrow(-2, 0 if peer < rank else x.shape[-2] - halo, halo)) for peer in neighbours]
        received, works = halo_exchange_start(sends, [(peer, tuple(edge)) for peer in neighbours], runtime.cp_group,
                                              x.dtype, x.device, runtime.stats)
        halo_exchange_wait(works)
        by_peer = dict(zip(neighbours, received))
        top, bottom = by_peer.get(rank - 1), by_peer.get(rank + 1)
        pieces = [piece for piece in (top, x, bottom) if piece is not None]
        borrowed.append((0 if top is None else halo, 0 if bottom is None else halo))
        return (torch.cat(pieces, dim=-2),) + tuple(args[1:])

    def trim(_module, _args, output):
        top, bottom = borrowed.pop()
        if top == bottom == 0:
            return output
        return output.narrow(-2, top, output.shape[-2] - top - bottom)

    return widen, trim
