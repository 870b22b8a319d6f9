"""What a run tells its user: one-line console messages and report.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def say(line: str) -> None:
    """One write per line, so lines of concurrent ranks never interleave mid-line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def write_report(args: argparse.Namespace, out: Path, model: str, prompts: list[str], run: dict,
                 gathered: list[dict], compare: float | None, compared: int = 0) -> dict:
    """Write report.json from every rank's statistics (`gathered`) and print the summary lines; returns the report."""
    import numpy as np

    report = {
        "model": model,
        "config": {"tp": args.tp, "ulysses": args.ulysses, "ring": args.ring, "cfg": args.cfg, "dp": args.dp,
                   **run},
        "resolution": [args.height, args.width],
        "steps": args.steps,
        "dtype": args.dtype,
        "seed": args.seed,
        "prompts": prompts,
        "ranks": gathered,
        "images": {k: v for s in gathered for k, v in s["images"].items()},
    }
    if compare is not None:
        report["max_abs_diff_vs_single_process"] = compare
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    steps = [s["step_s_median"] for s in gathered if s["step_s_median"] is not None]
    load_s = gathered[0]["load_s"]
    print(f"paradiff: {len(report['images'])} image(s) in {out}; load {load_s:.2f} s; "
          f"median step {np.median(steps):.3f} s; world {run['world_size']} "
          f"(tp={args.tp} ulysses={args.ulysses} ring={args.ring} cfg={args.cfg} dp={args.dp})")
    for index, path in sorted(report["images"].items()):
        print(f"paradiff:   {Path(path).name}  {prompts[int(index)]}")
    if compare is not None:
        print(f"paradiff: max |difference| to the single-process image: {compare:.2e} "
              f"({compare * 255:.2g} of a 255 level, over {compared} image(s)); side by side in {out / 'compare.png'}")
    return report
