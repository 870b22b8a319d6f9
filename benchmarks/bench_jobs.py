"""What the durable job store of `paradiff serve` (serve/jobstore.py: a SQLite file in WAL mode, or PostgreSQL) adds to
a video job: the store's own writes for one job's life (create, submit, start, a progress write per denoising step's
event, the result files stored, the retention pass), timed in-process with the real scheduler and no pipeline. The
PostgreSQL figure runs against a server started for it on loopback (Debian's package; the test kit's). Written to
benchmarks/results/bench_jobs.json.

    python benchmarks/bench_jobs.py [--jobs 200] [--steps 30] [--rounds 5] [--backend sqlite|postgresql|both]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "testkit"))

from results import figure, write_result  # noqa: E402

from paradiff.serve.jobs import Jobs, keep_results  # noqa: E402
from paradiff.serve.jobstore import JobStore  # noqa: E402
from paradiff.serve.protocol import Limits  # noqa: E402
from paradiff.serve.scheduler import Scheduler  # noqa: E402

LIMITS = Limits(kind="video", model_name="wan", default_size=(32, 32), default_frames=5, max_frames=10,
                accepts=frozenset({"num_frames"}), max_steps=1000)
RESULT = {"files": [{"mime": "video/mp4", "data": b"\0" * 4096}, {"mime": "image/png", "data": b"\0" * 512}],
          "replica": 0, "started": 0.0, "finished": 0.0}


def one_round(where: str, jobs_count: int, steps: int) -> float:
    """Seconds per job for `jobs_count` jobs run one after another, each with `steps` progress writes."""
    scheduler = Scheduler(max_queue=jobs_count + 1)
    jobs = Jobs(JobStore(where), keep_results("50"), scheduler)
    jobs.ready(LIMITS)
    started = time.perf_counter()
    for index in range(jobs_count):
        jobs.create({"prompt": f"a fox {index}", "steps": steps}, LIMITS, max_queue=jobs_count + 1)
        (item,) = scheduler.next_round(1, 0)["batches"][0]
        jobs.started([item["id"]])
        ticket = scheduler.running(item["id"])
        for step in range(steps):  # each step's event, as rank 0 hands it on: the job store writes its progress
            ticket.emit({"type": "step", "step": step + 1, "steps": steps, "done": step + 1, "total": steps})
        scheduler.complete(item["id"], 200, RESULT)
    seconds = (time.perf_counter() - started) / jobs_count
    jobs.store.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    args = parser.parse_args()
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    with ExitStack() as stack:
        if "postgresql" in backends:
            from paradiff_testkit.postgres import postgres_server

            server = stack.enter_context(postgres_server(fsync=True))  # PostgreSQL's defaults: commits on disk
        per_job: dict[str, list[float]] = {backend: [] for backend in backends}
        for _ in range(args.rounds):  # the backends interleaved, a new store each round
            for backend in backends:
                with tempfile.TemporaryDirectory() as folder:
                    where = str(Path(folder) / "jobs.db") if backend == "sqlite" else server.new_database()
                    per_job[backend].append(one_round(where, args.jobs, args.steps))
    figures = []
    for backend in backends:
        median_ms = statistics.median(per_job[backend]) * 1000
        name = f"store writes per {args.steps}-step video job, {LABELS[backend]}"
        print(f"{name}: {median_ms:.2f} ms")
        figures.append(figure(name, round(median_ms, 2), "ms", "<= 30",
                              note=f"create, start, a progress write per step, result files, retention; median of "
                                   f"{args.rounds} rounds of {args.jobs} jobs; goal: 1% of a {args.steps}-step job "
                                   "at 0.1 s per step"))
    write_result("bench_jobs", "the job store's cost per video job",
                 figures)


LABELS = {"sqlite": "SQLite file", "postgresql": "PostgreSQL on loopback, fsync on"}


if __name__ == "__main__":
    main()
