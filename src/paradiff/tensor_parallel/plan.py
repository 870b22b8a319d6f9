"""Turn a declarative plan (module-path globs -> styles) into concrete per-module shard specs, and validate it.

Everything here runs on a meta-device model and checkpoint headers only, so a bad plan fails before any weight is
read or any collective is issued.
"""

from __future__ import annotations

import inspect

from dataclasses import dataclass, field
from typing import Any, Mapping

from torch import nn

from paradiff.errors import PlanError
from paradiff.runtime.patches import set_attribute
from paradiff.tensor_parallel.heads import HeadSplit, width_piece
from paradiff.tensor_parallel.styles import ShardSpec, Style, resolve_style

# Integer attributes of an attention module that count heads or widths derived from them. Under TP each rank holds
# its whole heads (tensor_parallel/heads.py), and diffusers' processors reshape either by a fixed head_dim (-1
# absorbs the head count), by `attn.heads`, or by `attn.inner_dim // attn.heads` (Qwen-Image), or split a fused
# projection by the ratio inner_dim : mlp_hidden_dim (FLUX.2 single blocks). Setting each to this rank's part of
# it, split exactly as the projections' widths are, keeps every one of those right.
DEFAULT_HEAD_ATTRS = ("heads", "inner_dim", "mlp_hidden_dim", "kv_inner_dim", "kv_heads")


@dataclass(frozen=True)
class AttentionHeads:
    """The head counters of an attention module that does not follow diffusers' conventions (e.g. `transformers`'
    attention classes), so each rank can set them to its local counts.

    `query_heads` / `kv_heads` are the full model's counts. Attributes in `per_query_head` scale with the query heads
    (`num_heads`, `inner_dim`), those in `per_kv_head` with the K/V heads (`num_key_value_heads`), and those in
    `groups` count query heads per K/V head (`num_key_value_groups`, which changes when K/V heads are replicated).
    """

    query_heads: int
    kv_heads: int | None = None
    per_query_head: tuple[str, ...] = ()
    per_kv_head: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()

    def local_values(self, module: nn.Module, name: str, heads: HeadSplit, rank: int) -> dict[str, int]:
        query, kv = self.query_heads, self.kv_heads or self.query_heads
        local_query, local_kv = heads.query[rank][1], heads.kv[rank][1]
        values: dict[str, int] = {}
        for attrs, local, full in ((self.per_query_head, local_query, query), (self.per_kv_head, local_kv, kv)):
            for attr in attrs:
                values[attr] = _count(module, name, attr) * local // full
        for attr in self.groups:
            _count(module, name, attr)
            values[attr] = local_query // local_kv
        return values

    def split(self, module: nn.Module, size: int, where: str) -> HeadSplit:
        kv = self.kv_heads or self.query_heads
        head_dim = getattr(module, "head_dim", None)
        counted = {attrs: tuple(getattr(module, attr, 0) for attr in attrs if _is_int(getattr(module, attr, None)))
                   for attrs in (self.per_query_head, self.per_kv_head)}
        return HeadSplit.of(self.query_heads, kv, size, head_dim if _is_int(head_dim) else None,
                            query_widths=counted[self.per_query_head], kv_widths=counted[self.per_kv_head],
                            where=where)


def _count(module: nn.Module, name: str, attr: str) -> int:
    value = getattr(module, attr, None)
    if not isinstance(value, int) or isinstance(value, bool):
        raise PlanError(
            f"{name} ({type(module).__name__}) has no integer attribute {attr!r} (got {value!r}); the plan's "
            "AttentionHeads names attributes this class does not have (a different library version?)."
        )
    return value


@dataclass
class TensorParallelPlan:
    """How one model family splits: `styles` maps module globs to styles; `head_attrs` are rescaled on attention."""

    styles: Mapping[str, str | Style]
    head_attrs: tuple[str, ...] = DEFAULT_HEAD_ATTRS
    heads_config_key: str = "num_attention_heads"
    # globs of attention modules without a diffusers `processor` (hand-written attention, e.g. ConsisID's perceiver
    # cross-attention) whose head attributes shrink like a processor module's
    head_modules: tuple[str, ...] = ()
    # module glob -> {output index: dim}: per-head tensors a module computes for all heads (Mochi's rotary table
    # has a frequency per head), cut to this rank's contiguous block of heads, the block colwise projections hold
    head_outputs: Mapping[str, Mapping[int, int]] = field(default_factory=dict)
    # module glob ("" the model) -> {forward argument: {item index: dim}} (a tensor argument is item 0, a dict's
    # items are keyed by name): per-head tensors given as inputs for all heads (SANA-WM refiner's rotary tables,
    # AnyFlow FAR's KV cache), cut to this rank's block of heads (views: in-place writes reach the caller's tensor)
    head_inputs: Mapping[str, Mapping[str, Mapping[int | str, int]]] = field(default_factory=dict)
    # module glob -> {output index: dim}: outputs left split by heads that the model reads whole (EasyAnimate's
    # shared-weight blocks add the text's attention output unprojected), all-gathered over the TP group
    gather_heads: Mapping[str, Mapping[int, int]] = field(default_factory=dict)
    # module glob -> AttentionHeads: attention modules (e.g. transformers') whose head counters are not diffusers'
    attention: Mapping[str, AttentionHeads] = field(default_factory=dict)
    # module globs whose output is a partial sum over the TP ranks, all-reduced: an expert bank whose 3-D weights
    # are split like a colwise / rowwise pair (SplitParameter), which holds no Linear to reduce
    reduce_outputs: tuple[str, ...] = ()
    # module glob -> function of (module, None) returning the callable that replaces its forward once its heads are
    # local: hand-written attention that reshapes by its input's full width (SANA-WM). Without context parallelism
    # only; the context-parallel plan's `forwards` replace these where both name a module.
    forwards: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class ResolvedLinear:
    name: str
    style: Style
    specs: dict[str, ShardSpec | None]
    full_shapes: dict[str, tuple[int, ...]]
    features: int | None = None  # a norm's normalised width (norm styles only)
    # an nn.Embedding: "colwise" splits its embedding dim, "vocab" its rows
    embedding: bool = False
    gather_sizes: tuple[int, ...] = ()  # every rank's output width, for outputs that are all-gathered (vocab heads)
    # a norm's K heads held by several ranks (fewer K/V heads than ranks): how many ranks hold this rank's part
    replicas: int = 1
    # every rank's specs, in rank order (saving gathers the shards back into full tensors with them)
    rank_specs: dict[str, tuple[ShardSpec | None, ...]] = field(default_factory=dict)


@dataclass
class ResolvedPlan:
    linears: dict[str, ResolvedLinear] = field(default_factory=dict)
    attention_modules: list[str] = field(default_factory=list)
    head_attrs: tuple[str, ...] = DEFAULT_HEAD_ATTRS
    head_outputs: dict[str, dict[int, int]] = field(default_factory=dict)
    head_inputs: dict[str, dict[str, dict[int | str, int]]] = field(default_factory=dict)
    gather_heads: dict[str, dict[int, int]] = field(default_factory=dict)
    reduce_outputs: list[str] = field(default_factory=list)
    local_head_counts: dict[str, dict[str, int]] = field(default_factory=dict)  # module -> attribute -> local value
    # module -> its heads over the ranks, for the per-head tensors of head_outputs / head_inputs / gather_heads
    head_splits: dict[str, HeadSplit | None] = field(default_factory=dict)
    forwards: dict[str, Any] = field(default_factory=dict)

    def spec_for(self, param_name: str) -> ShardSpec | None:
        module_name, _, leaf = param_name.rpartition(".")
        linear = self.linears.get(module_name)
        return None if linear is None else linear.specs.get(leaf)


def as_plan(plan: Any) -> TensorParallelPlan:
    if isinstance(plan, TensorParallelPlan):
        return plan
    if isinstance(plan, Mapping):
        return TensorParallelPlan(styles=dict(plan))
    raise PlanError(f"plan must be a dict of module glob -> style or a TensorParallelPlan, got {type(plan).__name__}.")


def expand_key(model: nn.Module, key: str) -> list[str]:
    """Module paths matched by one plan key. Each `*` stands for every index of an nn.ModuleList (or the keys of an
    nn.ModuleDict), e.g. 'blocks.*.ff.experts.*.w1' for the experts of every block."""
    if not isinstance(key, str):
        raise PlanError(f"Plan keys must be strings, got {key!r} ({type(key).__name__}).")
    if "*" not in key:
        return [key]
    parts = key.split(".")
    if any("*" in part and part != "*" for part in parts) or parts[0] == "*":
        raise PlanError(
            f"Plan key {key!r}: '*' must stand for a whole path component (a list index), as in "
            "'blocks.*.attn.to_q'; partial patterns such as 'blocks*' or 'to_*' are not supported."
        )
    names = [""]
    for part in parts:
        if part != "*":
            names = [f"{name}.{part}" if name else part for name in names]
            continue
        expanded = []
        for name in names:
            try:
                container = model.get_submodule(name)
            except AttributeError as exc:
                raise PlanError(
                    f"Plan key {key!r}: {name!r} is not a submodule of {type(model).__name__}; its nn.ModuleLists "
                    f"are {module_lists(model)}."
                ) from exc
            if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
                raise PlanError(
                    f"Plan key {key!r}: the part before '*' ({name!r}) must be an nn.ModuleList, but it is "
                    f"{type(container).__name__}; the nn.ModuleLists of {type(model).__name__} are "
                    f"{module_lists(model)}."
                )
            expanded.extend(f"{name}.{child}" for child, _ in container.named_children())
        names = expanded
    return names


def module_lists(model: nn.Module, limit: int = 12) -> list[str]:
    """Paths of the nn.ModuleLists a '*' may stand over; indices of enclosing lists shown as '*', deduplicated."""
    found: list[str] = []
    for name, module in model.named_modules():
        if name and isinstance(module, nn.ModuleList):
            pattern = ".".join("*" if part.isdigit() else part for part in name.split("."))
            if pattern not in found:
                found.append(pattern)
    return found[:limit]


def _missing_module_hint(model: nn.Module, name: str) -> str:
    """Name the deepest existing ancestor of `name` and its children, so a typo is easy to spot."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        parent_name = ".".join(parts[:cut])
        try:
            parent = model.get_submodule(parent_name)
        except AttributeError:
            continue
        children = [child for child, _ in parent.named_children()]
        where = repr(parent_name) if parent_name else type(model).__name__
        return f"{where} has children {children}"
    return ""


def resolve_plan(model: nn.Module, plan: TensorParallelPlan, rank: int, size: int) -> ResolvedPlan:
    """Check the plan against the model and compute every planned parameter's shard for `rank` of `size`."""
    config = getattr(model, "config", None)
    check_heads(model, plan, size)
    resolved = ResolvedPlan(head_attrs=plan.head_attrs)
    owners = _HeadOwners(model, plan, size)
    # head counts first: their errors name the valid degrees for the whole attention, not one projection's
    for name, heads in owners.entries.items():
        module = model.get_submodule(name)
        resolved.local_head_counts[name] = heads.local_values(module, name, owners.split_of(name), rank)
    matched_by: dict[str, str] = {}
    for key, raw_style in plan.styles.items():
        style = resolve_style(raw_style, key)
        for name in expand_key(model, key):
            if style.target == "parameter":
                _resolve_parameter(model, resolved, style, name, key, rank, size, owners)
                continue
            module = _planned_submodule(model, name, "key", key)
            _check_target(module, style, name, key)
            if name in matched_by:
                raise PlanError(
                    f"{name!r} is matched by two plan keys, {matched_by[name]!r} and {key!r}; each module may have "
                    "one style only. Remove one of the keys."
                )
            matched_by[name] = key
            shapes = {leaf: tuple(getattr(module, leaf).shape) for leaf in ("weight", "bias")
                      if getattr(module, leaf, None) is not None}
            features = norm_features(module) if style.target == "norm" else None
            embedding = isinstance(module, nn.Embedding)
            heads = owners.heads_of(name)

            def specs_for(r: int) -> dict[str, ShardSpec | None]:
                if embedding and style.kind == "colwise":
                    return {"weight": _embedding_columns(style, shapes["weight"], r, size, config, name, heads)}
                specs = {param: style.shard_spec(param, shape, r, size, config, name, heads)
                         for param, shape in shapes.items()}
                if features is not None and "weight" not in specs:  # a norm without affine weight still splits
                    specs["weight"] = style.shard_spec("weight", (features,), r, size, config, name, heads)
                return specs

            every_rank = [specs_for(r) for r in range(size)]
            specs = every_rank[rank]
            gather, replicas = (), 1
            if style.kind == "vocab" and not embedding:
                gather = tuple(style.shard_spec("weight", shapes["weight"], r, size, config, name).local_shape(
                    shapes["weight"])[0] for r in range(size))
            if style.target == "norm":  # replicated K heads: the norm's statistic counts each once
                replicas = sum(other["weight"] == specs["weight"] for other in every_rank)
            if style.kind in ("rowwise", "rowwise_split_input"):
                _check_disjoint(name, [other["weight"] for other in every_rank])
            resolved.linears[name] = ResolvedLinear(
                name=name, style=style, specs=specs, full_shapes=shapes, features=features, embedding=embedding,
                gather_sizes=gather, replicas=replicas,
                rank_specs={leaf: tuple(other[leaf] for other in every_rank) for leaf in specs})
    resolved.attention_modules = _attention_modules(model, resolved)
    for name in owners.head_modules:
        if name not in resolved.attention_modules:
            resolved.attention_modules.append(name)
    for name in resolved.attention_modules:
        values = _local_head_attrs(model.get_submodule(name), name, plan.head_attrs, owners.split_of(name), rank,
                                   size)
        resolved.local_head_counts[name] = {**values, **resolved.local_head_counts.get(name, {})}
    for what in ("head_outputs", "gather_heads", "head_inputs"):
        for key, outputs in getattr(plan, what).items():
            for name in expand_key(model, key) if key else [""]:
                module = _planned_submodule(model, name, f"{what} entry", key)
                if what == "head_inputs":
                    taken = list(inspect.signature(module.forward).parameters)
                    missing = [argument for argument in outputs if argument not in taken]
                    if missing:
                        raise PlanError(f"Plan head_inputs entry {key!r} names arguments {missing} of "
                                        f"{name or type(model).__name__}, whose forward takes {taken}.")
                getattr(resolved, what)[name] = dict(outputs)
                resolved.head_splits[name] = owners.heads_of(name) if name else owners.model_heads
    for key, factory in plan.forwards.items():
        for name in expand_key(model, key):
            _planned_submodule(model, name, "forwards entry", key)
            if not callable(factory):
                raise PlanError(f"Plan forwards entry {key!r} must be a function of (module, runtime), got "
                                f"{type(factory).__name__}.")
            resolved.forwards[name] = factory
    for key in plan.reduce_outputs:
        for name in expand_key(model, key):
            _planned_submodule(model, name, "reduce_outputs entry", key)
            resolved.reduce_outputs.append(name)
    return resolved


def _check_disjoint(name: str, specs: list[ShardSpec]) -> None:
    """Partial sums are all-reduced: ranks must hold disjoint input features, or a feature is counted twice."""
    held = sorted((start, start + length) for spec in specs for start, length in spec.pieces)
    for (_, end), (start, _) in zip(held, held[1:]):
        if start < end:
            raise PlanError(f"{name}: its rowwise input features overlap between ranks ({held}), so their partial "
                            "sums would count some twice; split it by features or leave it whole.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first_int(obj: Any, attrs: tuple[str, ...]) -> int | None:
    for attr in attrs:
        value = _safe_attr(obj, attr)
        if _is_int(value) and value > 0:
            return value
    return None


def _safe_attr(obj: Any, attr: str) -> Any:
    """getattr that also survives configs refusing a global read of a per-layer value (transformers' Gemma 4)."""
    try:
        return getattr(obj, attr, None)
    except Exception:  # noqa: BLE001 - such a value is not one count for the whole model
        return None


QUERY_HEAD_ATTRS = ("heads", "num_heads", "n_heads", "num_attention_heads")


class _HeadOwners:
    """For every planned module, the heads of the attention module it belongs to (the nearest enclosing module with
    a diffusers `processor`, a plan `head_modules` entry or a plan `attention` entry), or the model's heads from its
    config for modules outside any attention (per-head parameters, feed-forwards)."""

    def __init__(self, model: nn.Module, plan: TensorParallelPlan, size: int) -> None:
        self.model, self.plan, self.size = model, plan, size
        self.entries: dict[str, AttentionHeads] = {}
        for key, heads in plan.attention.items():
            if not isinstance(heads, AttentionHeads):
                raise PlanError(f"Plan attention entry {key!r} must be an AttentionHeads, got {type(heads).__name__}.")
            for name in expand_key(model, key):
                _planned_submodule(model, name, "attention key", key)
                self.entries[name] = heads
        self.head_modules: list[str] = []
        for key in plan.head_modules:
            for name in expand_key(model, key):
                _planned_submodule(model, name, "head_modules entry", key)
                self.head_modules.append(name)
        self.model_heads = _model_heads(model, plan, size)
        self._splits: dict[str, HeadSplit | None] = {}

    def owner(self, name: str) -> str | None:
        parts = name.split(".") if name else []
        for cut in range(len(parts), 0, -1):
            candidate = ".".join(parts[:cut])
            if candidate in self.entries or candidate in self.head_modules:
                return candidate
            if hasattr(self.model.get_submodule(candidate), "processor"):
                return candidate
        return None

    def heads_of(self, name: str) -> HeadSplit | None:
        owner = self.owner(name)
        return self.model_heads if owner is None else self.split_of(owner)

    def split_of(self, owner: str) -> HeadSplit | None:
        if owner not in self._splits:
            module = self.model.get_submodule(owner)
            entry = self.entries.get(owner)
            if entry is not None:
                self._splits[owner] = entry.split(module, self.size, owner)
            elif _first_int(module, QUERY_HEAD_ATTRS) is None:  # a head module counting no heads (SANA-WM's
                # short convolutions): the heads of the attention around it, else the model's
                self._splits[owner] = self.heads_of(owner.rpartition(".")[0]) if "." in owner else self.model_heads
            else:
                self._splits[owner] = _module_heads(module, owner, self.model_heads, self.size)
        return self._splits[owner]


def _model_heads(model: nn.Module, plan: TensorParallelPlan, size: int) -> HeadSplit | None:
    config = getattr(model, "config", None)
    query = _safe_attr(config, plan.heads_config_key)
    if not _is_int(query) or query <= 0:
        return None
    kv = _first_int(config, KV_HEAD_ATTRS)
    kv = kv if kv is not None and query % kv == 0 else query
    head_dim = _first_int(config, ("attention_head_dim", "head_dim", "d_kv"))
    hidden = _first_int(config, ("hidden_size", "d_model"))
    if head_dim is None and hidden is not None and hidden % query == 0:  # BERT-style: the hidden width is the heads'
        head_dim = hidden // query
    return HeadSplit.of(query, kv, size, head_dim, where=type(model).__name__, counts_kv=False)


def _module_heads(module: nn.Module, name: str, model_heads: HeadSplit | None, size: int) -> HeadSplit | None:
    """The heads of a diffusers-style attention module (or a hand-written one named by `head_modules`), read from
    its counters: `heads` (or `num_heads`), `inner_dim` / `head_dim`, and its K/V heads (`kv_heads` or
    `inner_kv_dim // head_dim`)."""
    query = _first_int(module, QUERY_HEAD_ATTRS)
    if query is None:
        return model_heads
    inner = _first_int(module, ("inner_dim",))
    head_dim = _first_int(module, ("head_dim",))
    if head_dim is None and inner is not None and inner % query == 0:
        head_dim = inner // query
    inner_kv = _first_int(module, ("inner_kv_dim",))  # diffusers' Attention: dim_head * kv_heads
    kv = _first_int(module, KV_HEAD_ATTRS)
    if kv is None and inner_kv is not None and head_dim and inner_kv % head_dim == 0:
        kv = inner_kv // head_dim
    if kv is None or query % kv:
        kv = query
    # `kv_inner_dim` (Wan's cross attention): K/V of another head width, one per query head
    widths = [inner or 0, _first_int(module, ("kv_inner_dim",)) or 0]
    if head_dim is None:  # a hand-written attention counting only its heads: its projections' widths are per head
        widths += [sub.out_features for sub in module.modules() if isinstance(sub, nn.Linear)]
    return HeadSplit.of(query, kv, size, head_dim, query_widths=tuple(widths), kv_widths=(inner_kv or 0,), where=name)


def _local_head_attrs(module: nn.Module, name: str, attrs: tuple[str, ...], heads: HeadSplit | None, rank: int,
                      size: int) -> dict[str, int]:
    """This rank's value of each head counter: its part of the counted width, split as the projections are."""
    values = {}
    for attr in attrs:
        value = getattr(module, attr, None)
        if _is_int(value):
            start, length = width_piece(value, rank, size, heads)
            if length == 0:
                raise PlanError(f"{name}.{attr}={value} cannot give each of tp_degree={size} ranks a part; choose a "
                                f"tp_degree of at most {value}.")
            values[attr] = length
    return values


def _planned_submodule(model: nn.Module, name: str, entry: str, key: str) -> nn.Module:
    """The submodule `name` a plan entry (`entry` `key`) expands to, or a PlanError saying what the model has."""
    try:
        return model.get_submodule(name)
    except AttributeError as exc:
        raise PlanError(f"Plan {entry} {key!r} names {name!r}, which is not a submodule of {type(model).__name__}; "
                        f"{_missing_module_hint(model, name)}.") from exc


def _resolve_parameter(model: nn.Module, resolved: ResolvedPlan, style: Style, name: str, key: str, rank: int,
                       size: int, owners: _HeadOwners) -> None:
    """A planned bare parameter: recorded under its module's name, so the loader and saver slice it like a weight."""
    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError as exc:
        raise PlanError(f"Plan key {key!r} names {name!r}, whose module is not a submodule of "
                        f"{type(model).__name__}; {_missing_module_hint(model, module_name)}.") from exc
    param = module._parameters.get(leaf)
    if param is None:
        raise PlanError(
            f"Plan entry {name!r} (key {key!r}) has style {type(style).__name__}, which splits a parameter, but "
            f"{module_name or type(model).__name__} has no parameter {leaf!r}; its own parameters are "
            f"{list(module._parameters)}."
        )
    shape = tuple(param.shape)
    every_rank = tuple(style.shard_spec(leaf, shape, r, size, getattr(model, "config", None), name,
                                        owners.heads_of(module_name)) for r in range(size))
    spec = every_rank[rank]
    planned = resolved.linears.get(module_name)
    if planned is not None and planned.style.target == "parameter":  # an expert bank: several 3-D weights
        planned.specs[leaf], planned.full_shapes[leaf], planned.rank_specs[leaf] = spec, shape, every_rank
        return
    if module_name in resolved.linears:
        raise PlanError(f"{name!r} (key {key!r}): its module {module_name!r} already has a planned style; a module "
                        "may carry planned parameters or one module style.")
    resolved.linears[module_name] = ResolvedLinear(name=module_name, style=style, specs={leaf: spec},
                                                   full_shapes={leaf: shape}, rank_specs={leaf: every_rank})


def _embedding_columns(style: Style, shape: tuple[int, ...], rank: int, size: int, config, name: str,
                       heads: HeadSplit | None) -> ShardSpec:
    """An embedding table is a Linear applied to one-hot ids, so its output features are dim 1 of the weight."""
    spec = style.shard_spec("weight", (shape[1], shape[0]), rank, size, config, name, heads)
    return ShardSpec(dim=1, pieces=spec.pieces)


def norm_features(module: nn.Module) -> int:
    """The normalised width of a norm module (torch's `normalized_shape`, diffusers' `dim`, or its weight)."""
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        return int(shape[-1] if isinstance(shape, (tuple, list)) else shape)
    weight = getattr(module, "weight", None)
    if weight is not None:
        return int(weight.shape[-1])
    dim = getattr(module, "dim", None)
    if isinstance(dim, (tuple, list)):
        dim = dim[-1]
    if isinstance(dim, int):
        return dim
    raise PlanError(f"Cannot tell the normalised width of {type(module).__name__}; it has no weight, "
                    "normalized_shape or dim.")


def _check_target(module: nn.Module, style, name: str, key: str) -> None:
    from paradiff.tensor_parallel.layers import CONV_TYPES, is_depthwise, is_norm

    if style.target == "norm":
        if not is_norm(module):
            raise PlanError(
                f"Plan entry {name!r} (key {key!r}) has style {style.kind!r}, which splits an RMSNorm or LayerNorm "
                f"over the heads, but it is {type(module).__name__}."
            )
        return
    if isinstance(module, CONV_TYPES):
        if module.padding_mode != "zeros":
            raise PlanError(f"Plan entry {name!r} (key {key!r}): a split convolution must pad with zeros, but it "
                            f"pads with {module.padding_mode!r}.")
        if module.groups > 1 and not (style.kind == "colwise" and is_depthwise(module)):
            raise PlanError(
                f"Plan entry {name!r} (key {key!r}) has style {style.kind!r}, but it is a grouped convolution "
                f"(groups={module.groups}); only a depthwise convolution (groups = channels) splits, colwise."
            )
        return
    if isinstance(module, nn.Embedding):
        if style.kind not in ("colwise", "vocab"):
            raise PlanError(
                f"Plan entry {name!r} (key {key!r}) is an nn.Embedding; embeddings take 'colwise' (split the "
                f"embedding dim) or 'vocab' (split the rows), not {style.kind!r}."
            )
        return
    if not isinstance(module, nn.Linear):
        linears = [child for child, sub in module.named_modules() if child and isinstance(sub, nn.Linear)]
        raise PlanError(
            f"Plan entry {name!r} (key {key!r}) must be an nn.Linear (or a convolution or an nn.Embedding) to be "
            f"split, but it is "
            f"{type(module).__name__}; the nn.Linear modules inside it are {linears[:12]}."
        )


def check_heads(model: nn.Module, plan: TensorParallelPlan, size: int) -> None:
    """Any head count splits (each rank holds floor or ceil of heads/tp whole heads), but every rank needs one."""
    config = getattr(model, "config", None)
    heads = None if config is None else _safe_attr(config, plan.heads_config_key)
    if _is_int(heads) and 0 < heads < size:
        raise PlanError(
            f"tp_degree={size} is larger than the attention head count {plan.heads_config_key}={heads} of "
            f"{type(model).__name__}: tensor parallelism splits whole heads, so every rank needs at least one; "
            f"valid tp degrees: 1 to {heads} (context parallelism splits the tokens instead, for any head count)."
        )


def _attention_modules(model: nn.Module, resolved: ResolvedPlan) -> list[str]:
    """Attention modules (those with a `processor`) that own a colwise-split projection: their head counts shrink."""
    found: list[str] = []
    for name, linear in resolved.linears.items():
        if linear.style.kind != "colwise":
            continue
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            parent_name = ".".join(parts[:cut])
            if hasattr(model.get_submodule(parent_name), "processor"):
                if parent_name not in found:
                    found.append(parent_name)
                break
    return found


# Attributes counting grouped K/V heads (a model config's or an attention module's).
KV_HEAD_ATTRS = ("kv_heads", "num_key_value_heads", "num_kv_heads")


def localise_heads(model: nn.Module, resolved: ResolvedPlan) -> None:
    for name, values in resolved.local_head_counts.items():
        module = model.get_submodule(name)
        for attr, value in values.items():
            set_attribute(module, attr, value, by="tp")


def check_checkpoint_keys(resolved: ResolvedPlan, checkpoint_keys: set[str], shapes: Mapping[str, tuple]) -> None:
    """Every planned parameter must exist in the checkpoint with the model's shape."""
    for name, linear in resolved.linears.items():
        for param, shape in linear.full_shapes.items():
            key = f"{name}.{param}"
            if key not in checkpoint_keys:
                raise PlanError(
                    f"Planned parameter {key!r} (shape {shape}) is not in the checkpoint; the checkpoint and the "
                    "model config disagree, or the plan names a module the checkpoint does not have."
                )
            if tuple(shapes[key]) != tuple(shape):
                raise PlanError(
                    f"Planned parameter {key!r} has shape {tuple(shapes[key])} in the checkpoint but {shape} in the model."
                )
