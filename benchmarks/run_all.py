"""Run every benchmark script in this folder (bench_*.py), one after another, each in its own Python process.

    .venv/bin/python benchmarks/run_all.py [--only NAME[,NAME]]

Each script runs with its default arguments.

Exits non-zero if any script failed; the others still run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated script names (with or without .py) to run")
    args = parser.parse_args()
    scripts = sorted(HERE.glob("bench_*.py"))
    if args.only:
        wanted = {name if name.endswith(".py") else f"{name}.py" for name in args.only.split(",") if name}
        scripts = [s for s in scripts if s.name in wanted]
    failed = []
    for script in scripts:
        print(f"\n=== {script.name} ===", flush=True)
        start = time.time()
        code = subprocess.call([sys.executable, str(script)], cwd=HERE.parent)
        print(f"=== {script.name}: exit {code}, {time.time() - start:.0f}s ===", flush=True)
        if code != 0:
            failed.append(script.name)
    if failed:
        print(f"failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
