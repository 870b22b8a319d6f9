"""Adapters per sample, unmerged: fixed-size slots of stacked LoRA factors, and a per-sample slot index.

Each adapted Linear holds `max_loras + 1` slots: A [slots, max_rank, in_local], B [slots, out_local, max_rank] and a
scale per slot. Slot 0 stays zero and means "no adapter". An adapter of rank r < max_rank fills the first r rows of
A and columns of B; the rest stay zero and add exact zeros. Per batch row the slot index picks the factors, a
punica-style shrink then expand batched over the rows:

    y[row] += scale[s] * (x[row] @ A[s]^T) @ B[s]^T,   s = the row's slot

On a split Linear the slots hold this rank's slices, cut as `tensor_parallel/lora.py` cuts peft's factors (A whole
and B's rows for colwise; A's columns and B whole for rowwise, whose partial sum joins the layer's one all-reduce:
`RowwiseLinear.lora_slots`). Loading, switching or clearing an adapter writes tensor values only: no shape and no
Python branch changes, so a compiled model compiles no new graph: traced, a layer always runs all `max_rank` columns
of its slots. Run eagerly, it runs only the widest rank that the rows' slots fill in this layer, and nothing where
none of them touches it (every rank holds the same adapters, so every rank skips the same layers).

Rows and samples: a transformer call sees `k * samples` rows (k = 2 for classifier-free guidance batched in one
call, both halves in sample order as diffusers concatenates them; CFG-parallel ranks each see one half, k = 1), so
row r runs sample r % samples's adapter.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from paradiff.errors import AdapterError


class SlotIndex:
    """The slot of each sample of the next transformer calls, shared by every adapted layer of one model."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.samples = torch.zeros(1, dtype=torch.long)
        self.chosen = frozenset({0})  # the slots `samples` names, on the host (the eager path's rank)

    def set(self, samples: Sequence[int], device: torch.device | str | None = None) -> None:
        bad = [slot for slot in samples if not 0 <= int(slot) < self.slots]
        if not samples or bad:
            raise AdapterError(f"Adapter slots {list(samples)}: each must be in 0..{self.slots - 1} (0: no adapter), "
                               "one per sample.")
        self.samples = torch.tensor([int(slot) for slot in samples], dtype=torch.long, device=device)
        self.chosen = frozenset(int(slot) for slot in samples)

    def rows(self, count: int) -> torch.Tensor:
        samples = self.samples.shape[0]
        if count % samples:
            raise AdapterError(f"A layer with per-sample adapters got {count} batch rows for {samples} sample(s); "
                               "the rows must be a whole number of copies of the samples (set one slot per sample "
                               "of the call).")
        return self.samples if count == samples else self.samples.repeat(count // samples)


class LoraSlots(nn.Module):
    """The slots of one Linear (this rank's slices), and their per-row shrink / expand."""

    def __init__(self, in_features: int, out_features: int, max_loras: int, max_rank: int, index: SlotIndex,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.max_rank = in_features, out_features, max_rank
        # buffers, not parameters: never trained, never saved (persistent=False keeps the state_dict as it was)
        self.register_buffer("lora_a", torch.zeros(max_loras + 1, max_rank, in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras + 1, out_features, max_rank, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("scale", torch.zeros(max_loras + 1, dtype=dtype, device=device), persistent=False)
        object.__setattr__(self, "index", index)  # shared, not a submodule
        # per slot, the rank written there: the rows of A and columns of B that may be nonzero (the rest are zeros)
        self.filled = [0] * (max_loras + 1)

    def extra_repr(self) -> str:
        slots, rank, width = self.lora_a.shape
        return f"slots={slots}, max_rank={rank}, in={width}, out={self.out_features}"

    @torch.no_grad()
    def write(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> None:
        """This rank's slices of one adapter's factors (A r x in_local, B out_local x r) into `slot`. Touches only
        the rows and columns the adapter fills (and those a previous, wider adapter left): an adapter load costs its
        own bytes, not the slots' size."""
        rank = lora_a.shape[0]
        if rank > self.max_rank:
            raise AdapterError(f"A LoRA factor of rank {rank} does not fit slots of max_lora_rank {self.max_rank}; "
                               f"raise max_lora_rank to at least {rank}.")
        if lora_a.shape[1] != self.in_features or lora_b.shape != (self.out_features, rank):
            raise AdapterError(f"LoRA factors {list(lora_a.shape)} / {list(lora_b.shape)} do not fit a slot of "
                               f"{self.in_features} -> {self.out_features} features.")
        left = self.filled[slot]
        if left > rank:
            self.lora_a[slot, rank:left].zero_()
            self.lora_b[slot, :, rank:left].zero_()
        self.lora_a[slot, :rank].copy_(lora_a)
        self.lora_b[slot, :, :rank].copy_(lora_b)
        self.scale[slot] = scale
        self.filled[slot] = rank

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        filled = self.filled[slot]
        if filled:
            self.lora_a[slot, :filled].zero_()
            self.lora_b[slot, :, :filled].zero_()
        self.scale[slot] = 0
        self.filled[slot] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The slots' term alone (the same shape as the layer's output)."""
        return self.add_to(None, x)

    def add_to(self, output: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        """`output` (the layer's own product for input `x`, or None: zeros) plus the slots' term, as one gather of the
        rows' factors and two batched GEMMs: the shrink to max_rank columns, scaled there (max_rank wide, not out
        wide), and the expand, which adds into `output` in place in the same GEMM (`baddbmm_`, read and written once)
        instead of a product, a scaling and a sum over the whole output, each a new tensor. `output` must be the
        layer's fresh product, which nothing else holds yet (the hook runs first; the rowwise layer before its
        all-reduce)."""
        rows = x.shape[0]
        slots = self.index.rows(rows)
        shape = (*x.shape[:-1], self.out_features)
        rank = self.max_rank
        if not torch.compiler.is_compiling():  # eager: only the ranks the rows' adapters fill (the rest are zeros)
            rank = max(self.filled[slot] for slot in self.index.chosen)
            if rank == 0:  # no adapter of these rows touches this layer
                return output if output is not None else x.new_zeros(shape)
        if slots.device != x.device:
            slots = slots.to(x.device)
        tokens = x.reshape(rows, -1, x.shape[-1]).to(self.lora_a.dtype)
        shrunk = torch.bmm(tokens, self.lora_a[slots, :rank].transpose(1, 2))  # rows x tokens x rank
        shrunk = shrunk * self.scale[slots].view(rows, 1, 1)
        expand = self.lora_b[slots, :, :rank].transpose(1, 2)  # rows x rank x out
        if output is None:
            return torch.bmm(shrunk, expand).reshape(shape).to(x.dtype)
        if output.dtype != shrunk.dtype:
            return output + torch.bmm(shrunk, expand).reshape(shape).to(output.dtype)
        if not output.is_contiguous():  # a reshape would copy: the sum is a new tensor
            return torch.baddbmm(output.reshape(rows, -1, self.out_features), shrunk, expand).reshape(output.shape)
        output.view(rows, -1, self.out_features).baddbmm_(shrunk, expand)
        return output


def add_slot_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of an adapted Linear that is not rowwise split: its output plus the slots' (prepended, so it runs
    before a context-parallel gather hook on the same module, on the same local tokens)."""
    return module.lora_slots.add_to(output, args[0])
