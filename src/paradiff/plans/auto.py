"""Plans derived from a model's structure, for transformers paradiff has no built-in plan for (`plan="auto"`).

The rules follow diffusers' naming conventions, so they hold across families (docs/tensor-parallel.md, "Automatic plans"):

Tensor parallelism, inside the block stacks (the model's top-level nn.ModuleLists):
- an attention module (one with a `processor`) splits by heads: `to_q/to_k/to_v` and `add_q_proj/add_k_proj/
  add_v_proj` colwise (K/V with fewer heads than Q: ColwiseHeads), fused `to_qkv` / `to_added_qkv` as three packed
  blocks, `to_out.0` (or a Linear `to_out`) and `to_add_out` rowwise; a Q/K norm as wide as its projection
  normalises all heads and is split with them;
- a feed-forward splits its hidden width: diffusers' FeedForward (`net.0.proj` colwise, packed in two for GEGLU /
  SwiGLU, `net.2` rowwise) and two-Linear MLPs named (fc1, fc2), (linear_1, linear_2), (linear_in, linear_out),
  (proj_in, proj_out), or SwiGLU triples (w1, w3 colwise; w2 rowwise);
- AdaLN modulation Linears (inside modules named `*AdaLayerNorm*` / `*Modulation*`, or `*_mod.1`) read the replicated
  conditioning: rowwise_split_input.

Context parallelism:
- the tokens are split where the first block stack starts (`hidden_states` of its block 0, and
  `encoder_hidden_states` too when its attention is joint, i.e. has `add_q_proj`), and gathered after the last
  top-level Linear (the output projection);
- every other tensor argument of a block (rotary tables, per-token timestep embeddings) is split along the
  dimension whose length is the full token count, and stays whole when it has none;
- cross-attention (`attn2`, or `is_cross_attention`) runs locally on the replicated context.
"""

from __future__ import annotations

from torch import nn

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.errors import PlanError
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import ColwiseHeads, PackedColwise, Style

MLP_PAIRS = (("fc1", "fc2"), ("linear_1", "linear_2"), ("linear_in", "linear_out"), ("proj_in", "proj_out"))


def _linear(module: nn.Module, name: str) -> nn.Linear | None:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Linear) else None


def _stack_patterns(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(glob over the stack, one block) for every top-level ModuleList; blocks of one stack share a structure."""
    return [(f"{name}.*", child[0]) for name, child in model.named_children()
            if isinstance(child, nn.ModuleList) and len(child)]


def _attention_styles(attention: nn.Module, prefix: str) -> dict[str, str | Style]:
    styles: dict[str, str | Style] = {}
    heads = getattr(attention, "heads", None)
    query = _linear(attention, "to_q")
    head_dim = query.out_features // heads if (query is not None and isinstance(heads, int) and heads) else None
    for side, names in (("", ("to_q", "to_k", "to_v")), ("add", ("add_q_proj", "add_k_proj", "add_v_proj"))):
        for name in names:
            linear = _linear(attention, name)
            if linear is None:
                continue
            fewer_heads = query is not None and head_dim and linear.out_features < query.out_features
            styles[f"{prefix}.{name}"] = ColwiseHeads(head_dim) if fewer_heads else "colwise"
    for fused in ("to_qkv", "to_added_qkv"):
        linear = _linear(attention, fused)
        if linear is not None and linear.out_features % 3 == 0:
            styles[f"{prefix}.{fused}"] = PackedColwise([1, 1, 1])
    out = getattr(attention, "to_out", None)
    if isinstance(out, nn.Linear):
        styles[f"{prefix}.to_out"] = "rowwise"
    elif isinstance(out, (nn.ModuleList, nn.Sequential)) and len(out) and isinstance(out[0], nn.Linear):
        styles[f"{prefix}.to_out.0"] = "rowwise"
    if _linear(attention, "to_add_out") is not None:
        styles[f"{prefix}.to_add_out"] = "rowwise"
    for norm_name, projection in (("norm_q", "to_q"), ("norm_k", "to_k"), ("norm_added_q", "add_q_proj"),
                                  ("norm_added_k", "add_k_proj")):
        norm, linear = getattr(attention, norm_name, None), _linear(attention, projection)
        width = _norm_width(norm)
        if linear is not None and width is not None and width == linear.out_features and width != head_dim:
            styles[f"{prefix}.{norm_name}"] = "norm_across_heads"
    split_in = any(style != "rowwise" and not key.rsplit(".", 1)[-1].startswith("norm") for key, style in styles.items())
    if not split_in or not any(style == "rowwise" for style in styles.values()):
        return {}  # an unknown projection in, or no output projection to close the split: leave the attention whole
    return styles


def _norm_width(norm: nn.Module | None) -> int | None:
    if norm is None:
        return None
    from paradiff.tensor_parallel.layers import is_norm
    from paradiff.tensor_parallel.plan import norm_features

    if not is_norm(norm):
        return None
    try:
        return norm_features(norm)
    except PlanError:
        return None


def _feed_forward_styles(module: nn.Module, prefix: str) -> dict[str, str | Style]:
    net = getattr(module, "net", None)
    if isinstance(net, nn.ModuleList) and len(net) >= 2 and isinstance(net[-1], nn.Linear):
        first = getattr(net[0], "proj", None)
        if isinstance(first, nn.Linear):
            gated = first.out_features == 2 * net[-1].in_features
            if gated or first.out_features == net[-1].in_features:
                return {f"{prefix}.net.0.proj": PackedColwise([1, 1]) if gated else "colwise",
                        f"{prefix}.net.{len(net) - 1}": "rowwise"}
    for first_name, second_name in MLP_PAIRS:
        first, second = _linear(module, first_name), _linear(module, second_name)
        if first is None or second is None or len([c for c in module.children() if isinstance(c, nn.Linear)]) != 2:
            continue
        if first.out_features == second.in_features:
            return {f"{prefix}.{first_name}": "colwise", f"{prefix}.{second_name}": "rowwise"}
        if first.out_features == 2 * second.in_features:
            return {f"{prefix}.{first_name}": PackedColwise([1, 1]), f"{prefix}.{second_name}": "rowwise"}
    w1, w2, w3 = (_linear(module, n) for n in ("w1", "w2", "w3"))
    if w1 is not None and w2 is not None and w3 is not None and w1.out_features == w3.out_features == w2.in_features:
        return {f"{prefix}.w1": "colwise", f"{prefix}.w3": "colwise", f"{prefix}.w2": "rowwise"}
    return {}


def _is_modulation(owner_name: str, owner: nn.Module) -> bool:
    kind = type(owner).__name__.lower()
    return "adalayernorm" in kind or "modulation" in kind or owner_name.rsplit(".", 1)[-1].endswith("_mod")


def _block_styles(block: nn.Module) -> dict[str, str | Style]:
    """The styles of one block, by path inside it."""
    styles: dict[str, str | Style] = {}
    claimed: set[str] = set()
    for name, module in block.named_modules():
        if any(name == c or name.startswith(c + ".") for c in claimed):
            continue
        found = _attention_styles(module, name) if hasattr(module, "processor") else _feed_forward_styles(module, name)
        if found:
            styles.update({key.lstrip("."): style for key, style in found.items()})
            claimed.add(name)
    for name, module in block.named_modules():
        if not isinstance(module, nn.Linear) or any(name == c or name.startswith(c + ".") for c in claimed):
            continue
        owner_name = name.rpartition(".")[0]
        if owner_name and _is_modulation(owner_name, block.get_submodule(owner_name)):
            styles[name] = "rowwise_split_input"
    return styles


def auto_tensor_plan(model: nn.Module) -> TensorParallelPlan:
    styles: dict[str, str | Style] = {}
    for stack_name, stack in model.named_children():
        if not isinstance(stack, nn.ModuleList) or not len(stack):
            continue
        # blocks of one stack usually share a structure ("stack.*"); where one differs (SD3's last block has no
        # text output projection) its own entries are named by index
        per_block = [_block_styles(block) for block in stack]
        common = {key: style for key, style in per_block[0].items()
                  if all(other.get(key) == style for other in per_block[1:])}
        styles.update({f"{stack_name}.*.{key}": style for key, style in common.items()})
        for index, block_styles in enumerate(per_block):
            styles.update({f"{stack_name}.{index}.{key}": style for key, style in block_styles.items()
                           if key not in common})
    if not styles:
        raise PlanError(
            f"The automatic planner found nothing to split in {type(model).__name__}: no attention modules with "
            "to_q/to_k/to_v/to_out and no feed-forwards inside its top-level nn.ModuleLists. Write a plan by hand "
            "(docs/tensor-parallel.md, 'Writing a plan')."
        )
    return TensorParallelPlan(styles=styles)


def _is_cross_attention(name: str, module: nn.Module) -> bool:
    return bool(getattr(module, "is_cross_attention", False)) or name.rsplit(".", 1)[-1] == "attn2"


def auto_context_plan(model: nn.Module) -> ContextParallelPlan:
    stacks = _stack_patterns(model)
    if not stacks:
        raise PlanError(f"The automatic planner found no block stack (top-level nn.ModuleList) in "
                        f"{type(model).__name__}; write a ContextParallelPlan by hand.")
    first_pattern, first_block = stacks[0]
    first = first_pattern.replace("*", "0")
    import inspect

    parameters = inspect.signature(first_block.forward).parameters
    if "hidden_states" not in parameters:
        raise PlanError(f"{type(first_block).__name__}.forward takes no `hidden_states`; the automatic planner "
                        "cannot tell where the tokens enter. Write a ContextParallelPlan by hand.")
    joint = any(hasattr(m, "add_q_proj") and getattr(m, "add_q_proj") is not None
                for m in first_block.modules() if hasattr(m, "processor"))
    split = {"hidden_states": Split(1)}
    if joint and "encoder_hidden_states" in parameters:
        split["encoder_hidden_states"] = Split(1)
    rotary = {}
    for pattern, block in stacks:
        # the replicated context of cross-attention (and its mask) is never split, whatever its length
        names = [n for n, p in inspect.signature(block.forward).parameters.items()
                 if n not in ("hidden_states", "encoder_hidden_states") and (joint or "encoder" not in n)
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if names:
            rotary[pattern] = tuple(names)
    outputs = [name for name, child in model.named_children() if isinstance(child, nn.Linear)]
    if not outputs:
        raise PlanError(f"The automatic planner found no top-level output Linear in {type(model).__name__} to "
                        "gather the tokens after; write a ContextParallelPlan by hand.")
    local = tuple(sorted({
        f"{pattern}.{name}" for pattern, block in stacks for name, module in block.named_modules()
        if hasattr(module, "processor") and _is_cross_attention(name, module)
    }))
    return ContextParallelPlan(split_inputs={first: split}, gather_outputs={outputs[-1]: 1},
                               local_attention=local, split_token_arguments=rotary)


def auto_plan(model: nn.Module, kind: str):
    return auto_tensor_plan(model) if kind == "tensor" else auto_context_plan(model)


def plan_source(plan, kind: str, model_name: str, config=None) -> str:
    """A plan as a plan module a user can save, edit and pass back.

    A style field the built-in plan computes from the model config (a packing's block sizes, a K/V head_dim) is
    printed as its value for `config`, the config the plan was made for, with a comment saying so; block sizes as
    their smallest proportions, which hold for any config of the same width ratios."""
    import dataclasses
    import math

    def field_text(name: str, value) -> tuple[str, bool]:
        computed = callable(value)
        if computed:
            value = value(config)
        if name == "blocks" and value is not None:
            sizes = [int(size) for size in value]
            unit = math.gcd(*sizes)
            value = [size // unit for size in sizes]
        return repr(value), computed

    def style_text(style) -> str:
        if isinstance(style, str) or not dataclasses.is_dataclass(style):
            return repr(style)
        args, computed = [], False
        for field in dataclasses.fields(style):
            value = getattr(style, field.name)
            if field.default is not dataclasses.MISSING and value == field.default and not callable(value):
                continue
            text, from_config = field_text(field.name, value)
            computed |= from_config
            args.append(text if field.name == "blocks" and not args else f"{field.name}={text}")
        line = f"{type(style).__name__}({', '.join(args)}),"
        return line + ("  # computed from this model's config by the built-in plan" if computed else "")

    lines = [f'"""Plan for {model_name}, printed by `paradiff plans`; edit freely."""', ""]
    if kind == "tensor":
        body = [f"        {key!r}: {style_text(style) if not isinstance(style, str) else repr(style) + ','}"
                for key, style in plan.styles.items()]
        names = sorted({type(style).__name__ for style in plan.styles.values() if not isinstance(style, str)})
        lines += [f"from paradiff import {', '.join(names + ['TensorParallelPlan'])}", "",
                  "", "def tensor_parallel_plan(config) -> TensorParallelPlan:",
                  "    return TensorParallelPlan(", "        styles={"]
        lines += ["    " + line for line in body]
        lines += ["        },"] + _other_fields(plan, skip=("styles",)) + ["    )"]
    else:
        lines += ["from paradiff import ContextParallelPlan, Count, Split, TokenGroups", "", "",
                  "def context_parallel_plan(config) -> ContextParallelPlan:", "    return ContextParallelPlan("]
        lines += _other_fields(plan) + ["    )"]
    return "\n".join(lines) + "\n"


def _other_fields(plan, skip: tuple[str, ...] = ()) -> list[str]:
    """A plan's fields other than their defaults, as keyword arguments; a field holding what source cannot spell
    (functions of the built-in plan, classes paradiff does not export) as a comment naming it."""
    import dataclasses

    import paradiff

    lines = []
    for field in dataclasses.fields(plan):
        if field.name in skip:
            continue
        value = getattr(plan, field.name)
        if value == (field.default if field.default is not dataclasses.MISSING else field.default_factory()):
            continue
        if _printable(value, set(paradiff.__all__)):
            lines.append(f"        {field.name}={value!r},")
        else:
            lines.append(f"        # {field.name}=...: set by the built-in plan ({type(plan).__name__}.{field.name}) "
                         "with functions or classes not printable here")
    return lines


def _printable(value, exported: set[str]) -> bool:
    import dataclasses

    if isinstance(value, (str, int, float, bool, type(None))):
        return True
    if isinstance(value, dict) or hasattr(value, "items"):
        return all(_printable(k, exported) and _printable(v, exported) for k, v in value.items())
    if isinstance(value, (tuple, list, set, frozenset)):
        return all(_printable(item, exported) for item in value)
    if dataclasses.is_dataclass(value) and type(value).__name__ in exported:
        return all(_printable(getattr(value, f.name), exported) for f in dataclasses.fields(value))
    return False
