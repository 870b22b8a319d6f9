"""`paradiff.check_plan`: run a plan on a shrunk model, single-process against parallel, module by module.

It starts its own local CPU processes (gloo), builds the same random-weight model on each, runs the single-process
forward and the parallel forward on the same inputs, and compares every module's output in execution order. A
module whose output a rank holds only in part (a colwise shard, a token chunk) is compared with the matching part
of the single-process output. The first module over the tolerance is where the plan goes wrong.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paradiff.runtime.patches import add_hook
from paradiff.config import mode_name
from paradiff.distributed.spawn import RankFailed, RankTimeout, run_ranks
from paradiff.errors import PlanError
from paradiff.plans.common import Grid

SHRUNK_LAYERS = 2


@dataclass
class ModuleRow:
    name: str
    kind: str
    diff: float | None  # None: not comparable (e.g. the rank holds a piece paradiff cannot place)
    plan: str


@dataclass
class CheckResult:
    model: str
    degrees: dict[str, int]
    rows: list[ModuleRow] = field(default_factory=list)
    output_diff: float = 0.0
    tolerance: float = 1e-5

    @property
    def ok(self) -> bool:
        return self.output_diff <= self.tolerance

    @property
    def first_divergent(self) -> ModuleRow | None:
        return next((row for row in self.rows if row.diff is not None and row.diff > self.tolerance), None)

    def table(self) -> str:
        lines = [f"{'module':<56} {'type':<28} {'max rel diff':>12}  plan"]
        first = self.first_divergent
        for row in self.rows:
            diff = "-" if row.diff is None else f"{row.diff:.2e}"
            mark = "  <-- first divergence" if row is first else ""
            lines.append(f"{row.name[:56]:<56} {row.kind[:28]:<28} {diff:>12}  {row.plan}{mark}")
        degrees = mode_name(self.degrees, order=tuple(self.degrees), separator=" x ")
        verdict = "PASS" if self.ok else "FAIL"
        lines.append(f"{verdict}: {self.model} at {degrees}: output max relative difference {self.output_diff:.2e} "
                     f"(tolerance {self.tolerance:.0e})")
        if first is not None:
            says = f"the plan says: {first.plan}" if first.plan else \
                "the plan names it nowhere (it runs whole on what the modules before it give it)"
            lines.append(f"first module over the tolerance: {first.name} ({first.kind}); {says}")
        return "\n".join(lines)


def load_plan_file(path: str, kind: str):
    """A plan module as `paradiff plans CLASS --auto` prints it: defines tensor_parallel_plan(config) or
    context_parallel_plan(config)."""
    spec = importlib.util.spec_from_file_location(f"paradiff_user_plan_{kind}", path)
    if spec is None or not Path(path).is_file():
        raise PlanError(f"plan file {path!r} does not exist or is not a Python file.")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    attr = f"{kind}_parallel_plan"
    if not hasattr(module, attr):
        raise PlanError(f"plan file {path!r} defines no {attr}(config); `paradiff plans CLASS --auto` prints one.")
    return getattr(module, attr)


@dataclass
class Target:
    """What to build: a diffusers class and its config, and where its example inputs come from."""

    class_name: str
    config: dict
    family: str | None
    example: str | None
    inputs_file: str | None


def resolve_target(model: str, example: str | None = None, inputs_file: str | None = None) -> Target:
    """A class name (its family's tiny example config) or a checkpoint folder (its config, layers cut to 2)."""
    from paradiff.plan_tools import family_examples as ex

    folder = Path(model)
    if folder.is_dir():
        config_file = folder / "config.json"
        if not config_file.is_file():
            config_file = folder / "transformer" / "config.json"
        if not config_file.is_file():
            raise PlanError(f"{model}: no config.json (nor transformer/config.json) in that folder.")
        config = json.loads(config_file.read_text())
        class_name = config.get("_class_name")
        if not class_name:
            raise PlanError(f"{config_file} names no _class_name.")
        config = {k: (min(v, SHRUNK_LAYERS) if _is_layer_count(k, v) else v)
                  for k, v in config.items() if not k.startswith("_")}
    else:
        class_name, config = model, None
    ex.model_class(class_name)  # raises for an unknown class
    found = [(family, name, cls) for family, name, cls in ex.all_examples() if cls == class_name]
    if example is not None:
        found = [item for item in found if item[1] == example]
        if not found:
            raise PlanError(f"no example {example!r} for {class_name}; examples: "
                            f"{[n for _, n, c in ex.all_examples() if c == class_name]}.")
    family, example_name = (found[0][0], found[0][1]) if found else (None, None)
    if config is None:
        if family is None:
            raise PlanError(f"{class_name} has no built-in example; pass a checkpoint folder (its config.json is "
                            "used, layers cut to 2) and --inputs FILE.py defining example_inputs(config, batch, "
                            "grid, generator).")
        config = dict(ex.family_module(family).examples[example_name][1])
    if family is None and inputs_file is None:
        raise PlanError(f"paradiff has no example inputs for {class_name}; pass --inputs FILE.py defining "
                        "example_inputs(config, batch, grid, generator) -> forward kwargs.")
    return Target(class_name, config, family, example_name, inputs_file)


def _is_layer_count(key: str, value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > SHRUNK_LAYERS and (
        key.startswith("num_") and key.endswith("layers") or key in ("depth", "num_blocks"))


def _check_builtin_split(target: Target, tp: int) -> None:
    """Resolve the built-in TP plan for every rank on a meta-device copy: a degree the config already refuses (more
    ranks than heads) is reported before any rank process starts."""
    from paradiff.plan_tools.family_examples import model_class
    from paradiff.plans import builtin_plan
    from paradiff.tensor_parallel.plan import as_plan, resolve_plan

    try:
        with torch.device("meta"):
            model = model_class(target.class_name)(**target.config)
    except Exception:  # noqa: BLE001 - a class that cannot be built on meta: the ranks check it themselves
        return
    plan = as_plan(builtin_plan(model, getattr(model, "config", None), "tensor"))
    for rank in range(tp):
        resolve_plan(model, plan, rank, tp)


def _build(target: Target, seed: int = 0) -> nn.Module:
    from paradiff.plan_tools.family_examples import model_class

    torch.manual_seed(seed)
    model = model_class(target.class_name)(**target.config)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def _inputs(target: Target, model: nn.Module, batch: int, grid: Grid) -> dict:
    generator = torch.Generator().manual_seed(1)
    if target.inputs_file:
        spec = importlib.util.spec_from_file_location("paradiff_user_inputs", target.inputs_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if hasattr(module, "INPUTS"):  # declared as data, like a family's (plans/inputs.py)
            from paradiff.plan_tools.example_inputs import materialize

            return materialize(module.INPUTS, target.example or "", model.config, batch, grid, generator)
        return module.example_inputs(model.config, batch, grid, generator)
    from paradiff.plan_tools.family_examples import family_inputs, family_module

    return family_inputs(family_module(target.family), target.example, model.config, batch, grid, generator)


def _record_outputs(model: nn.Module) -> tuple[list[tuple[str, str, torch.Tensor]], list]:
    """Every module's first output tensor in execution order; `records.open` is the stack of modules entered and
    not yet left, so after an exception its top is the module that raised."""
    records: list[tuple[str, str, torch.Tensor]] = []
    open_modules: list[tuple[str, str]] = []
    records_open = open_modules

    def enter(name):
        def push(module, _args):
            open_modules.append((name, type(module).__name__))
        return push

    def hook(name):
        def record(module, _args, output):
            from paradiff.plan_tools.family_examples import output_tensors

            if open_modules and open_modules[-1][0] == name:
                open_modules.pop()
            tensors = output_tensors(output)
            if tensors and tensors[0].is_floating_point():
                records.append((name, type(module).__name__, tensors[0].detach().clone()))
        return record

    handles = [add_hook(module, hook(name), by="check_plan") for name, module in model.named_modules() if name]
    handles += [add_hook(module, enter(name), by="check_plan", pre=True)
                for name, module in model.named_modules() if name]
    return records, handles, records_open


def _aligned_reference(actual: torch.Tensor, expected: torch.Tensor, module: nn.Module | None, tp: tuple[int, int],
                       cp: tuple[int, int], heads: tuple[tuple[int, int, int], ...] = ()) -> torch.Tensor | None:
    """The part of the single-process output this rank's module output corresponds to, or None. Features (the last
    dim) split by TP: the module's own shard, else this rank's contiguous chunk (activations after a colwise
    projection); inside an attention module, a dim as long as its heads (query or K/V: `heads` holds (full, this
    rank's first, its count) for each) and cut to that count: this rank's heads (a per-head Q/K norm's output,
    [batch, tokens, heads, head_dim]); any other dim split by CP: this rank's token chunk. Under TP x CP both a heads
    dim and a token dim shrink, by the same factor at tp2 x ulysses2, so the shapes alone cannot tell them apart."""
    from paradiff.context_parallel.attention import even_sizes

    spec = getattr(module, "weight_spec", None)
    if spec is not None and getattr(getattr(module, "style", None), "kind", "") in ("colwise", "norm_across_heads"):
        expected = torch.cat([expected.narrow(-1, start, length) for start, length in spec.pieces], dim=-1)
    if actual.dim() != expected.dim():
        return None
    last = expected.dim() - 1
    # the heads dim is searched from the features backwards: diffusers' per-head tensors are [..., heads, head_dim]
    for dim in range(last - 1, 0, -1):
        piece = next(((first, count) for full, first, count in heads
                      if expected.shape[dim] == full and actual.shape[dim] == count < full), None)
        if piece is not None:
            expected = expected.narrow(dim, *piece)
            break
    for dim in range(expected.dim()):
        if actual.shape[dim] == expected.shape[dim]:
            continue
        rank, size = tp if dim == last else cp
        sizes = even_sizes(expected.shape[dim], size)
        if actual.shape[dim] != sizes[rank]:
            return None
        expected = expected.narrow(dim, sum(sizes[:rank]), sizes[rank])
    return expected


def _head_pieces(name: str, reference_modules: dict[str, nn.Module], state, tp: tuple[int, int]
                 ) -> tuple[tuple[int, int, int], ...]:
    """(full count, this rank's first, its count) of the query and K/V heads of the attention module `name` is in
    (itself or its nearest enclosing one the TP plan cut heads of), for `_aligned_reference`."""
    from paradiff.tensor_parallel.heads import split_heads

    if tp[1] == 1 or state is None or state.tp_plan is None:
        return ()
    parts = name.split(".")
    owner = next((".".join(parts[:n]) for n in range(len(parts), 0, -1)
                  if ".".join(parts[:n]) in state.tp_plan.local_head_counts), None)
    attention = reference_modules.get(owner) if owner is not None else None
    query = getattr(attention, "heads", None)
    if not isinstance(query, int) or query < tp[1]:
        return ()
    kv = getattr(attention, "kv_heads", None)
    kv = kv if isinstance(kv, int) and kv > 0 and query % kv == 0 else query
    query_pieces, kv_pieces = split_heads(query, kv, tp[1])
    return ((query, *query_pieces[tp[0]]),) + (((kv, *kv_pieces[tp[0]]),) if kv != query else ())


def _plan_notes(model: nn.Module) -> dict[str, str]:
    from paradiff.runtime.state import get_state

    state = get_state(model)
    notes: dict[str, str] = {}
    if state is not None and state.tp_plan is not None:
        for name, planned in state.tp_plan.linears.items():
            notes[name] = f"tp: {type(planned.style).__name__}({planned.style.kind})"
    plan = state.cp_plan if state is not None else None
    if plan is not None:
        for name, args in plan.split_inputs.items():
            notes[name] = notes.get(name, "") + f" cp: split inputs {sorted(args)}"
        for name in plan.gather_outputs:
            notes[name] = notes.get(name, "") + " cp: gather output"
        for name in plan.split_outputs:
            notes[name] = notes.get(name, "") + " cp: split output"
        for name in plan.local_attention:
            notes[name] = notes.get(name, "") + " cp: local attention"
        for name in plan.split_token_arguments:
            notes[name] = notes.get(name, "") + " cp: split per-token arguments"
    for name, module in model.named_modules():
        if hasattr(module, "processor") and name not in notes and state is not None and state.context is not None:
            notes[name] = "cp: attention over the split sequence"
    return {k: v.strip() for k, v in notes.items()}


def _rank_main(rank: int, world_size: int, target: Target, degrees: dict, plan_files: dict, batch: int,
               tolerance: float) -> tuple:
    import torch.distributed as dist

    import paradiff

    from paradiff.plan_tools.family_examples import forward, relative_difference

    grid = Grid()
    reference = _build(target)
    inputs = _inputs(target, reference, batch, grid)
    expected_records, handles, _ = _record_outputs(reference)
    expected = forward(reference, inputs)
    for handle in handles:
        handle.remove()
    plan = plan_files.get("tensor")
    cp_plan = plan_files.get("context")
    plan = plan if plan in (None, "auto") else load_plan_file(plan, "tensor")(reference.config)
    cp_plan = cp_plan if cp_plan in (None, "auto") else load_plan_file(cp_plan, "context")(reference.config)
    config = paradiff.ParallelConfig.from_degrees(**degrees)
    model = paradiff.enable_parallelism(_build(target), config, plan=plan, cp_plan=cp_plan)
    state = paradiff.runtime.state.get_state(model)
    cp_ranks = (state.context.cp_rank, state.context.cp_size) if state.context else (0, 1)
    tp_ranks = (dist.get_rank(state.mesh.tp_group), degrees["tp"]) if degrees["tp"] > 1 else (0, 1)
    records, handles, open_modules = _record_outputs(model)
    raised = None
    try:
        actual = forward(model, inputs)
        output_diff = relative_difference(actual, expected)
    except Exception as exc:  # noqa: BLE001 - the table up to the failing module is the useful part
        output_diff = float("inf")
        where, kind = open_modules[-1] if open_modules else ("(model)", type(model).__name__)
        raised = (where, kind, f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    modules = dict(model.named_modules())
    reference_modules = dict(reference.named_modules())
    by_name: dict[str, list] = {}
    for name, kind, tensor in expected_records:
        by_name.setdefault(name, []).append(tensor)
    seen: dict[str, int] = {}
    rows = []
    for name, kind, tensor in records:
        index = seen.get(name, 0)
        seen[name] = index + 1
        reference_tensor = by_name.get(name, [None] * (index + 1))[index] if index < len(by_name.get(name, [])) else None
        diff = None
        if tensor is not None and reference_tensor is not None:
            aligned = _aligned_reference(tensor, reference_tensor, modules.get(name), tp_ranks, cp_ranks,
                                         _head_pieces(name, reference_modules, state, tp_ranks))
            if aligned is not None:
                diff = relative_difference([tensor], [aligned])
        rows.append((name, kind, diff))
    notes = _plan_notes(model)
    if raised is not None:
        rows.append((raised[0], raised[1], float("inf")))
        notes[raised[0]] = (notes.get(raised[0], "") + " " + raised[2]).strip()
    return rows, output_diff, notes


def check_plan(model: str, *, tp: int = 1, ulysses: int = 1, ring: int = 1, plan: str | None = None,
               cp_plan: str | None = None, example: str | None = None, inputs: str | None = None, batch: int = 2,
               tolerance: float = 1e-5, timeout_s: float = 300.0) -> CheckResult:
    """Check a plan on a shrunk copy of `model` (a diffusers class name or a checkpoint folder) with local CPU
    processes. `plan` / `cp_plan`: None (built-in), "auto", or a plan file (`tensor_parallel_plan(config)` /
    `context_parallel_plan(config)`)."""
    for label, value in (("tp", tp), ("ulysses", ulysses), ("ring", ring)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{label} must be a positive integer, got {value!r}.")
    world = tp * ulysses * ring
    if world < 2:
        raise PlanError("check_plan needs a parallel configuration: set tp, ulysses or ring above 1.")
    target = resolve_target(model, example, inputs)
    degrees = {"tp": tp, "ulysses": ulysses, "ring": ring}
    plan_files = {"tensor": plan, "context": cp_plan}
    if tp > 1 and plan is None:
        _check_builtin_split(target, tp)
    try:
        outcomes = run_ranks(_rank_main, world, kwargs=dict(target=target, degrees=degrees, plan_files=plan_files,
                                                            batch=batch, tolerance=tolerance),
                             timeout_s=timeout_s, grace_s=5.0, gloo_timeout_s=120)
    except RankFailed as failure:
        raise PlanError(f"check_plan: rank {failure.rank} failed before comparing: {failure.summary}") from None
    except RankTimeout as timeout:
        raise PlanError(f"check_plan: rank(s) {timeout.missing} stopped without a result.") from None
    by_rank = dict(enumerate(outcomes))
    result = CheckResult(model=target.class_name, degrees=degrees, tolerance=tolerance)
    result.output_diff = max(v[1] for v in by_rank.values())
    notes = by_rank[0][2]
    rows0 = by_rank[0][0]
    for index, (name, kind, diff) in enumerate(rows0):
        diffs = [by_rank[r][0][index][2] for r in by_rank if index < len(by_rank[r][0])]
        known = [d for d in diffs if d is not None]
        result.rows.append(ModuleRow(name, kind, max(known) if known else None, notes.get(name, "")))
    return result
