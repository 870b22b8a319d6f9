"""The coverage table: every diffusers transformer class paradiff has a built-in plan for, which modes it supports,
and the largest difference measured when it was last verified (`tools/verify_plans.py` writes
`plans/verified.json`; `paradiff plans` prints it; docs/coverage.md carries it); then the installed diffusers' transformer
classes that have no built-in plan, so the table says what is missing too."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator

from paradiff.plans import families

VERIFIED = Path(__file__).parents[1] / "plans" / "verified.json"
MODES = ("tp2", "ulysses2", "ring2", "unified2x2", "tp2xulysses2")


def load_verified() -> dict:
    return json.loads(VERIFIED.read_text()) if VERIFIED.is_file() else {"classes": {}}


def coverage_table(markdown: bool = False) -> str:
    verified = load_verified()
    rows = []
    for family in families():
        for class_name in family.model_classes:
            record = verified["classes"].get(class_name, {})
            modes = record.get("modes", {})

            def mark(mode: str, needs: str) -> str:
                if family.plan(needs) is None:
                    return "no"
                if mode not in modes:
                    return "plan"
                return "yes" if modes[mode] <= 1e-5 else f"FAIL {modes[mode]:.0e}"

            worst = max(modes.values()) if modes else None
            uneven, share = uneven_heads(record.get("uneven"))
            rows.append([
                class_name, family.name,
                mark("tp2", "tensor"), mark("ulysses2", "context"),
                mark("ring2", "context"), mark("unified2x2", "context"),
                mark("tp2xulysses2", "context"), "yes",
                record.get("auto", "-"),
                "-" if worst is None else f"{worst:.1e}",
                uneven, share,
            ])
    planned = {row[0] for row in rows}
    for class_name in unplanned_transformers(planned):
        rows.append([class_name, "none", "no", "no", "no", "no", "no", "yes", "-", "-", "-", "-"])
    header = ["class", "plan file", "TP", "Ulysses", "ring", "unified", "TP x CP", "CFG", "auto TP = built-in",
              "max diff", "uneven heads tp2 / tp3", "FLOP share"]
    when = verified.get("date", "never")
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(f"`{c}`" if i == 0 else c for i, c in enumerate(row)) + " |" for row in rows]
        lines.append("")
        lines.append(f"{len(rows)} classes; verified {when} by `{verified.get('command', 'tools/verify_plans.py')}` "
                     "(relative max difference against single-process, fp32, batch 2, uneven token counts). "
                     "\"plan\": a built-in plan exists but this mode was not verified; CFG parallelism works on "
                     "every model (it splits the pipeline's two transformer calls). \"auto TP = built-in\": of the "
                     "built-in TP plan's entries in the block stacks, how many `plan=\"auto\"` derives identically. "
                     "Plan file \"none\": no built-in plan; try `plan=\"auto\"` / `cp_plan=\"auto\"` and check "
                     "the result with `paradiff check-plan`. \"uneven heads\": the head counts verified at tp2 "
                     "(of 3, 5, 7) and at tp3 (of 4, 5, 7), each rank holding whole heads, on "
                     f"{verified.get('uneven_date', 'never')} (`python tools/verify_plans.py --uneven`); a count "
                     "missing is one no config of the tiny example takes, or that the plan refuses (an attention "
                     "with fewer heads than ranks); \"FLOP share\": the largest per-rank share of the single "
                     "process's projection FLOPs in the block stacks over those runs.")
        return "\n".join(lines)
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append(f"{len(rows)} classes; verified {when}.")
    return "\n".join(lines)


def uneven_heads(record: dict | None) -> tuple[str, str]:
    """The uneven-head sweep's cell ("3,5,7 / 4,5,7": the head counts verified at tp2 / tp3) and FLOP share."""
    if not record:
        return "-", "-"
    cells, failed = [], False
    for mode in ("tp2", "tp3"):
        counts = []
        for label, value in sorted(record.items()):
            if label.startswith(f"{mode}@"):
                if isinstance(value, float) and value <= 1e-5:
                    counts.append(label.split("@")[1])
                elif isinstance(value, float) or value.startswith(("failed", "wrong")):
                    failed = True
        cells.append(",".join(counts) or "none")
    share = record.get("flop_share")
    return ("FAIL " if failed else "") + " / ".join(cells), "-" if share is None else f"{share:.2f}"


def diffusers_classes(keep: Callable[[str], bool]) -> Iterator[tuple[str, type]]:
    """(name, class) of every class the installed diffusers exports under a name `keep` accepts; a name whose import
    fails (an optional dependency missing here) is left out."""
    import diffusers

    for name in dir(diffusers):
        if not keep(name):
            continue
        try:
            value = getattr(diffusers, name)
        except Exception:  # noqa: BLE001 - what an optional dependency's absence raises varies
            continue
        if isinstance(value, type):
            yield name, value


def unplanned_transformers(planned: set[str]) -> list[str]:
    """The installed diffusers' transformer model classes (name with Transformer or DiT, a ModelMixin, not a VAE)
    that no plan module names."""
    from diffusers import ModelMixin

    def candidate(name: str) -> bool:
        return name not in planned and bool(re.search(r"Transformer|DiT", name)) and not re.search(r"Vae|VAE", name)

    return sorted(name for name, value in diffusers_classes(candidate) if issubclass(value, ModelMixin))
