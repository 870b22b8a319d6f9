"""Linear recurrences over a sequence split across the CP ranks: S_t = S_{t-1} W_t + U_t (matrices, a row-vector
state included), as SANA-WM's gated delta rule carries its D x D state frame to frame. A rank's steps compose into
one affine map S -> S P + Q; the ranks all-gather those small maps and each folds the ones before it (after it, for
a scan run backwards) into the state its first step receives. Exact: the same products, associated differently."""

from __future__ import annotations

import torch

from paradiff.context_parallel.runtime import ContextParallelRuntime


def compose(weights: torch.Tensor, updates: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, Q) of the steps along `dim` taken in order, (..., n, n) weights and (..., m, n) updates per step."""
    product = torch.eye(weights.shape[-1], dtype=weights.dtype, device=weights.device).expand_as(weights.select(dim, 0))
    offset = torch.zeros_like(updates.select(dim, 0))
    for step in range(weights.shape[dim]):
        weight = weights.select(dim, step)
        product, offset = product @ weight, offset @ weight + updates.select(dim, step)
    return product, offset


def incoming_state(product: torch.Tensor, offset: torch.Tensor, runtime: ContextParallelRuntime,
                   reverse: bool = False) -> torch.Tensor:
    """The state this rank's first step receives (its last, with `reverse`: the scan runs from the last rank to
    the first), from every rank's (P, Q) of its own steps; zero at the sequence's start."""
    rank, size = runtime.cp_rank, runtime.cp_size
    one_each = [1] * size  # one map per rank: no lengths to gather first
    products = runtime.gathered(product.unsqueeze(0).contiguous(), 0, one_each)[0]
    offsets = runtime.gathered(offset.unsqueeze(0).contiguous(), 0, one_each)[0]
    state = torch.zeros_like(offset)
    for peer in (range(size - 1, rank, -1) if reverse else range(rank)):
        state = state @ products[peer] + offsets[peer]
    return state
