"""Verify LoRA adapters on the tiny pipelines in every mode: for each family, two adapters (diffusers' format with
text-encoder parts where the family's loader adapts its encoders, and a converted format where diffusers has a
converter) loaded with `load_lora_weights`, mixed by `set_adapters`, fused into every component, unfused, unloaded,
against diffusers' single-process pipeline (paradiff_testkit.lora.pipeline_lora). Writes tools/verify_lora.json and
the table in docs/lora.md between its markers. tests/test_lora.py runs a sample of these cases.

    .venv/bin/python tools/verify_lora.py                 # ~20 minutes on 2 CPU cores
    .venv/bin/python tools/verify_lora.py --only sd3,wan  # these families again, keep the rest
    .venv/bin/python tools/verify_lora.py --readme        # only rewrite the docs table from the json
"""

from __future__ import annotations

import datetime
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))  # paradiff_testkit (docs/testing.md)

from paradiff.testing.dist import RankFailure, RankPool, RankTimeout
from paradiff_testkit.lora import pipeline_lora, save_pipeline_loras
from paradiff_testkit.pipelines import save_pipeline

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tools" / "verify_lora.json"
DOCS = ROOT / "docs" / "lora.md"
RTOL = 1e-5
# family -> the two adapters it loads (save_pipeline_loras' names)
FAMILIES = {"flux": ("style", "kohya"), "flux2": ("style", "detail"), "qwenimage": ("style", "detail"),
            "wan": ("style", "detail"), "sd3": ("style", "detail"), "hunyuanvideo": ("style", "original")}
CFG_FAMILIES = ("qwenimage", "wan", "sd3")  # their default call runs classifier-free guidance
# world size -> modes ("+staged": stages=True)
MODES = {2: ("tp2", "ulysses2", "ring2", "cfg2", "dp2", "tp2+staged"),
         4: ("tp2xulysses2", "ring2xulysses2", "tp2xcfg2")}


def cases_for(family: str, modes: tuple[str, ...]) -> list[tuple[str, bool]]:
    out = []
    for mode in modes:
        name, _, staged = mode.partition("+")
        if "cfg" in name and family not in CFG_FAMILIES:
            continue
        out.append((name, bool(staged)))
    return out


def summary(results: list[dict]) -> dict:
    """One (family, mode)'s record over its ranks: the largest difference, and every check."""
    worst = max(max(result["diffs"].values()) for result in results)
    checks = {
        "within 1e-5": worst <= RTOL,
        "adapters change the output": all(result["changed"] > 1e-3 for result in results),
        "fusing changed every resident adapted shard": all(
            result["fused_changed"] == result["checked_shards"] > 0 for result in results),
        "unfused shards equal the originals": all(result["unfused_exact"] for result in results),
        "unloaded = before loading": all(result["back_to_base"] for result in results),
    }
    return {"max_rel_diff": worst, "ok": all(checks.values()), "failed": [k for k, v in checks.items() if not v],
            "split_factors": {name: count for name, count in results[0]["sliced"].items()},
            "split_layers": results[0]["split_layers"]}


def main(only: set[str] | None) -> int:
    records = json.loads(RESULTS.read_text())["results"] if only and RESULTS.is_file() else {}
    with tempfile.TemporaryDirectory() as tmp:
        folders, loras = {}, {}
        for family in FAMILIES:
            if only and family not in only:
                continue
            folders[family] = save_pipeline(family, Path(tmp) / family)
            loras[family] = save_pipeline_loras(family, folders[family], Path(tmp) / "loras" / family)
        for world, modes in MODES.items():
            pool = RankPool(world)
            for family, names in FAMILIES.items():
                if family not in folders:
                    continue
                for mode, staged in cases_for(family, modes):
                    label = mode + (" staged" if staged else "")
                    case = dict(family=family, folder=str(folders[family]), mode=mode, stages=staged,
                                loras={name: str(loras[family][name]) for name in names},
                                weights=dict(zip(names, (0.7, 1.3))))
                    try:
                        record = summary(pool.run(pipeline_lora, timeout_s=1200, **case))
                    except (RankFailure, RankTimeout) as exc:
                        record = {"max_rel_diff": None, "ok": False, "failed": [str(exc).strip().splitlines()[-1]]}
                        if not pool.alive:
                            pool = RankPool(world)
                    records.setdefault(family, {})[label] = record
                    print(f"{family} {label}: {'ok' if record['ok'] else 'FAILED ' + str(record['failed'])} "
                          f"(max rel diff {record['max_rel_diff']})", flush=True)
            pool.close()
    RESULTS.write_text(json.dumps({"date": datetime.date.today().isoformat(),
                                   "command": "python tools/verify_lora.py", "results": records},
                                  indent=1, sort_keys=True) + "\n")
    write_docs_table()
    return 0 if all(r["ok"] for modes in records.values() for r in modes.values()) else 1


def write_docs_table() -> None:
    """docs/lora.md's table (between its markers): family x mode, the largest relative difference or the failure."""
    data = json.loads(RESULTS.read_text())
    labels = [mode + (" staged" if staged else "") for world in MODES for mode, staged in cases_for("sd3", MODES[world])]
    lines = ["| family (adapters) | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for family, names in FAMILIES.items():
        row = []
        for label in labels:
            record = data["results"].get(family, {}).get(label)
            if record is None:
                row.append("—")
            elif record["ok"]:
                row.append(f"{record['max_rel_diff']:.0e}")
            else:
                row.append("FAILED: " + "; ".join(record["failed"]))
        lines.append(f"| {family} ({', '.join(names)}) | " + " | ".join(row) + " |")
    table = "\n".join(lines) + f"\n\n(`{data['command']}`, {data['date']}; — : the family's call runs no CFG.)"
    text = DOCS.read_text()
    start, end = "<!-- lora-verified:start -->", "<!-- lora-verified:end -->"
    if text.count(start) != 1 or text.count(end) != 1:
        raise SystemExit(f"{DOCS} needs one {start} and one {end} line; left as it is.")
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    DOCS.write_text(f"{head}{start}\n{table}\n{end}{tail}")


if __name__ == "__main__":
    if "--readme" in sys.argv:
        write_docs_table()
        sys.exit(0)
    only = next((arg.split("=", 1)[1] if "=" in arg else sys.argv[sys.argv.index(arg) + 1]
                 for arg in sys.argv[1:] if arg.startswith("--only")), None)
    sys.exit(main(set(only.split(",")) if only else None))
