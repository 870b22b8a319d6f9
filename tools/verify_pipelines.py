"""Verify every tiny-pipeline recipe (paradiff_testkit.zoo) in every parallel mode against diffusers' single-process
call; write src/paradiff/plans/pipelines_verified.json, which `paradiff plans --pipelines` and
docs/pipeline-coverage.md's table show.

    .venv/bin/python tools/verify_pipelines.py                     # every recipe (long), then the doc's table
    .venv/bin/python tools/verify_pipelines.py --only FluxPipeline,SanaPipeline   # these again, keep the rest
    .venv/bin/python tools/verify_pipelines.py --only FluxPipeline --modes tp2,cfg2
    .venv/bin/python tools/verify_pipelines.py --table             # only rewrite the doc's table from the json
    .venv/bin/python tools/verify_pipelines.py --classes           # only refresh the list of DiT pipeline classes

Each recipe is built and saved once (under --folders DIR, default a temporary folder), run single-process here,
then loaded with `paradiff.load_pipeline` on a 2-rank pool (tp2, ulysses2, ring2, cfg2) and a 4-rank pool
(tp2 x ulysses2, cfg2 x tp2). The cfg modes are "n/a" where the pipeline never guides (plans/pipelines.py; a modular
pipeline: its blocks have no guider component); a pipeline paradiff has not classified is still run, so its refusal
is recorded. Modular keys (zoo.ModularRecipe) run the same way on modular pipeline folders.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "testkit"))  # paradiff_testkit (docs/testing.md)
DOC = ROOT / "docs" / "pipeline-coverage.md"
START, END = "<!-- pipeline-coverage:start -->\n", "\n<!-- pipeline-coverage:end -->"


def write_doc_table() -> None:
    from paradiff.plan_tools.pipeline_coverage import pipeline_coverage_table

    text = DOC.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    DOC.write_text(head + START + pipeline_coverage_table(markdown=True) + END + tail)


def not_applicable(key: str, mode: str) -> dict | None:
    """The outcome of a cfg mode on a pipeline that never guides ("n/a"), or on a recipe whose call does not guide
    though the pipeline can (a defect of the recipe: "failed"); None where the mode is to be run."""
    from paradiff.plans.pipelines import pipeline_spec
    from paradiff_testkit import zoo
    from paradiff_testkit.zoo.check import CFG_MODES

    if mode not in CFG_MODES:
        return None
    name = zoo.pipeline_name(key)
    spec = pipeline_spec(name)
    if zoo.is_modular(key):
        if spec.modular_cfg_refusal is None and not zoo.modular_guiders(name):
            return {"status": "n/a", "reason": "never guides (no guider component: guidance-distilled)"}
        return None
    if spec.never_guides:
        return {"status": "n/a", "reason": "never guides (guidance-distilled: one transformer call a step)"}
    rule = spec.cfg
    if rule is not None and not rule.runs_cfg(zoo.call_kwargs(key), SimpleNamespace(**zoo.recipe(key).init)):
        return {"status": "failed", "reason": f"the recipe's call does not guide (give it {rule.how()})"}
    return None


@functools.lru_cache(maxsize=1)
def _modular_guiders() -> dict[str, list[str]]:
    from paradiff_testkit import zoo

    return zoo.modular_dit_classes()


def folder_of(folders: Path, key: str) -> Path:
    from paradiff_testkit import zoo

    return folders / f"{key.replace('@', '-')}-{zoo.fingerprint(key)}"


def combine(outcomes: list[dict]) -> dict:
    """One outcome from every rank's: the worst status, the largest difference, the first reason."""
    order = ["failed", "refused", "mismatch", "verified"]
    worst = min(outcomes, key=lambda outcome: order.index(outcome["status"]))
    combined = {"status": worst["status"]}
    diffs = [outcome["diff"] for outcome in outcomes if "diff" in outcome]
    if diffs:
        combined["diff"] = max(diffs)
    if "reason" in worst:
        combined["reason"] = worst["reason"]
    return combined


def main(only: list[str] | None, modes: list[str] | None, folders: Path) -> int:
    from paradiff.plan_tools.pipeline_coverage import VERIFIED, load_verified
    from paradiff_testkit import zoo
    from paradiff.testing.dist import RankFailure, RankPool, RankTimeout
    from paradiff_testkit.zoo.check import ALL_MODES, MODES, check_modes, reference

    record = load_verified()
    pipelines: dict = record.get("pipelines", {})
    keys = only or zoo.names()
    unknown = sorted(set(keys) - set(zoo.names()))
    if unknown:
        print(f"no recipe for {unknown}; recipes: {', '.join(zoo.names())}")
        return 2
    modes = modes or list(ALL_MODES)
    expected: dict[str, dict] = {}
    for key in keys:
        entry = pipelines.setdefault(key, {"modes": {}})
        entry["modes"] = {m: v for m, v in entry.get("modes", {}).items() if m in ALL_MODES}
        folder = folder_of(folders, key)
        try:
            zoo.save(key, folder)
            expected[key] = reference(key, str(folder))
        except Exception as exc:  # noqa: BLE001 - the recipe itself is broken: every mode says so
            reason = f"the single-process call failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            print(f"{key}: {reason}", flush=True)
            entry["modes"] = {mode: {"status": "failed", "reason": reason} for mode in modes}
            continue
        for mode in modes:
            outcome = not_applicable(key, mode)
            if outcome is not None:
                entry["modes"][mode] = outcome
    for world, world_modes in MODES.items():
        todo = [(key, mode) for key in expected for mode in world_modes
                if mode in modes and not_applicable(key, mode) is None]
        if not todo:
            continue
        pool = RankPool(world)
        for key, mode in todo:
            job = dict(key=key, folder=str(folder_of(folders, key)), mode=mode, expected=expected[key])
            try:
                outcome = combine([results[0] for results in pool.run(check_modes, jobs=[job], timeout_s=400)])
            except (RankFailure, RankTimeout) as exc:
                outcome = {"status": "failed", "reason": f"a rank died or hung: {str(exc).splitlines()[-1][:300]}"}
                pool.close(force=True)
                pool = RankPool(world)
            pipelines[key]["modes"][mode] = outcome
            print(f"{key} {mode}: {outcome['status']} {outcome.get('diff', '')} {outcome.get('reason', '')}",
                  flush=True)
        pool.close()
    import diffusers

    record.update(diffusers=diffusers.__version__, date=datetime.date.today().isoformat(),
                  command="python tools/verify_pipelines.py", pipelines=pipelines)
    if not record.get("classes") or not record.get("modular"):
        record.update(classes=zoo.dit_pipeline_classes(), modular=_modular_guiders())
    VERIFIED.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {VERIFIED}")
    write_doc_table()
    return 0


def _importable(name: str) -> bool:
    import diffusers

    try:
        getattr(diffusers, name)
    except Exception:  # noqa: BLE001 - what an optional dependency's absence raises varies
        return False
    return True


def refresh_classes() -> None:
    from paradiff.plan_tools.pipeline_coverage import VERIFIED, load_verified
    from paradiff_testkit import zoo

    import diffusers

    record = load_verified()
    classes = zoo.dit_pipeline_classes()
    # a class listed before that this environment cannot import (an optional dependency of its module missing, e.g.
    # OpenCV for ConsisID) stays listed: the list is diffusers', not this environment's
    unimportable = [name for name in record.get("classes", []) if name not in classes and not _importable(name)]
    if unimportable:
        print(f"kept, not importable here: {', '.join(unimportable)}")
    record.update(classes=sorted(classes + unimportable), modular=_modular_guiders(), diffusers=diffusers.__version__)
    VERIFIED.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"{len(record['classes'])} DiT pipeline classes in diffusers {diffusers.__version__} "
          f"({len(record['modular'])} of them modular)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated recipe keys (pipeline class names)")
    parser.add_argument("--modes", help="comma-separated modes (default: all)")
    parser.add_argument("--folders", type=Path, help="where to keep the tiny pipeline folders")
    parser.add_argument("--table", action="store_true", help="only rewrite docs/pipeline-coverage.md's table")
    parser.add_argument("--classes", action="store_true", help="only refresh the list of DiT pipeline classes")
    args = parser.parse_args()
    if args.table:
        write_doc_table()
        sys.exit(0)
    if args.classes:
        refresh_classes()
        write_doc_table()
        sys.exit(0)
    with tempfile.TemporaryDirectory(prefix="paradiff-zoo-") as scratch:
        sys.exit(main(args.only.split(",") if args.only else None, args.modes.split(",") if args.modes else None,
                      args.folders or Path(scratch)))
