"""`save_pretrained`: write a parallel model as a normal diffusers checkpoint, one gathered tensor at a time.

Every rank takes part in each gather (collectives), only rank 0 writes; no rank ever holds more than one full tensor.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from paradiff.io.checkpoint import write_checkpoint
from paradiff.distributed.comm import all_gather_pieces, barrier
from paradiff.errors import UnsupportedModelError
from paradiff.runtime.state import get_state
from paradiff.tensor_parallel.styles import ShardSpec


def _parse_size(value: int | str) -> int:
    if isinstance(value, int):
        return value
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = value.strip().upper()
    for unit, factor in sorted(units.items(), key=lambda item: -len(item[0])):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def unshard(pieces_by_rank: list[torch.Tensor], specs_by_rank: list[ShardSpec], full_shape: tuple) -> torch.Tensor:
    """Inverse of the styles' slicing: each rank's pieces are written back where they came from. Ranks that hold the
    same slice (K/V heads replicated over a rank group) write identical values."""
    full = pieces_by_rank[0].new_empty(full_shape)
    for piece, spec in zip(pieces_by_rank, specs_by_rank):
        offset = 0
        for start, length in spec.pieces:
            full.narrow(spec.dim, start, length).copy_(piece.narrow(spec.dim, offset, length))
            offset += length
    return full


def save_pretrained(model: nn.Module, path: str | os.PathLike, *, max_shard_size: int | str = "5GB") -> None:
    """Gather a (TP-)parallel model and write config + safetensors that plain diffusers loads."""
    folder = Path(path)
    state = get_state(model)
    resolved = state.tp_plan if state else None
    # checked on every rank before any gather, so no rank is left waiting in a collective
    if not hasattr(model, "save_config"):
        raise UnsupportedModelError(
            f"save_pretrained writes diffusers models; {type(model).__name__} is not one (a transformers text "
            "encoder: load it whole and use its own save_pretrained)."
        )
    if resolved is not None and any(l.embedding or l.style.kind == "vocab" for l in resolved.linears.values()):
        raise UnsupportedModelError(
            f"save_pretrained cannot gather {type(model).__name__}'s split embeddings or vocabulary rows yet; load "
            "the model without the plan's embedding / 'vocab' entries to save it."
        )
    tp_group = state.mesh.tp_group if (state and resolved) else None
    writer = not dist.is_initialized() or dist.get_rank() == 0
    local = model.state_dict()
    entries = []
    for name, tensor in local.items():
        spec = resolved.spec_for(name) if resolved else None
        shape = tuple(tensor.shape)
        if spec is not None:
            shape = tuple(resolved.linears[name.rpartition(".")[0]].full_shapes[name.rpartition(".")[2]])
        entries.append((name, tensor.dtype, shape))

    def produce(name: str) -> torch.Tensor:
        tensor = local[name]
        spec = resolved.spec_for(name) if resolved else None
        if spec is None:
            return tensor
        module_name, _, leaf = name.rpartition(".")
        planned = resolved.linears[module_name]
        full_shape = planned.full_shapes[leaf]
        specs = list(planned.rank_specs[leaf])
        sizes = [sum(length for _, length in spec.pieces) for spec in specs]
        return unshard(all_gather_pieces(tensor, tp_group, specs[0].dim, sizes), specs, full_shape)

    if writer:
        folder.mkdir(parents=True, exist_ok=True)
        model.save_config(folder)
    write_checkpoint(folder, entries, produce, _parse_size(max_shard_size), write=writer)
    if dist.is_initialized():
        barrier()
