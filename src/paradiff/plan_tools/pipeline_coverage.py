"""The pipeline coverage table: every DiT pipeline class of diffusers (each class whose `__init__` takes a
`transformer`, and each Modular Diffusers class whose blocks expect a `transformer` component), its CFG style
(plans/pipelines.py; a modular class: its guider, or never guides when its blocks have no guider component), and per parallel mode whether paradiff's `load_pipeline` gives
diffusers' single-process output on a tiny pipeline of that class, was refused (with paradiff's reason), failed, or
was not verified yet. `tools/verify_pipelines.py` writes `plans/pipelines_verified.json`; `paradiff plans
--pipelines` prints the table; docs/pipeline-coverage.md carries it (a test keeps them in step)."""

from __future__ import annotations

import json
from pathlib import Path

from paradiff.plans.pipelines import BATCH, not_dit_refusal, pipeline_spec

VERIFIED = Path(__file__).parents[1] / "plans" / "pipelines_verified.json"
MODES = ("tp2", "ulysses2", "ring2", "tp2xulysses2", "cfg2", "cfg2xtp2")
HEADER = ["pipeline", "CFG style", "tp2", "ulysses2", "ring2", "tp2 x ulysses2", "cfg2", "cfg2 x tp2"]


def load_verified() -> dict:
    return json.loads(VERIFIED.read_text()) if VERIFIED.is_file() else {"classes": [], "pipelines": {}}


def cfg_style(pipeline: str, modular: dict[str, list[str]] | None = None) -> str:
    """How the pipeline guides; `modular`: the record's modular classes and their guider components."""
    modular = load_verified().get("modular", {}) if modular is None else modular
    name = pipeline.partition("@")[0]
    spec = pipeline_spec(name)
    if name in modular:
        if spec.modular_cfg_refusal is not None:
            return "not split yet"
        return "its guider" if modular[name] else "never guides"
    if spec.cfg is not None:
        return "batch" if spec.cfg.style == BATCH else "two calls"
    if spec.fails_in_diffusers is not None:
        return "fails in diffusers"
    if spec.guider:
        return "its guider"
    if spec.cfg_not_split is not None:
        return "PAG (not split)" if "PAG" in name else "not split yet"
    return "never guides" if spec.never_guides else "not classified"


def fully_verified(entry: dict) -> bool:
    """Every mode verified, or not applicable (a cfg mode on a pipeline that never guides)."""
    modes = entry.get("modes", {})
    return all(modes.get(mode, {}).get("status") in ("verified", "n/a") for mode in MODES)


def summary(record: dict | None = None) -> dict[str, int]:
    record = record or load_verified()
    classes, pipelines = record.get("classes", []), record.get("pipelines", {})
    return {"classes": len(classes), "modular": sum(name in record.get("modular", {}) for name in classes),
            "with recipe": sum(name in pipelines for name in classes),
            "verified in every mode": sum(name in pipelines and fully_verified(pipelines[name]) for name in classes)}


def pipeline_coverage_table(markdown: bool = False) -> str:
    record = load_verified()
    pipelines, modular = record.get("pipelines", {}), record.get("modular", {})
    reasons: dict[str, int] = {}

    def cell(outcome: dict | None, name: str) -> str:
        if outcome is None:
            return "?"
        status = outcome["status"]
        if status == "verified":
            return "yes"
        if status == "n/a":
            return "-"
        # the same reason for many pipelines is one note: the pipeline's own name reads "<pipeline>" there
        reason = outcome.get("reason", "").replace(name, "<pipeline>")
        label = {"refused": "refused", "mismatch": "FAIL", "failed": "FAIL"}[status]
        fails_in_diffusers = pipeline_spec(name).fails_in_diffusers
        if status == "failed" and fails_in_diffusers is not None and "single-process call failed" in reason:
            label, reason = "fails in diffusers itself", fails_in_diffusers
        number = reasons.setdefault(reason, len(reasons) + 1)
        return f"{label} [{number}]"

    rows = []
    keys = sorted(set(record.get("classes", [])) | {key.partition("@")[0] for key in pipelines})
    for name in keys:
        variants = sorted(key for key in pipelines if key.partition("@")[0] == name)
        if not variants and not_dit_refusal(name):  # refused in every mode by load_pipeline, from plans/pipelines.py
            refused = cell({"status": "refused", "reason": not_dit_refusal(name)}, name)
            rows.append([name, "not a DiT"] + [refused] * len(MODES))
            continue
        if not variants:
            rows.append([name, cfg_style(name, modular)] + ["not verified yet"] + [""] * (len(MODES) - 1))
            continue
        for key in variants:
            label = name if key == name else f"{name} ({key.partition('@')[2]})"
            rows.append([label, cfg_style(key, modular)] + [cell(pipelines[key]["modes"].get(mode), name) for mode in MODES])
    counts = summary(record)
    foot = (f"{counts['classes']} DiT pipeline classes in diffusers {record.get('diffusers', '?')} "
            f"({counts['modular']} of them Modular Diffusers pipelines); "
            f"{counts['with recipe']} with a tiny-pipeline recipe; {counts['verified in every mode']} verified in every "
            f"applicable mode (verified {record.get('date', 'never')} by `{record.get('command', 'tools/verify_pipelines.py')}`).")
    notes = [f"[{number}] {reason}" for reason, number in reasons.items()]
    if markdown:
        lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(f"`{c}`" if i == 0 and " (" not in c else c for i, c in enumerate(row)) + " |"
                  for row in rows]
        lines += ["", foot, ""] + [f"{note}  " for note in notes]
        return "\n".join(lines).rstrip()
    widths = [max(len(str(r[i])) for r in rows + [HEADER]) for i in range(len(HEADER))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(HEADER, widths)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines + ["", foot] + notes)
