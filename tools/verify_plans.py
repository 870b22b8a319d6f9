"""Verify every built-in plan in every mode, and compare the automatic planner's TP plan with it on every example;
write src/paradiff/plans/verified.json, which `paradiff plans` (and docs/coverage.md's table) show.

    .venv/bin/python tools/verify_plans.py          # ~5 minutes on 2 CPU cores; also rewrites docs/coverage.md's table
    .venv/bin/python tools/verify_plans.py --readme # only rewrite docs/coverage.md's table from verified.json
    .venv/bin/python tools/verify_plans.py --only kandinsky6,lumina2   # verify these examples again, keep the rest
    .venv/bin/python tools/verify_plans.py --uneven [--only ...]      # only the uneven-head sweep (below)

The uneven-head sweep runs every example with head counts the TP degree does not divide: 3, 5 and 7 heads at tp2,
4, 5 and 7 at tp3 (one K/V head where the example groups them; paradiff_testkit/families.py: uneven_head_overrides), and
records per class the worst difference, the largest per-rank share of the block FLOPs, and the head counts no
config of the example takes or the plan refuses (more ranks than some attention's heads).
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))  # paradiff_testkit (docs/testing.md)

from paradiff.plan_tools import family_examples as examples
from paradiff.plan_tools.coverage import VERIFIED
from paradiff.testing.dist import RankPool, RankFailure, RankTimeout
from paradiff_testkit.families import family_modes, family_modes_or_refusal, uneven_head_overrides

WORLD_MODES = {2: ["tp2", "ulysses2", "ring2"], 4: ["tp2xulysses2", "unified2x2"]}
UNEVEN_HEADS = {"tp2": (3, 5, 7), "tp3": (4, 5, 7)}  # head counts neither degree divides


def write_readme_table() -> None:
    """Replace docs/coverage.md's table (between its markers) with `paradiff plans --markdown`."""
    from pathlib import Path

    from paradiff.plan_tools.coverage import coverage_table

    readme = Path(__file__).resolve().parents[1] / "docs" / "coverage.md"
    text = readme.read_text()
    start, end = "<!-- coverage:start -->\n", "\n<!-- coverage:end -->"
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    readme.write_text(head + start + coverage_table(markdown=True) + end + tail)


def auto_match(family: str, example: str) -> str:
    """How many of the built-in TP plan's block-stack entries the automatic planner reproduces exactly."""
    from paradiff.plans.auto import auto_tensor_plan
    from paradiff.plans import builtin_plan
    from paradiff.tensor_parallel.plan import resolve_plan

    model = examples.build_example(family, example)
    stacks = tuple(f"{name}." for name in examples.block_stacks(model))

    def block_styles(plan) -> dict:
        resolved = resolve_plan(model, plan, rank=0, size=2)
        return {name: (linear.style.kind, getattr(linear.specs.get("weight"), "pieces", None))
                for name, linear in resolved.linears.items() if name.startswith(stacks)}

    builtin = block_styles(builtin_plan(model, model.config, "tensor"))
    try:
        auto = block_styles(auto_tensor_plan(model))
    except Exception:  # noqa: BLE001 - the planner refused: nothing reproduced
        auto = {}
    same = sum(auto.get(name) == style for name, style in builtin.items())
    return f"{same}/{len(builtin)}"


def main(only: set[str] | None = None) -> int:
    previous = json.loads(VERIFIED.read_text()) if VERIFIED.is_file() else {"classes": {}}
    classes: dict[str, dict] = {}
    if only:  # the other classes keep their records; the named examples' classes are verified again
        classes = previous["classes"]
        for _, example, class_name in examples.all_examples():
            if example in only:
                classes[class_name] = {key: value for key, value in classes.get(class_name, {}).items()
                                       if key == "uneven"}
    else:  # the uneven-head sweep's records stay until `--uneven` runs again
        classes = {name: {"uneven": record["uneven"]} for name, record in previous["classes"].items()
                   if "uneven" in record}
    for world, modes in WORLD_MODES.items():
        pool = RankPool(world)
        for family, example, class_name in examples.all_examples():
            if only and example not in only:
                continue
            record = classes.setdefault(class_name, {})
            record.setdefault("modes", {})
            if "auto" not in record:
                record["auto"] = auto_match(family, example)
            try:
                results = pool.run(family_modes, family=family, example=example, modes=modes)
                for mode in modes:
                    worst = max(by_rank[mode]["diff"] for by_rank in results)
                    record["modes"][mode] = max(record["modes"].get(mode, 0.0), worst)
            except (RankFailure, RankTimeout) as exc:
                for mode in modes:
                    record["modes"][mode] = float("inf")
                print(f"{class_name} ({example}) failed at {modes}: {str(exc).splitlines()[-1]}")
                if not pool.alive:
                    pool = RankPool(world)
            print(f"world {world}: {class_name} ({example}) done", flush=True)
        pool.close()
    for record in classes.values():
        record["modes"] = {m: (d if d != float("inf") else 1.0) for m, d in record["modes"].items()}
    data = {"date": datetime.date.today().isoformat(), "command": "python tools/verify_plans.py", "classes": classes}
    if "uneven_date" in previous:
        data["uneven_date"] = previous["uneven_date"]
    VERIFIED.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {VERIFIED}")
    write_readme_table()
    return 0


def uneven(only: set[str] | None = None) -> int:
    """The uneven-head sweep: classes[...]["uneven"] = {"tp2@5": difference or "refused: ..." or "no config", ...,
    "flop_share": the largest per-rank share over the sweep}."""
    data = json.loads(VERIFIED.read_text())
    classes = data["classes"]
    for _, example, class_name in examples.all_examples():  # measured afresh
        if not only or example in only:
            classes.get(class_name, {}).pop("uneven", None)
    for mode, head_counts in UNEVEN_HEADS.items():
        pool = RankPool(int(mode[2:]))
        for family, example, class_name in examples.all_examples():
            if only and example not in only:
                continue
            record = classes.setdefault(class_name, {"modes": {}}).setdefault("uneven", {})
            for heads in head_counts:
                label = f"{mode}@{heads}"
                overrides = uneven_head_overrides(family, example, heads)
                if overrides is None:
                    record.setdefault(label, "no config")
                    continue
                try:
                    results = pool.run(family_modes_or_refusal, family=family, example=example, modes=[mode],
                                       config_overrides=overrides)
                except (RankFailure, RankTimeout) as exc:
                    record[label] = f"failed: {str(exc).splitlines()[-1]}"
                    if not pool.alive:
                        pool = RankPool(int(mode[2:]))
                    continue
                if any("refused" in result for result in results):
                    record[label] = "refused: " + next(r["refused"] for r in results if "refused" in r)[:200]
                    continue
                figures = [by_mode[mode] for by_mode in results]
                worst = max(f["diff"] for f in figures)
                wrong = sorted({name for f in figures for name in f["wrong_slices"]})
                found = worst if not wrong else f"wrong slices: {wrong[:3]}"
                # a class with several examples keeps the worst of them (any problem over any difference)
                before = record.get(label)
                record[label] = found if not isinstance(before, float) or isinstance(found, str) else max(before, found)
                record["flop_share"] = max(record.get("flop_share", 0.0), *(f["flop_share"] for f in figures))
            print(f"{mode}: {class_name} ({example}) {record}", flush=True)
        pool.close()
    data["uneven_date"] = datetime.date.today().isoformat()
    VERIFIED.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {VERIFIED}")
    write_readme_table()
    return 0


if __name__ == "__main__":
    if "--readme" in sys.argv:
        write_readme_table()
        sys.exit(0)
    only = next((arg.split("=", 1)[1] if "=" in arg else sys.argv[sys.argv.index(arg) + 1]
                 for arg in sys.argv[1:] if arg.startswith("--only")), None)
    chosen = set(only.split(",")) if only else None
    sys.exit(uneven(chosen) if "--uneven" in sys.argv else main(chosen))
