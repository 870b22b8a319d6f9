"""Verify Modular Diffusers pipelines on the mesh in the modes beyond the coverage table's (which
tools/verify_pipelines.py verifies for every modular zoo key): a staged tp2 load, data parallel x TP, cfg2 x ulysses2
and a 3-branch SkipLayerGuidance guider at cfg3, on four zoo keys (paradiff_testkit.modular.MODULAR_KEYS), each
output against diffusers' single-process modular call of the same folder and seed (fp32), with what each rank held
and computed. Writes tools/verify_modular.json and the table between the `modular:start` / `modular:end` markers of
docs/pipelines.md.

    .venv/bin/python tools/verify_modular.py           # ~5 minutes on 2 busy CPU cores
    .venv/bin/python tools/verify_modular.py --table   # only rewrite the docs table from the JSON

A mode passes when every rank's output is within 1e-5 of the single process (relative to the output's scale), the
VAE was split, the TP ranks hold exactly the slices their plan names (and well under the whole transformer and text
encoder), the context-parallel ranks' first blocks saw their own shares of the tokens, at cfg N each rank computed
its branches, and a staged load entered each stage once.
"""

from __future__ import annotations

import datetime
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))  # paradiff_testkit (docs/testing.md)

from paradiff.testing.dist import RankFailure, RankPool, RankTimeout
from paradiff_testkit import zoo
from paradiff_testkit.modular import MODULAR_KEYS, guided, modular_equivalence

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tools" / "verify_modular.json"
DOCS = ROOT / "docs" / "pipelines.md"
STEPS = 2
# world size -> mode -> degrees (the coverage table's tp2 / ulysses2 / ring2 / tp2 x ulysses2 / cfg2 / cfg2 x tp2:
# tools/verify_pipelines.py); "(guided)" modes run only on the keys with a guider, "(skip-layer)" with a 3-branch
# SkipLayerGuidance guider (Wan: diffusers' skip hook returns Qwen-Image's joint block outputs swapped)
WORLDS = {
    2: {"tp2-staged": dict(tp=2, stages=True)},
    3: {"cfg3 (skip-layer)": dict(cfg=3)},
    4: {"dp2xtp2": dict(data=2, tp=2), "cfg2xulysses2 (guided)": dict(cfg=2, ulysses=2)},
}
SKIP_LAYER = ("WanModularPipeline",)


def _runs(key: str, modes: dict[str, dict]) -> dict[str | None, dict[str, dict]]:
    """guider -> the modes run with it, for this key."""
    runs: dict[str | None, dict[str, dict]] = {}
    for mode, degrees in modes.items():
        if mode.endswith("(guided)") and not guided(key):
            continue
        if mode.endswith("(skip-layer)"):
            if key in SKIP_LAYER:
                runs.setdefault("skip_layer", {})[mode.split(" ")[0]] = degrees
            continue
        runs.setdefault(None, {})[mode.split(" ")[0]] = degrees
    return runs


def verdict(results: list[dict], mode: str, degrees: dict) -> dict:
    worst = max(result["modes"][mode]["max_abs_diff"] / max(result["modes"][mode]["scale"], 1.0)
                for result in results)
    checks = []
    for result in results:
        outcome = result["modes"][mode]
        checks.append(outcome["vae_split"])
        if degrees.get("tp", 1) > 1:
            checks.append(outcome["wrong_slices"] == [] and outcome["param_share"] < 0.75
                          and outcome["encoder_share"] < 0.75)
        if degrees.get("stages"):
            checks.append(outcome["stages"] == ["text_encoders", "transformer", "vae"])
        cp = degrees.get("ulysses", 1) * degrees.get("ring", 1)
        if cp > 1:
            checks.append(outcome["tokens"] < result["tokens"]
                          and sum(outcome["token_shares"]) == len(results) // cp * result["tokens"])
        if degrees.get("cfg", 1) > 1:
            checks.append(sum(r["modes"][mode]["computed"] for r in results)
                          == sum(outcome["branch_counts"]) * len(results) // degrees["cfg"])
    return {"max_rel_diff": worst, "split_checks": all(checks), "passed": worst <= 1e-5 and all(checks)}


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="verify-modular-"))
    folders = {key: str(zoo.save(key, root / key)) for key in MODULAR_KEYS}
    records: dict[str, dict] = {zoo.pipeline_name(key): {} for key in MODULAR_KEYS}
    for world, modes in WORLDS.items():
        pool = RankPool(world)
        for key in MODULAR_KEYS:
            for guider, run in _runs(key, modes).items():
                try:
                    results = pool.run(modular_equivalence, timeout_s=900, key=key, folder=folders[key],
                                       modes=run, guider=guider, steps=3 if guider else STEPS)
                    for mode, degrees in run.items():
                        name = f"{mode} (SkipLayerGuidance)" if guider else mode
                        records[zoo.pipeline_name(key)][name] = verdict(results, mode, degrees)
                except (RankFailure, RankTimeout) as exc:
                    for mode in run:
                        records[zoo.pipeline_name(key)][mode] = {"passed": False,
                                                                 "error": str(exc).splitlines()[-1][:300]}
                    if not pool.alive:
                        pool = RankPool(world)
                print(f"world {world}: {key} {sorted(run)} done", flush=True)
        pool.close()
    RESULTS.write_text(json.dumps({"date": datetime.date.today().isoformat(),
                                   "command": "python tools/verify_modular.py", "steps": STEPS,
                                   "pipelines": records}, indent=1, sort_keys=True) + "\n")
    write_table()
    return 0 if all(r["passed"] for modes in records.values() for r in modes.values()) else 1


def write_table() -> None:
    data = json.loads(RESULTS.read_text())
    order = [mode.split(" ")[0] for modes in WORLDS.values() for mode in modes]
    modes = sorted({mode for record in data["pipelines"].values() for mode in record},
                   key=lambda mode: (mode.startswith("cfg"), "(" in mode, order.index(mode.split(" ")[0])))
    lines = ["| modular pipeline | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for pipeline, record in sorted(data["pipelines"].items()):
        cells = []
        for mode in modes:
            outcome = record.get(mode)
            if outcome is None:
                cells.append("-")
            elif outcome["passed"]:
                cells.append(f"{outcome['max_rel_diff']:.1e}")
            else:
                cells.append("fails")
        lines.append(f"| `{pipeline}` | " + " | ".join(cells) + " |")
    lines.append(f"\n(max relative difference vs diffusers' single-process modular call, {data['date']}, "
                 f"`{data['command']}`; `-`: not applicable, no guider or no 3-branch guider for that pipeline; the coverage "
                 "table's modes: docs/pipeline-coverage.md)")
    text = DOCS.read_text()
    start, end = "<!-- modular:start -->", "<!-- modular:end -->"
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise SystemExit(f"{DOCS} needs one {start} ... {end} pair")
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    DOCS.write_text(head + start + "\n" + "\n".join(lines) + "\n" + end + tail)


if __name__ == "__main__":
    if "--table" in sys.argv:
        write_table()
        sys.exit(0)
    sys.exit(main())
