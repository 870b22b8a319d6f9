"""How soon a video job of `paradiff serve` shows it runs: the time from OpenAI's `client.videos.create` to the job's
first `in_progress` status, and to its first real step progress (`progress` >= 1: a denoising step's event has come
from the replica's output rank through the store to the job store), median over several jobs, each sent to an idle
server (the previous one completed) on a tiny Wan 2.2 pipeline. The client polls `videos.retrieve` as fast as the
server answers, so each time is an upper bound by one retrieve. Written to benchmarks/results/bench_job_start.json.

    python benchmarks/bench_job_start.py [--jobs 7] [--steps 8] [--tp 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))  # paradiff_testkit (docs/testing.md)

from results import figure, write_result  # noqa: E402

from paradiff_testkit.pipelines import save_pipeline  # noqa: E402
from paradiff_testkit.serve import ServerProcess  # noqa: E402

VIDEO = ["--frames", "5", "--height", "32", "--width", "32", "--fps", "8"]


def one_job(client, steps: int) -> dict[str, float]:
    """Seconds from create to: its answer, in_progress, progress >= 1, completed."""
    started = time.perf_counter()
    video = client.videos.create(prompt="a fox", size="32x32", extra_body={"steps": steps})
    times = {"answer": time.perf_counter() - started}
    assert video.status == "queued", video
    deadline = started + 600
    while "completed" not in times:
        seen = client.videos.retrieve(video.id)
        now = time.perf_counter() - started
        if seen.status == "failed":
            raise RuntimeError(f"job {video.id} failed: {seen.error}")
        if seen.status in ("in_progress", "completed"):
            times.setdefault("in_progress", now)
        if seen.progress >= 1:
            times.setdefault("progress", now)
        if seen.status == "completed":
            times["completed"] = now
        assert time.perf_counter() < deadline, f"job {video.id} did not complete within 600 s"
    return times


def main() -> None:
    import openai

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        model = save_pipeline("wan2.2", root / "wan2.2")
        server = ServerProcess(root, str(model), *VIDEO, "--steps", str(args.steps), "--tp", str(args.tp))
        try:
            server.wait_ready(timeout_s=600)
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            one_job(client, args.steps)  # warm-up: the first call's one-time costs are not a job's start
            runs = [one_job(client, args.steps) for _ in range(args.jobs)]
        finally:
            server.stop()
    median = {key: statistics.median(run[key] for run in runs) * 1000 for key in runs[0]}
    for key, value in median.items():
        print(f"create -> {key}: median {value:.1f} ms ({[round(run[key] * 1000, 1) for run in runs]})")
    note = (f"median of {args.jobs} jobs after one warm-up, each to an idle server; tiny Wan 2.2, 32x32, 5 frames, "
            f"{args.steps} steps, tp{args.tp}; polled with videos.retrieve")
    write_result("bench_job_start", "a video job's start as OpenAI's client sees it (create -> in_progress -> first "
                                    "step's progress)", [
        figure("videos.create answered (status queued)", round(median["answer"], 1), "ms", "<= 100", note=note),
        figure("videos.create -> first in_progress", round(median["in_progress"], 1), "ms", "<= 250",
               note=note + "; goal: the dispatcher hands an idle replica its job within a few polls"),
        figure("videos.create -> first progress >= 1 (a step's event)", round(median["progress"], 1), "ms",
               note=note + "; includes the replica taking the job, its text encoding and its first "
                                 f"denoising step (create -> completed: {median['completed']:.0f} ms)"),
    ])


if __name__ == "__main__":
    main()
