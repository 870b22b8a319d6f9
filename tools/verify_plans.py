"""Verify every built-in plan in every mode, and compare the automatic planner's TP plan with it on every example;
write src/paradiff/plans/verified.json, which `paradiff plans` (and docs/coverage.md's table) show.

    .venv/bin/python tools/verify_plans.py          # ~5 minutes on 2 CPU cores; also rewrites docs/coverage.md's table
    .venv/bin/python tools/verify_plans.py --readme # only rewrite docs/coverage.md's table from verified.json
    .venv/bin/python tools/verify_plans.py --only kandinsky6,lumina2   # verify these examples again, keep the rest
"""

from __future__ import annotations

import datetime
import json
import sys

from paradiff.plan_tools import family_examples as examples
from paradiff.plan_tools.coverage import VERIFIED
from paradiff.testing.dist import RankPool, RankFailure, RankTimeout
from paradiff.testing.families import family_modes

WORLD_MODES = {2: ["tp2", "ulysses2", "ring2"], 4: ["tp2xulysses2", "unified2x2"]}


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
    classes: dict[str, dict] = {}
    if only:  # the other classes keep their records; the named examples' classes are verified again
        classes = json.loads(VERIFIED.read_text())["classes"]
        for _, example, class_name in examples.all_examples():
            if example in only:
                classes.pop(class_name, None)
    for world, modes in WORLD_MODES.items():
        pool = RankPool(world)
        for family, example, class_name in examples.all_examples():
            if only and example not in only:
                continue
            record = classes.setdefault(class_name, {"modes": {}})
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
    VERIFIED.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "command": "python tools/verify_plans.py",
        "classes": classes}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {VERIFIED}")
    write_readme_table()
    return 0


if __name__ == "__main__":
    if "--readme" in sys.argv:
        write_readme_table()
        sys.exit(0)
    only = next((arg.split("=", 1)[1] if "=" in arg else sys.argv[sys.argv.index(arg) + 1]
                 for arg in sys.argv[1:] if arg.startswith("--only")), None)
    sys.exit(main(set(only.split(",")) if only else None))
