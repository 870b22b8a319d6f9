"""Replace planned Linears by their sharded versions, from a full in-memory weight or from already-read shards."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paradiff.distributed.comm import all_gather_heads_tp, all_reduce_tp
from paradiff.runtime.patches import add_hook, replace_module, replace_parameter, set_attribute, wrap_forward
from paradiff.tensor_parallel.layers import (ShardedConv, ShardedLinear, ShardedNorm, VocabParallelEmbedding, make_sharded_module, make_vocab_parallel)
from paradiff.tensor_parallel.heads import HeadSplit, uneven_piece
from paradiff.tensor_parallel.plan import ResolvedPlan, localise_heads
from paradiff.tensor_parallel.styles import ShardSpec


def slice_tensor(full: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """This rank's part of a full tensor, as its own storage (so the full tensor can be freed)."""
    if spec is None:
        return full
    pieces = [full.narrow(spec.dim, start, length) for start, length in spec.pieces]
    return torch.cat(pieces, dim=spec.dim).clone() if len(pieces) > 1 else pieces[0].clone()


def set_submodule(model: nn.Module, name: str, module: nn.Module,
                  shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Put the sharded `module` in the place of `name`; the layer it replaces gives up its tensors: read shard-on-read
    they are this rank's slice, now the sharded layer's (held twice, a later quantization could not free them); in
    memory they are the full weights, which a rank must not keep (the point of splitting). `remove_patches` gives
    back the layer with meta tensors of its declared `shapes` (the full ones), to be loaded again
    (docs/architecture.md, "The patch layer")."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    replace_module(parent, leaf, module, by="tp", release=True, shapes=shapes)


def swap_in_sharded_linears(
    model: nn.Module, resolved: ResolvedPlan, group: dist.ProcessGroup, weights_are_local: bool
) -> None:
    """Swap every planned nn.Linear for a ShardedLinear and shrink the attention head counts.

    With `weights_are_local` the Linear already holds this rank's shard (shard-on-read); otherwise it holds the full
    weight, which is sliced here and released.
    """
    size = dist.get_world_size(group)
    local_of: dict[tuple, torch.Tensor] = {}  # tied tables (an LM head and its embedding) keep sharing one slice
    for name, linear in resolved.linears.items():
        module = model.get_submodule(name) if name else model
        if linear.style.target == "parameter":  # a bare per-head parameter: sliced in place, the module stays
            for leaf, spec in linear.specs.items():
                value = module._parameters[leaf].data
                replace_parameter(module, leaf, nn.Parameter(value if weights_are_local else slice_tensor(value, spec),
                                                             requires_grad=False), by="tp", release=True,
                                  shape=linear.full_shapes.get(leaf))
            continue
        if isinstance(module, (ShardedLinear, ShardedNorm, ShardedConv, VocabParallelEmbedding)):
            raise RuntimeError(f"{name} is already tensor-parallel; enable_parallelism was called twice.")
        weight, bias = (None if getattr(module, leaf, None) is None else getattr(module, leaf).data
                        for leaf in ("weight", "bias"))
        if not weights_are_local:
            if weight is not None:
                key = (id(module.weight), linear.specs["weight"])
                if key not in local_of:
                    local_of[key] = slice_tensor(weight, linear.specs["weight"])
                weight = local_of[key]
            bias = None if bias is None else slice_tensor(bias, linear.specs.get("bias"))
        if linear.embedding:
            _shard_embedding(module, linear, weight, group)
            continue
        full = linear.full_shapes.get("weight", (linear.features,))
        sharded = make_sharded_module(linear.style, module, weight, bias, linear.specs["weight"], full, group,
                                      gather_sizes=linear.gather_sizes, replicas=linear.replicas)
        set_submodule(model, name, sharded, shapes=linear.full_shapes)
    localise_heads(model, resolved)
    rank = dist.get_rank(group)
    for name, outputs in resolved.head_outputs.items():
        heads = resolved.head_splits.get(name)
        add_hook(model.get_submodule(name), _local_heads_of_outputs(outputs, rank, size, heads, name), by="tp")
    for name, arguments in resolved.head_inputs.items():
        module = model.get_submodule(name)
        add_hook(module, _local_heads_of_inputs(module, arguments, rank, size, resolved.head_splits.get(name), name),
                 by="tp", pre=True, with_kwargs=True)
    for name, outputs in resolved.gather_heads.items():
        add_hook(model.get_submodule(name),
                 _outputs_hook(outputs, _gather_heads(group, rank, resolved.head_splits.get(name)), name), by="tp")
    for name, factory in resolved.forwards.items():  # the instance's forward shadows its class's
        module = model.get_submodule(name)
        wrap_forward(module, factory(module, None), by="tp")
    for name in resolved.reduce_outputs:
        add_hook(model.get_submodule(name), lambda _module, _args, output: all_reduce_tp(output, group), by="tp")


def _narrow_heads(tensor: torch.Tensor, dim: int, what: str, rank: int, size: int,
                  heads: HeadSplit | None) -> torch.Tensor:
    """This rank's heads of a tensor that holds every head along `dim` (one entry or a fixed width per head)."""
    count = tensor.shape[dim]
    query = None if heads is None else heads.query_heads
    if query is not None and count % query == 0:
        start, length = heads.query[rank]
        unit = count // query
        return tensor.narrow(dim, start * unit, length * unit)
    if query is None and count >= size:  # no head count known: as many rows as ranks at least, floor/ceil
        start, length = uneven_piece(count, rank, size)
        return tensor.narrow(dim, start, length)
    raise ValueError(f"{what} has {count} entries along dim {dim}, which is not a whole number per head of the "
                     f"{query} attention heads split over tp_degree={size}.")


def _gather_heads(group: dist.ProcessGroup, rank: int, heads: HeadSplit | None):
    """All-gather an output left split by heads: ranks may hold different numbers of heads."""
    def gather(tensor: torch.Tensor, dim: int, _what: str) -> torch.Tensor:
        if heads is None:
            return all_gather_heads_tp(tensor, dim, group)
        unit = tensor.shape[dim] // heads.query[rank][1]
        return all_gather_heads_tp(tensor, dim, group, sizes=[count * unit for _, count in heads.query])

    return gather


def _local_heads_of_outputs(outputs: dict[int, int], rank: int, size: int, heads: HeadSplit | None, name: str):
    return _outputs_hook(outputs, lambda tensor, dim, what: _narrow_heads(tensor, dim, what, rank, size, heads),
                         name)


def _local_heads_of_inputs(module: nn.Module, arguments: dict[str, dict[int, int]], rank: int, size: int,
                           heads: HeadSplit | None, name: str):
    import inspect

    positions = list(inspect.signature(module.forward).parameters)  # names checked when the plan was resolved
    def local_heads(tensor: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        return _narrow_heads(tensor, dim, what, rank, size, heads)

    def hook(_module, args, kwargs):
        args = list(args)
        for argument, items in arguments.items():
            index = positions.index(argument)
            value = kwargs.get(argument) if argument in kwargs else args[index] if index < len(args) else None
            if value is None:
                continue
            if torch.is_tensor(value):
                value = local_heads(value, items[0], f"{name or 'model'} argument {argument}")
            elif isinstance(value, dict):  # keyed items (a KV cache's tensors): views, so writes reach the caller's
                value = {key: local_heads(item, items[key], f"{name or 'model'} argument {argument}[{key!r}]")
                         if key in items else item for key, item in value.items()}
            else:
                value = list(value)
                for item, dim in items.items():
                    value[item] = local_heads(value[item], dim, f"{name or 'model'} argument {argument}[{item}]")
                value = tuple(value)
            if argument in kwargs:
                kwargs[argument] = value
            else:
                args[index] = value
        return tuple(args), kwargs

    return hook


def _outputs_hook(outputs: dict[int, int], transform, name: str):
    """A forward hook applying `transform(tensor, dim, what)` to the chosen items of a module's output."""
    def hook(_module, _args, output):
        if torch.is_tensor(output):
            return transform(output, outputs[0], f"{name} output")
        items = list(output)
        for index, dim in outputs.items():
            items[index] = transform(items[index], dim, f"{name} output {index}")
        return type(output)(items) if isinstance(output, tuple) else items

    return hook


def _shard_embedding(module: nn.Embedding, linear, weight: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Embeddings keep their class (Gemma's scaled one, T5's relative-position table): only the table shrinks."""
    replace_parameter(module, "weight", nn.Parameter(weight, requires_grad=False), by="tp", release=True,
                      shape=linear.full_shapes.get("weight"))
    if linear.specs["weight"].dim == 1:
        set_attribute(module, "embedding_dim", weight.shape[1], by="tp")
    if linear.style.kind == "vocab":
        make_vocab_parallel(module, linear.specs["weight"], group)
