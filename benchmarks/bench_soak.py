"""`paradiff serve` soak and cancellation latency, on the embedded demo pipeline at tp2 (a real server on 127.0.0.1).

    .venv/bin/python benchmarks/bench_soak.py                       # 1,000 requests + 5 cancellations
    .venv/bin/python benchmarks/bench_soak.py --requests 200 --cancellations 3

Soak: `--requests` small requests (64x64, 1 step, one client after the other); at request 10, 100 and the last,
the store's key count (paradiff_store_keys) and each rank's RSS (paradiff_rank_rss_bytes) from /metrics; p50 / p99
of the client's latency. Cancellation: a request of 5000 steps whose client hangs up once it runs; the latency is
from the hang-up to the moment the next 1-step request starts on the ranks (its `started` in requests.jsonl), and
the time to its answer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))  # paradiff_testkit (docs/testing.md)

from _common import machine_line  # noqa: E402
from results import figure, write_result  # noqa: E402

from paradiff_testkit.serve import ServerProcess, images_of  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def gauges(server: ServerProcess, name: str) -> dict[str, float]:
    found = {}
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line[len(name):].rpartition(" ")
            found[labels.strip("{}").replace('rank="', "").replace('"', "") or "-"] = float(value)
    return found


def wait_for(server: ServerProcess, name: str, value: float, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while gauges(server, name).get("-") != value:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not reach {value}")
        time.sleep(0.005)


def soak(server: ServerProcess, requests: int) -> dict:
    marks, latencies = {}, []
    checkpoints = {10, 100, requests}
    for index in range(1, requests + 1):
        started = time.monotonic()
        images_of(server.generate(prompt="a red circle", seed=index, steps=1))
        latencies.append(time.monotonic() - started)
        if index in checkpoints:
            marks[index] = {"keys": gauges(server, "paradiff_store_keys")["-"],
                            "rss_mb": {rank: round(value / 2**20, 1)
                                       for rank, value in gauges(server, "paradiff_rank_rss_bytes").items()}}
    ordered = sorted(latencies)
    return {"marks": marks, "p50": statistics.median(latencies), "p99": ordered[int(0.99 * (len(ordered) - 1))]}


def cancellation(server: ServerProcess, rounds: int) -> list[dict]:
    found = []
    for index in range(rounds):
        cancelled = gauges(server, "paradiff_requests_cancelled_total")["-"]
        body = json.dumps({"prompt": "a yellow square", "steps": 5000}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            client.sendall(f"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            wait_for(server, "paradiff_requests_running", 1)
            time.sleep(0.5)  # a few steps in
            hung_up, hung_up_wall = time.monotonic(), time.time()
        images_of(server.generate(prompt="a red circle", seed=index, steps=1))
        answered = time.monotonic() - hung_up
        assert gauges(server, "paradiff_requests_cancelled_total")["-"] == cancelled + 1
        started = server.log()[-1]["started"]
        found.append({"to_next_start_s": started - hung_up_wall, "to_next_answer_s": answered})
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--cancellations", type=int, default=5)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, {machine_line()}")
    with tempfile.TemporaryDirectory() as folder:
        server = ServerProcess(Path(folder), "--tp", "2", "--steps", "1", "--max-steps", "5000")
        try:
            server.wait_ready()
            started = time.monotonic()
            result = soak(server, args.requests)
            print(f"soak: {args.requests} requests in {time.monotonic() - started:.0f} s, "
                  f"p50 {result['p50'] * 1000:.0f} ms, p99 {result['p99'] * 1000:.0f} ms")
            for index, mark in sorted(result["marks"].items()):
                print(f"  after request {index}: store keys {mark['keys']:.0f}, RSS MB by rank {mark['rss_mb']}")
            cancels = cancellation(server, args.cancellations)
            print("cancellation at tp2 (hang-up -> next request starts on the ranks / answered), s: "
                  + ", ".join(f"{c['to_next_start_s']:.3f} / {c['to_next_answer_s']:.3f}" for c in cancels))
            print(f"  median {statistics.median(c['to_next_start_s'] for c in cancels):.3f} s to start, "
                  f"{statistics.median(c['to_next_answer_s'] for c in cancels):.3f} s to answer")
        finally:
            server.stop()
    last, first = max(result["marks"]), min(result["marks"])
    rank = min(result["marks"][last]["rss_mb"])  # the lowest rank's label
    write_result("bench_soak", f"paradiff serve soak: {args.requests} requests at tp2, and cancellation latency", [
        figure(f"store keys after {last} requests", result["marks"][last]["keys"], "count",
               note=f"at request {first}: {result['marks'][first]['keys']:.0f}"),
        figure(f"RSS growth from request {first} to {last}, rank {rank}",
               round(result["marks"][last]["rss_mb"][rank] - result["marks"][first]["rss_mb"][rank], 1), "MB"),
        figure("hang-up to the next request's start, median",
               round(statistics.median(c["to_next_start_s"] for c in cancels), 3), "s",
               note=f"{len(cancels)} cancellations"),
    ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
