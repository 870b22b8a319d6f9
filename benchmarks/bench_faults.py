"""Fault injection through the real `paradiff generate` command: how long from the fault until every rank has exited,
the exit code, the one-line messages, and whether any worker process is left behind.

    .venv/bin/python benchmarks/bench_faults.py              # every fault at --timeout 10 and 30 (~3 min on 2 cores)
    .venv/bin/python benchmarks/bench_faults.py --timeouts 10 --faults raise,exit

Faults (on the embedded default, the tiny FLUX.2 pipeline, `--ulysses 2`, 64x64, 4 steps):

- raise:     PARADIFF_INJECT_FAULT=1:raise  rank 1 raises in its second transformer forward (inside the first block)
- exit:      PARADIFF_INJECT_FAULT=1:exit   rank 1 calls os._exit(9) at the same point (a killed rank)
- seed:      PARADIFF_INJECT_FAULT=1:seed   rank 1 starts from other latents (its first forward's input + 1)
- truncated: a copy of the embedded pipeline folder whose transformer/*.safetensors is cut to half its size
- plus the same raise/exit on rank 3 of tp=2 x ulysses=2 (4 ranks), and a run without fault for reference.

The fault's moment is the time.time() the rank writes to PARADIFF_FAULT_STAMP just before failing; for the truncated
shard (no hook fires) it is the moment the command starts. "Fault -> all exited" ends when the `paradiff` command
returns: the launcher returns only after every worker has exited (or been killed). Every run gets a unique --out
folder, which is on every worker's command line; `pgrep -f` on it right after the command returns (and 2 s later)
finds any worker left behind.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
TESTKIT = str(Path(__file__).resolve().parents[1] / "testkit")  # paradiff_testkit (docs/testing.md)
sys.path.insert(0, TESTKIT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTKIT, os.environ.get("PYTHONPATH")]))  # and its children

from _common import ForeignLoad, foreign_benchmarks, wait_for_quiet  # noqa: E402
from results import figure, write_result  # noqa: E402
# the real command, with the fault hooks of paradiff_testkit.faults installed in each worker
PARADIFF = [sys.executable, "-m", "paradiff_testkit.faults"]

CASES = {
    # name: (injected fault, extra generate arguments, model folder kind)
    "none": (None, ["--ulysses", "2"], "embedded"),
    "raise": ("1:raise", ["--ulysses", "2"], "embedded"),
    "exit": ("1:exit", ["--ulysses", "2"], "embedded"),
    "seed": ("1:seed", ["--ulysses", "2"], "embedded"),
    "truncated": (None, ["--ulysses", "2"], "truncated"),
    "raise-4ranks": ("3:raise", ["--tp", "2", "--ulysses", "2"], "embedded"),
    "exit-4ranks": ("3:exit", ["--tp", "2", "--ulysses", "2"], "embedded"),
}
DESCRIPTION = {
    "none": "no fault (reference)",
    "raise": "rank 1 raises mid-forward (`1:raise`)",
    "exit": "rank 1 killed mid-forward (`1:exit`, os._exit(9))",
    "seed": "rank 1 other seed (`1:seed`)",
    "truncated": "truncated transformer shard (half size)",
    "raise-4ranks": "rank 3 raises mid-forward, tp=2 x ulysses=2 (`3:raise`)",
    "exit-4ranks": "rank 3 killed mid-forward, tp=2 x ulysses=2 (`3:exit`)",
}


def embedded_folder() -> Path:
    subprocess.run(PARADIFF + ["generate", "--steps", "1", "--out", str(REPO / "out/bench_faults/warmup")],
                   cwd=REPO, capture_output=True)  # builds the embedded default if missing, warms the page cache
    folder = Path(os.environ.get("PARADIFF_CACHE", REPO / ".cache/paradiff")) / "tiny-flux2-pipeline"
    if not (folder / "model_index.json").is_file():
        raise SystemExit(f"embedded default not found at {folder}")
    return folder


def truncated_copy(source: Path, root: Path) -> tuple[Path, list[str]]:
    target = root / "truncated-pipeline"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    cut = []
    for file in sorted((target / "transformer").glob("diffusion_pytorch_model*.safetensors")):
        size = file.stat().st_size
        os.truncate(file, size // 2)
        cut.append(f"{file.name}: {size} -> {size // 2} bytes")
    if not cut:
        raise SystemExit(f"no transformer safetensors in {target}")
    return target, cut


def leftovers(marker: str) -> list[str]:
    found = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout.strip().splitlines()
    return [line for line in found if "pgrep" not in line]


def run_case(name: str, timeout: float, root: Path, truncated: Path) -> dict:
    fault, extra, kind = CASES[name]
    tag = f"{name}-T{timeout:g}-{uuid.uuid4().hex[:8]}"
    out = root / "runs" / tag
    stamp = root / "runs" / f"{tag}.stamp"
    argv = ["generate"] + ([str(truncated)] if kind == "truncated" else []) + extra + [
        "--timeout", f"{timeout:g}", "--out", str(out)]
    env = dict(os.environ)
    for key in ("PARADIFF_INJECT_FAULT", "PARADIFF_FAULT_STAMP", "PARADIFF_DEBUG", "OMP_NUM_THREADS"):
        env.pop(key, None)
    if fault:
        env.update(PARADIFF_INJECT_FAULT=fault, PARADIFF_FAULT_STAMP=str(stamp))
    overlap = foreign_benchmarks()
    start = time.time()
    with ForeignLoad() as foreign:
        try:
            proc = subprocess.run(PARADIFF + argv, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=timeout + 300)
            rc, stderr, stdout = proc.returncode, proc.stderr, proc.stdout
        except subprocess.TimeoutExpired as exc:
            rc, stderr, stdout = "hung (killed by the benchmark)", str(exc.stderr or ""), str(exc.stdout or "")
    end = time.time()
    overlap += foreign_benchmarks()
    if foreign.seconds > 0.10 * (end - start):
        overlap.append(f"{foreign.seconds:.1f} CPU s of other processes during {end - start:.1f} s")
    left_now = leftovers(str(out))
    time.sleep(2)
    left_later = leftovers(str(out))
    fault_at = float(stamp.read_text()) if stamp.is_file() else None
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return {
        "case": name, "fault": fault, "timeout_s": timeout, "argv": argv, "rc": rc,
        "start": start, "fault_at": fault_at, "end": end,
        "fault_to_exit_s": end - (fault_at if fault_at is not None else start),
        "from": "fault stamp" if fault_at is not None else "command start",
        "total_s": end - start,
        "stderr_lines": lines,
        "paradiff_lines": [line for line in lines if line.startswith("paradiff:")],
        "other_lines": [line for line in lines if not line.startswith("paradiff:")],
        "stdout_lines": [line.strip() for line in stdout.splitlines() if line.strip()],
        "left_right_after": left_now, "left_after_2s": left_later, "overlapping_benchmarks": sorted(set(overlap)),
        "foreign_cpu_s": foreign.seconds,
    }


def markdown(rows: list[dict]) -> str:
    """The table (who printed which line), then the lines themselves for the first run of each fault."""
    out = ["| fault | --timeout (s) | fault -> every rank exited (s) | measured from | command wall (s) | exit code "
           "| workers left | lines on stderr (who) |", "|---|---|---|---|---|---|---|---|"]
    for name in CASES:
        for row in (r for r in rows if r["case"] == name):
            who = []
            for line in row["stderr_lines"]:
                match = re.match(r"paradiff: rank (\d+) (failed|exited)", line)
                who.append(f"rank {match.group(1)} {'failed' if match.group(2) == 'failed' else '(launcher)'}"
                           if match else "other")
            left = len(row["left_right_after"]) + len(row["left_after_2s"])
            out.append(
                f"| {DESCRIPTION[name]} | {row['timeout_s']:g} | {row['fault_to_exit_s']:.2f} | {row['from']} "
                f"| {row['total_s']:.2f} | {row['rc']} | {left} | {len(who)}: {', '.join(who) or '-'} |"
            )
    out.append("")
    for name in CASES:
        first = next((r for r in rows if r["case"] == name), None)
        if first is None or not first["stderr_lines"]:
            continue
        out.append(f"{DESCRIPTION[name]}, --timeout {first['timeout_s']:g}:")
        out.append("```")
        out += [line if len(line) <= 240 else line[:240] + " [...]" for line in first["stderr_lines"]]
        out.append("```")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default="none,raise,exit,seed,truncated,raise-4ranks,exit-4ranks",
                        help=f"comma-separated, from {list(CASES)}")
    parser.add_argument("--timeouts", default="10,30", help="comma-separated --timeout values (s)")
    parser.add_argument("--out", default="out/bench_faults")
    parser.add_argument("--wait", type=float, default=1800.0,
                        help="seconds to wait at start for other benchmarks/bench_* processes to finish")
    parser.add_argument("--overlap-retries", type=int, default=3,
                        help="re-measure a case (after waiting) when another benchmark ran during it")
    args = parser.parse_args()
    wait_for_quiet(timeout_s=args.wait, window_s=5.0, quiet_s=30.0, alone=True)
    root = (REPO / args.out).resolve()
    shutil.rmtree(root / "runs", ignore_errors=True)
    (root / "runs").mkdir(parents=True)
    import torch

    print(f"# {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {os.cpu_count()}-core CPU "
          f"({platform.machine()}), Python {platform.python_version()}, torch {torch.__version__}, gloo", flush=True)
    truncated, cut = truncated_copy(embedded_folder(), root)
    print(f"truncated copy: {truncated} ({'; '.join(cut)})", flush=True)
    rows = []
    for timeout in [float(t) for t in args.timeouts.split(",")]:
        for name in args.faults.split(","):
            if name == "none" and timeout != float(args.timeouts.split(",")[0]):
                continue  # the reference run once is enough
            for attempt in range(args.overlap_retries + 1):
                row = run_case(name, timeout, root, truncated)
                if not row["overlapping_benchmarks"] or attempt == args.overlap_retries:
                    break
                print(f"  {name} T={timeout:g}: another benchmark ran meanwhile; measuring again", flush=True)
                wait_for_quiet(timeout_s=args.wait, window_s=5.0, quiet_s=30.0, alone=True)
            rows.append(row)
            print(f"  {name:13s} T={timeout:g}: {row['fault_to_exit_s']:.2f} s from {row['from']}, rc={row['rc']}, "
                  f"left={len(row['left_right_after'])}/{len(row['left_after_2s'])}, "
                  f"{len(row['stderr_lines'])} stderr line(s)", flush=True)
    (root / "results.json").write_text(json.dumps(rows, indent=2))
    print("\ncommand: PARADIFF_INJECT_FAULT=RANK:KIND PARADIFF_FAULT_STAMP=FILE python -m paradiff_testkit.faults "
          "generate [FOLDER] "
          "--ulysses 2 [--tp 2] --timeout T --out UNIQUE_DIR\n")
    print(markdown(rows))
    problems = [r["case"] for r in rows
                if r["left_right_after"] or r["left_after_2s"] or (r["case"] != "none") == (r["rc"] == 0)]
    for row in rows:
        if row["overlapping_benchmarks"]:
            print(f"overlap: {row['case']} T={row['timeout_s']:g} ran next to {row['overlapping_benchmarks']}")
    if problems:
        print(f"\nunexpected: {problems} (worker left behind, or wrong exit status)")
    figures = [figure(f"{name}: fault -> every rank exited, worst over --timeout {args.timeouts}",
                      max(r["fault_to_exit_s"] for r in rows if r["case"] == name), "s",
                      note=f"measured from {next(r['from'] for r in rows if r['case'] == name)}")
               for name in dict.fromkeys(r["case"] for r in rows) if name != "none"]
    left = sum(len(r["left_right_after"]) + len(r["left_after_2s"]) for r in rows)
    figures.append(figure("worker processes left after any fault", left, "count", "== 0"))
    write_result("bench_faults", "Fault injection: time from a rank's fault until every rank exited (tiny FLUX.2, "
                 "paradiff generate)", figures)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
