"""`paradiff bench`: one `generate` run per configuration, summarised as a table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

from paradiff.cli.args import CliError
from paradiff.config import parse_mode


def bench(args: argparse.Namespace, generate: Callable[[list[str]], int]) -> int:
    """Run `generate(argv)` for each configuration of `args.configs` and print a table of the reports."""
    rows = []
    for spec in args.configs.split(","):
        try:
            # '+' joins the degrees here: an 'x' would read as a multiplication in a shell's list of configs
            degrees = parse_mode(spec.replace("+", "x"))
        except ValueError as error:
            raise CliError(f"bad config {spec!r}: use '+'-joined key=value, e.g. tp=2+ulysses=2 ({error})") from None
        out = Path(args.out) / spec.replace("=", "").replace("+", "_")
        argv = ["generate"] + ([args.model] if args.model else []) + [
            "--steps", str(args.steps), "--height", str(args.height), "--width", str(args.width), "--out", str(out)]
        for key in ("tp", "ulysses", "ring", "cfg", "data"):
            argv += ["--dp" if key == "data" else f"--{key}", str(degrees[key])]
        if args.frames is not None:
            argv += ["--frames", str(args.frames)]
        if generate(argv):
            rows.append((spec, "failed", "failed", "failed"))
            continue
        report = json.loads((out / "report.json").read_text())
        step = max(s["step_s_median"] for s in report["ranks"])
        peak = max(s["peak_memory_bytes"] for s in report["ranks"]) / 2**30
        rows.append((spec, f"{step * args.steps * 1000:.1f}", f"{1 / step:.2f}", f"{peak:.2f}"))
    print("| mode | time / image, denoising (ms) | steps / s | peak memory / rank (GiB) | resolution |")
    print("|---|---|---|---|---|")
    for spec, ms, sps, peak in rows:
        print(f"| {spec} | {ms} | {sps} | {peak} | {args.height}x{args.width} |")
    return 0
