"""Replace planned Linears by their sharded versions, from a full in-memory weight or from already-read shards."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .layers import ShardedLinear, make_sharded_linear
from .plan import ResolvedPlan, localise_heads
from .styles import ShardSpec


def slice_tensor(full: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """This rank's part of a full tensor, as its own storage (so the full tensor can be freed)."""
    if spec is None:
        return full
    pieces = [full.narrow(spec.dim, start, length) for start, length in spec.pieces]
    return torch.cat(pieces, dim=spec.dim).clone() if len(pieces) > 1 else pieces[0].clone()


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)


def swap_in_sharded_linears(
    model: nn.Module, resolved: ResolvedPlan, group: dist.ProcessGroup, weights_are_local: bool
) -> None:
    """Swap every planned nn.Linear for a ShardedLinear and shrink the attention head counts.

    With `weights_are_local` the Linear already holds this rank's shard (shard-on-read); otherwise it holds the full
    weight, which is sliced here and released.
    """
    size = dist.get_world_size(group)
    for name, linear in resolved.linears.items():
        module = model.get_submodule(name)
        if isinstance(module, ShardedLinear):
            raise RuntimeError(f"{name} is already tensor-parallel; enable_parallelism was called twice.")
        weight, bias = module.weight.data, None if module.bias is None else module.bias.data
        if not weights_are_local:
            weight = slice_tensor(weight, linear.specs["weight"])
            if bias is not None:
                bias = slice_tensor(bias, linear.specs.get("bias"))
        full = linear.full_shapes["weight"]
        sharded = make_sharded_linear(linear.style, weight, bias, linear.specs["weight"], (full[0], full[1]), group)
        set_submodule(model, name, sharded)
    localise_heads(model, resolved, size)
