"""Attach context parallelism to a model: split hooks, gather hooks and attention interception, per the plan."""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from paradiff.distributed.comm import all_gather_int, all_gather_ints, all_gather_uneven
from paradiff.errors import DistributedError, ParallelConfigError, PlanError
from paradiff.runtime.patches import add_hook, module_patches, remove_patch, set_attribute, set_processor, wrap_forward
from paradiff.runtime.state import ParallelState
from paradiff.tensor_parallel.plan import expand_key
from paradiff.context_parallel.attention import even_sizes, local_chunk
from paradiff.context_parallel.experts import ExpertChoice, check_expert_choice, expert_choice_forward
from paradiff.context_parallel.kernels import check_backend
from paradiff.context_parallel.grid import check_halo_conv, grid_layout, halo_conv_hooks, split_grid
from paradiff.context_parallel.groups import token_group_hooks
from paradiff.context_parallel.linear import LinearAttentionProcessor
from paradiff.context_parallel.plan import ContextParallelPlan, Count, GridSplit, Split, TokenGroups
from paradiff.context_parallel.runtime import AttentionInterceptor, ContextParallelRuntime, require_native_processors


@dataclass
class ResolvedContextPlan:
    split_inputs: dict[str, dict[str, Split | dict]]
    split_outputs: dict[str, dict[int, Split]]
    gather_outputs: dict[str, int | dict[int, int]]
    local_attention: set[str]
    split_token_arguments: dict[str, tuple[str, ...]]
    unsupported_inputs: dict[str, dict[str, str]]
    halo_convs: list[str] = field(default_factory=list)
    linear_attention: list[str] = field(default_factory=list)
    rewrite_inputs: dict[str, Any] = field(default_factory=dict)
    gathered_attention: set[str] = field(default_factory=set)
    prefix_attention: dict[str, str] = field(default_factory=dict)
    token_groups: dict[str, TokenGroups] = field(default_factory=dict)
    processors: dict[str, Any] = field(default_factory=dict)
    forwards: dict[str, Any] = field(default_factory=dict)
    expert_choice: dict[str, ExpertChoice] = field(default_factory=dict)


def _expand(model: nn.Module, entries: dict[str, Any], what: str) -> dict[str, Any]:
    expanded: dict[str, Any] = {}
    for key, value in entries.items():
        for name in expand_key(model, key) if key else [""]:
            try:
                model.get_submodule(name)
            except AttributeError as exc:
                raise PlanError(f"Context-parallel plan ({what}) names {name!r}, not a submodule of "
                                f"{type(model).__name__}.") from exc
            if isinstance(value, dict):
                expanded.setdefault(name, {}).update(value)
            else:
                expanded[name] = value
    return expanded


def resolve_cp_plan(model: nn.Module, plan: ContextParallelPlan) -> ResolvedContextPlan:
    """Validate the plan against the model (before any weight or collective) and expand its globs."""
    if not isinstance(plan, ContextParallelPlan):
        raise PlanError(f"cp_plan must be a paradiff.ContextParallelPlan, got {type(plan).__name__}.")
    require_native_processors(model, frozenset(_expand(model, plan.processors, "processors")))
    split_inputs = _expand(model, plan.split_inputs, "split_inputs")
    for name, arguments in split_inputs.items():
        module = model.get_submodule(name) if name else model
        parameters = inspect.signature(module.forward).parameters
        for argument, split in arguments.items():
            if argument not in parameters:
                raise PlanError(f"Context-parallel plan splits argument {argument!r} of {name or 'the model'}, whose "
                                f"forward takes {list(parameters)}.")
            missing = [size for size in getattr(split, "sizes", ()) if size not in parameters]
            if missing:
                raise PlanError(f"Context-parallel plan's GridSplit at {name or 'the model'} names size arguments "
                                f"{missing}, but its forward takes {list(parameters)}.")
    local = set()
    for key in plan.local_attention:
        local.update(expand_key(model, key))
    halo_convs = [name for key in plan.halo_convs for name in expand_key(model, key)]
    for name in halo_convs:
        check_halo_conv(_submodule(model, name, "halo_convs"), name)
    linear = [name for key in plan.linear_attention for name in expand_key(model, key)]
    for name in linear:
        if not hasattr(_submodule(model, name, "linear_attention"), "processor"):
            raise PlanError(f"Context-parallel plan lists {name!r} as linear attention, but it is not an attention "
                            "module (it has no processor).")
    prefix_attention = _expand(model, plan.prefix_attention, "prefix_attention")
    for name, argument in prefix_attention.items():
        parameters = inspect.signature(model.get_submodule(name).forward).parameters
        if argument not in parameters:
            raise PlanError(f"Context-parallel plan's prefix_attention names argument {argument!r} of {name!r}, "
                            f"whose forward takes {list(parameters)}.")
    rewrite_inputs = _expand(model, plan.rewrite_inputs, "rewrite_inputs")
    for name, rewrite in rewrite_inputs.items():
        if not callable(rewrite):
            raise PlanError(f"Context-parallel plan's rewrite_inputs for {name or 'the model'} must be a function of "
                            f"its forward arguments returning replacements, got {type(rewrite).__name__}.")
    processors = _expand(model, plan.processors, "processors")
    for name, factory in processors.items():
        if not hasattr(_submodule(model, name, "processors"), "processor") or not callable(factory):
            raise PlanError(f"Context-parallel plan's processors entry {name!r} must name an attention module (one "
                            f"with a processor) and give a function of the runtime; got {type(factory).__name__}.")
    forwards = _expand(model, plan.forwards, "forwards")
    for name, factory in forwards.items():
        _submodule(model, name, "forwards")
        if not callable(factory):
            raise PlanError(f"Context-parallel plan's forwards entry {name!r} must be a function of (module, runtime), "
                            f"got {type(factory).__name__}.")
    expert_choice = _expand(model, plan.expert_choice, "expert_choice")
    for name, spec in expert_choice.items():
        if not isinstance(spec, ExpertChoice):
            raise PlanError(f"Context-parallel plan's expert_choice for {name!r} must be an ExpertChoice, got "
                            f"{type(spec).__name__}.")
        check_expert_choice(model.get_submodule(name), spec, name)
    return ResolvedContextPlan(
        split_inputs=split_inputs,
        split_outputs=_expand(model, plan.split_outputs, "split_outputs"),
        gather_outputs=_expand(model, plan.gather_outputs, "gather_outputs"),
        local_attention=local,
        split_token_arguments=_expand(model, plan.split_token_arguments, "split_token_arguments"),
        unsupported_inputs=_expand(model, plan.unsupported_inputs, "unsupported_inputs"),
        halo_convs=halo_convs,
        linear_attention=linear,
        rewrite_inputs=rewrite_inputs,
        gathered_attention={name for key in plan.gathered_attention for name in expand_key(model, key)},
        prefix_attention=prefix_attention,
        token_groups=_expand(model, plan.token_groups, "token_groups"),
        processors=processors,
        expert_choice=expert_choice,
        forwards=forwards,
    )


def _submodule(model: nn.Module, name: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError as exc:
        raise PlanError(f"Context-parallel plan ({what}) names {name!r}, not a submodule of "
                        f"{type(model).__name__}.") from exc


class _SplitOnRead(Sequence):
    """A list argument whose items are split when read (`Split(deferred=True)`): the split they follow is made by a
    module the model calls after receiving the list."""

    def __init__(self, items: Sequence, split: Split, runtime: ContextParallelRuntime, what: str) -> None:
        self.items, self.split, self.runtime, self.what = items, split, runtime, what

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return _split(self.items[index], self.split, self.runtime, f"{self.what}[{index}]")


def _split(value: Any, split: Split | dict, runtime: ContextParallelRuntime, what: str) -> Any:
    if isinstance(split, Split) and split.deferred and isinstance(value, (tuple, list)):
        return _SplitOnRead(value, replace(split, deferred=False), runtime, what)
    if isinstance(split, dict):  # {item index: Split or nested dict}: only those items of a tuple argument
        items = list(value)
        for index, item_split in split.items():
            items[index] = _split(items[index], item_split, runtime, f"{what}[{index}]")
        return type(value)(items) if isinstance(value, tuple) else items
    if isinstance(value, (tuple, list)):  # e.g. (cos, sin) rotary tables
        return type(value)(_split(item, split, runtime, f"{what}[{index}]") for index, item in enumerate(value))
    if isinstance(value, dict):  # e.g. AnyFlow's {"query": freqs, "key": freqs}
        return {key: _split(item, split, runtime, f"{what}[{key!r}]") for key, item in value.items()}
    if not torch.is_tensor(value) or (split.ndim is not None and value.dim() not in (
            split.ndim if isinstance(split.ndim, tuple) else (split.ndim,))):
        return value
    dim = split.dim % value.dim()
    if split.like is not None:
        layout = runtime.grid_layouts.get(split.like)
        if layout is None:
            raise ValueError(f"{what}: Split(like={split.like!r}) follows the GridSplit of {split.like!r}, which the "
                             "plan has not applied before this module.")
        return split_grid(value, GridSplit(dim=dim), layout, runtime.cp_rank)
    if split.within is not None:
        return _split_within(value, dim, split.within, runtime, what)
    if split.parts:
        return _split_parts(value, dim, split.parts, runtime, what)
    if value.shape[dim] < runtime.cp_size:
        # diffusers' blocks cannot run on an empty token block (their reshapes fail), so every rank needs one.
        # Every rank sees the same full length, so all of them raise here, before any collective of this forward.
        raise ValueError(
            f"{what} has {value.shape[dim]} tokens along dim {dim}, fewer than the {runtime.cp_size} context-parallel "
            f"ranks; each rank needs at least one token. Use a longer sequence or fewer CP ranks."
        )
    # contiguous: a compiled block guards on its inputs' strides, and the first block would otherwise see a strided
    # view of the full tensor while the others see dense tensors (one extra compilation)
    return local_chunk(value, dim, runtime.cp_rank, runtime.cp_size).contiguous()


def _split_within(value: torch.Tensor, dim: int, stream: str, runtime: ContextParallelRuntime, what: str):
    tokens = runtime.full_tokens.get(stream)
    if tokens is None or value.shape[dim] % tokens != 0:
        raise ValueError(
            f"{what}: Split(within={stream!r}) needs dim {dim} (size {value.shape[dim]}) to be a multiple of the full "
            f"length of {stream!r} ({tokens}, known once the plan splits {stream!r})."
        )
    grouped = value.unflatten(dim, (value.shape[dim] // tokens, tokens))
    return local_chunk(grouped, dim + 1, runtime.cp_rank, runtime.cp_size).flatten(dim, dim + 1)


def _split_parts(value: torch.Tensor, dim: int, parts: tuple[str, ...], runtime: ContextParallelRuntime,
                 what: str) -> torch.Tensor:
    missing = [part for part in parts if part not in runtime.full_tokens]
    if missing:
        raise PlanError(f"{what} is split by parts {parts}, but the plan splits no {missing} before it; name token "
                        f"streams split in split_inputs ({sorted(runtime.full_tokens)} are).")
    lengths = [runtime.full_tokens[part] for part in parts]
    if sum(lengths) != value.shape[dim]:
        raise ValueError(f"{what} has {value.shape[dim]} entries along dim {dim}, but its parts {parts} have "
                         f"{lengths} tokens (sum {sum(lengths)}).")
    starts = [sum(lengths[:index]) for index in range(len(lengths))]
    return torch.cat([local_chunk(value.narrow(dim, start, length), dim, runtime.cp_rank, runtime.cp_size)
                      for start, length in zip(starts, lengths)], dim=dim)


def _local_count(count: Count, value: Any, runtime: ContextParallelRuntime, what: str) -> Any:
    """How many of the first (last) `value` tokens of the split stream lie in this rank's chunk."""
    full = runtime.full_tokens.get(count.of)
    if full is None:
        raise ValueError(f"{what} counts tokens of {count.of!r}, which the plan does not split before it.")
    if not isinstance(value, int) or not 0 <= value <= full:
        raise ValueError(f"{what}={value!r} should count tokens of {count.of!r}, an int from 0 to {full}.")
    sizes = even_sizes(full, runtime.cp_size)
    start = sum(sizes[: runtime.cp_rank])
    end = start + sizes[runtime.cp_rank]
    first, last = (full - value, full) if count.tail else (0, value)
    return max(0, min(end, last) - max(start, first))


TOKEN_STREAMS = ("encoder_hidden_states", "hidden_states")  # joint sequences put the text first


def _input_splitter(module: nn.Module, arguments: dict[str, Split | Count | dict],
                    runtime: ContextParallelRuntime):
    positions = {name: index for index, name in enumerate(inspect.signature(module.forward).parameters)}

    def hook(_module, args, kwargs):
        args = list(args)
        given = {name: kwargs[name] if name in kwargs else args[positions[name]] for name in arguments
                 if name in kwargs or positions[name] < len(args)}
        for name, value in given.items():  # first, so arguments split by parts see this call's stream lengths
            if name in TOKEN_STREAMS and torch.is_tensor(value) and isinstance(arguments[name], Split):
                runtime.full_tokens[name] = value.shape[arguments[name].dim % value.dim()]
        _split_grids(arguments, positions, args, kwargs, runtime)
        for name, value in given.items():
            split = arguments[name]
            if isinstance(split, GridSplit):
                continue
            local = (_local_count(split, value, runtime, name) if isinstance(split, Count)
                     else _split(value, split, runtime, name))
            if name in kwargs:
                kwargs[name] = local
            else:
                args[positions[name]] = local
        return tuple(args), kwargs

    return hook


def _split_grids(arguments: dict, positions: dict[str, int], args: list, kwargs: dict,
                 runtime: ContextParallelRuntime) -> None:
    """Apply a module's GridSplits (in place on args / kwargs): its tensors, then its first size argument."""
    def get(name):
        return kwargs[name] if name in kwargs else (args[positions[name]] if positions[name] < len(args) else None)

    def put(name, value):
        if name in kwargs or positions[name] >= len(args):
            kwargs[name] = value
        else:
            args[positions[name]] = value

    rewrites = {}
    for name, split in arguments.items():
        if not isinstance(split, GridSplit):
            continue
        sizes = [get(size) for size in split.sizes]
        if not all(isinstance(size, int) for size in sizes):
            raise ValueError(f"GridSplit of {name!r} needs integer size arguments {split.sizes}, got {sizes}.")
        full, chunks, local = grid_layout(sizes, runtime, name)
        put(name, split_grid(get(name), split, (full, chunks), runtime.cp_rank))
        if name in TOKEN_STREAMS:
            runtime.grid_layouts[name] = (full, chunks)
            runtime.full_tokens[name] = full
        rewrites[split.sizes[0]] = local
    for size, local in rewrites.items():
        put(size, local)


def _token_split(value: Any, runtime: ContextParallelRuntime, what: str) -> Any:
    """Split a tensor (or tuple / list of them) along its token dimension, found by the recorded full lengths; one
    without such a dimension stays whole. Every rank recorded the same full lengths, so every rank decides alike."""
    if isinstance(value, (tuple, list)):
        return type(value)(_token_split(item, runtime, what) for item in value)
    if not torch.is_tensor(value):
        return value
    image = runtime.full_tokens.get("hidden_states")
    text = runtime.full_tokens.get("encoder_hidden_states")
    for dim in range(value.dim()):
        if value.shape[dim] == image and text is None:
            return local_chunk(value, dim, runtime.cp_rank, runtime.cp_size)
        if text is not None and image is not None and value.shape[dim] == text + image:
            text_part = local_chunk(value.narrow(dim, 0, text), dim, runtime.cp_rank, runtime.cp_size)
            image_part = local_chunk(value.narrow(dim, text, image), dim, runtime.cp_rank, runtime.cp_size)
            return torch.cat([text_part, image_part], dim=dim)
    return value  # not per token (e.g. a per-sample timestep embedding): every rank needs all of it


def _token_argument_splitter(module: nn.Module, arguments: tuple[str, ...], runtime: ContextParallelRuntime,
                             name: str):
    positions = {arg: index for index, arg in enumerate(inspect.signature(module.forward).parameters)}

    def hook(_module, args, kwargs):
        args = list(args)
        for arg in arguments:
            if arg in kwargs:
                kwargs[arg] = _token_split(kwargs[arg], runtime, f"{name}.{arg}")
            elif positions[arg] < len(args):
                args[positions[arg]] = _token_split(args[positions[arg]], runtime, f"{name}.{arg}")
        return tuple(args), kwargs

    return hook


def _input_refuser(module: nn.Module, arguments: dict[str, str], name: str):
    positions = {arg: index for index, arg in enumerate(inspect.signature(module.forward).parameters)}

    def hook(_module, args, kwargs):
        for entry, why in arguments.items():
            arg, _, key = entry.partition(".")  # "argument.key": one key of a dict argument (e.g. attention kwargs)
            value = kwargs.get(arg, args[positions[arg]] if positions.get(arg, len(args)) < len(args) else None)
            if key:
                value = value.get(key) if isinstance(value, dict) else None
            if value is not None:
                raise ParallelConfigError(f"{name or type(module).__name__}: {entry!r} is not supported under "
                                          f"context parallelism: {why}")

    return hook


def _input_rewriter(module: nn.Module, rewrite, name: str):
    parameters = list(inspect.signature(module.forward).parameters)
    positions = {arg: index for index, arg in enumerate(parameters)}

    def hook(_module, args, kwargs):
        args = list(args)
        given = {**dict(zip(parameters, args)), **kwargs}
        for arg, value in rewrite(given).items():
            if arg not in positions:
                raise PlanError(f"Context-parallel plan's rewrite_inputs for {name or 'the model'} returned argument "
                                f"{arg!r}; its forward takes {parameters}.")
            if positions[arg] < len(args):
                args[positions[arg]] = value
            else:
                kwargs[arg] = value
        return tuple(args), kwargs

    return hook


def _output_splitter(name: str, outputs: dict[int, Split], runtime: ContextParallelRuntime):
    def hook(_module, _args, output):
        if torch.is_tensor(output):
            return _split(output, outputs[0], runtime, f"{name} output")
        items = list(output)
        for index, split in outputs.items():
            items[index] = _split(items[index], split, runtime, f"{name} output {index}")
        return type(output)(items) if isinstance(output, tuple) else items

    return hook


def _same_inputs(runtime: ContextParallelRuntime):
    """The model's pre-hook: every rank of the CP group was given inputs of the same shapes (each splits the same
    sequence). Ranks given different lengths would otherwise each split their own and the gather join pieces of
    different sequences: a wrong result, silently. One small all-gather a forward; every rank raises alike."""
    def hook(module, args, kwargs):
        tensors = [leaf for leaf in pytree.tree_leaves((args, dict(sorted(kwargs.items())))) if torch.is_tensor(leaf)]
        shapes = [tuple(tensor.shape) for tensor in tensors]
        summary = [len(shapes), sum(tensor.numel() for tensor in tensors), zlib.crc32(repr(shapes).encode())]
        device = tensors[0].device if tensors else next(module.parameters()).device
        every = all_gather_ints(summary, runtime.cp_group, device)
        if any(row != every[0] for row in every):
            described = "; ".join(f"rank {rank}: {row[0]} tensors, {row[1]} values" for rank, row in enumerate(every))
            raise DistributedError(
                f"the context-parallel ranks of {type(module).__name__} were called with inputs of different shapes "
                f"({described}); every rank of a context-parallel group must pass the same inputs (this rank's: "
                f"{shapes[:4]}{' ...' if len(shapes) > 4 else ''})")

    return hook


def _gather(tensor: torch.Tensor, dim: int, runtime: ContextParallelRuntime) -> torch.Tensor:
    gather_dim = dim % tensor.dim()
    sizes = all_gather_int(tensor.shape[gather_dim], runtime.cp_group, tensor.device)
    return all_gather_uneven(tensor, gather_dim, sizes, runtime.cp_group, runtime.stats)


def _output_gatherer(dims: int | dict[int, int], runtime: ContextParallelRuntime):
    def hook(_module, _args, output):
        if isinstance(dims, int):
            return _gather(output, dims, runtime)
        if isinstance(output, dict):  # a ModelOutput (return_dict=True): its items by position, as its tuple holds
            keys = list(output.keys())
            for index, dim in dims.items():
                if index < len(keys):
                    output[keys[index]] = _gather(output[keys[index]], dim, runtime)
            return output
        items = list(output)
        for index, dim in dims.items():
            if items[index] is not None:  # an optional stream the call did not use (Kandinsky 6 without audio)
                items[index] = _gather(items[index], dim, runtime)
        return type(output)(items) if isinstance(output, tuple) else items

    return hook


def _prefix_recorder(module: nn.Module, argument: str, interceptor: AttentionInterceptor):
    position = list(inspect.signature(module.forward).parameters).index(argument)

    def hook(_module, args, kwargs):
        prefix = kwargs[argument] if argument in kwargs else args[position]
        interceptor.prefix = prefix.shape[-2]

    return hook


def _interceptor_hooks(interceptor: AttentionInterceptor):
    def enter(_module, _args):
        interceptor.__enter__()

    def leave(_module, _args, _output):
        interceptor.__exit__(None, None, None)

    return enter, leave


def _leftover_interceptor_remover(interceptors: list[AttentionInterceptor]):
    """After the model's forward, even a failed one: leave interceptors an exception inside attention left entered.

    The attention modules' own exit hooks are plain forward hooks, skipped on an exception: hooks registered with
    always_call inside a compiled block make Dynamo guard on each module's hook ids, recompiling every block.
    """

    def hook(_module, _args, _output):
        stack = torch.overrides._get_current_function_mode_stack()
        while stack and any(stack[-1] is interceptor for interceptor in interceptors):
            stack.pop().__exit__(None, None, None)

    return hook


def _take_routed_backend(model: nn.Module, runtime: ContextParallelRuntime) -> None:
    """A backend chosen before CP (`paradiff.set_attention_backend` on the plain model routes its SDPA calls) becomes
    the one CP's attention calls: the route would otherwise sit outside CP's interception. Every rank's model holds
    the same choice, so every rank accepts or refuses it alike."""
    routed = [patch for patch in module_patches(model) if patch.kind == "route_attention"]
    for patch in routed:
        name = patch.subject.backend.name
        check_backend(name, runtime.mode)
        remove_patch(model, patch)
        set_attribute(runtime, "backend", name, by=patch.by, owner=model,
                      what=f"attention backend {name!r} (in CP's {runtime.mode} attention)")


def apply_context_parallel(model: nn.Module, state: ParallelState, plan: ResolvedContextPlan) -> ContextParallelRuntime:
    mesh = state.mesh
    config = mesh.config.context_parallel_config
    runtime = ContextParallelRuntime(
        mode=config.mode,
        cp_group=mesh.flat_group(("ring", "ulysses")),
        ring_group=mesh.group("ring") if config.ring_degree > 1 else None,
        ulysses_group=mesh.group("ulysses") if config.ulysses_degree > 1 else None,
    )
    _take_routed_backend(model, runtime)
    handles = []

    def hook(module: nn.Module, function, pre: bool = False, **options) -> None:
        handles.append(add_hook(module, function, by="cp", pre=pre, **options))

    hook(model, _same_inputs(runtime), pre=True, with_kwargs=True)  # before anything splits them
    for name, rewrite in plan.rewrite_inputs.items():  # first: they see the arguments whole
        module = model.get_submodule(name) if name else model
        hook(module, _input_rewriter(module, rewrite, name), pre=True, with_kwargs=True)
    for name, arguments in plan.split_inputs.items():
        module = model.get_submodule(name) if name else model
        hook(module, _input_splitter(module, arguments, runtime), pre=True, with_kwargs=True)
    for name, arguments in plan.unsupported_inputs.items():
        module = model.get_submodule(name) if name else model
        hook(module, _input_refuser(module, arguments, name), pre=True, with_kwargs=True)
    for name, arguments in plan.split_token_arguments.items():
        module = model.get_submodule(name)
        hook(module, _token_argument_splitter(module, arguments, runtime, name), pre=True, with_kwargs=True)
    for name, outputs in plan.split_outputs.items():
        hook(model.get_submodule(name), _output_splitter(name, outputs, runtime))
    for name, dims in plan.gather_outputs.items():
        hook(model.get_submodule(name), _output_gatherer(dims, runtime))
    for name in plan.halo_convs:
        widen, trim = halo_conv_hooks(model.get_submodule(name), name, runtime)
        hook(model.get_submodule(name), widen, pre=True)
        hook(model.get_submodule(name), trim)
    for name, groups in plan.token_groups.items():
        widen, trim = token_group_hooks(model.get_submodule(name), groups, runtime, name)
        hook(model.get_submodule(name), widen, pre=True, with_kwargs=True)
        hook(model.get_submodule(name), trim)
    for name in plan.linear_attention:
        set_processor(model.get_submodule(name), LinearAttentionProcessor(runtime), by="cp")
    for name, factory in plan.processors.items():
        set_processor(model.get_submodule(name), factory(runtime), by="cp")
    for name, factory in plan.forwards.items():  # the instance's forward shadows its class's
        module = model.get_submodule(name)
        wrap_forward(module, factory(module, runtime), by="cp")
    for name, spec in plan.expert_choice.items():  # the instance's forward shadows its class's
        layer = model.get_submodule(name)
        wrap_forward(layer, expert_choice_forward(layer, spec, runtime), by="cp")
    # One interceptor per kind, shared by every attention module: compiled blocks guard on the active mode's
    # identity, so a mode object per module would recompile every block.
    # (A prefix module's interceptor holds the prefix length of the call in flight, set by a pre-hook each call.)
    interceptors: dict[tuple[bool, bool, bool], AttentionInterceptor] = {}
    for name, module in model.named_modules():
        if hasattr(module, "processor"):
            kind = (name in plan.local_attention, name in plan.gathered_attention, name in plan.prefix_attention)
            if kind not in interceptors:
                interceptors[kind] = AttentionInterceptor(runtime, local=kind[0], gather_keys=kind[1])
            interceptor = interceptors[kind]
            if name in plan.prefix_attention:
                hook(module, _prefix_recorder(module, plan.prefix_attention[name], interceptor), pre=True,
                     with_kwargs=True)
            enter, leave = _interceptor_hooks(interceptor)
            hook(module, enter, pre=True)
            hook(module, leave)
    hook(model, _leftover_interceptor_remover(list(interceptors.values())), always_call=True)
    state.context = runtime
    state.cp_hooks = handles
    state.cp_plan = plan
    return runtime
