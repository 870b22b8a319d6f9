"""`paradiff serve` against `paradiff generate` per request, on the embedded demo pipeline (64x64, 8 steps).

    .venv/bin/python benchmarks/bench_serve.py                  # ~4 min on 2 cores
    .venv/bin/python benchmarks/bench_serve.py --rounds 3 --requests 8

Configurations, each a real server on 127.0.0.1 asked by 4 concurrent httpx clients:

- one replica (1 process), --max-batch 1
- one replica (1 process), --max-batch 2: waiting requests of the same size and steps share one pipeline call
- dp2: two replicas (2 processes)
- tp2: one replica split over 2 processes

Per configuration and round: requests per minute over the load, p50 / p95 latency, and the server's overhead per
request = latency - the pipeline call's own time (the output rank's span in requests.jsonl) - the time it queued
behind other requests, measured on a separate run of sequential requests (one client, nothing queued).
`generate` per request = the whole `paradiff generate` command for one prompt (start, load, one image).
Rounds are interleaved (every configuration once per round); medians over rounds.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from paradiff.testing.serve import ServerProcess, images_of

CONFIGS = {
    "1 replica": ["--max-batch", "1"],
    "1 replica, batch 2": ["--max-batch", "2"],
    "dp2": ["--dp", "2"],
    "tp2": ["--tp", "2"],
}
PROMPTS = ["a red circle on a blue background, top left", "a yellow square on a green background, bottom right"]


def load(server: ServerProcess, clients: int, requests: int) -> dict:
    latencies: list[float] = []
    lock = threading.Lock()

    def client(number: int) -> None:
        import httpx

        with httpx.Client(base_url=server.url, timeout=300) as http:
            for index in range(requests):
                started = time.monotonic()
                images_of(http.post("/v1/images/generations",
                                    json={"prompt": PROMPTS[index % 2], "seed": number * 100 + index}))
                with lock:
                    latencies.append(time.monotonic() - started)

    threads = [threading.Thread(target=client, args=(number,)) for number in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - started
    return {"rpm": 60 * len(latencies) / wall, "p50": statistics.median(latencies),
            "p95": float(np.percentile(latencies, 95))}


def overhead(server: ServerProcess, count: int) -> float:
    """Median of (latency - pipeline span) over `count` sequential requests, as a fraction of the span."""
    before = len(server.log())
    for index in range(count):
        images_of(server.generate(prompt=PROMPTS[index % 2], seed=1000 + index))
    entries = server.log()[before:]
    return statistics.median((e["latency_s"] - (e["finished"] - e["started"])) / (e["finished"] - e["started"])
                             for e in entries)


def generate_once(folder: Path) -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "paradiff.cli", "generate", "--prompt", PROMPTS[0], "--out", str(folder)],
                   check=True, capture_output=True, timeout=600)
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=6, help="per client")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    generate_s: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_number in range(args.rounds):
            for name, flags in CONFIGS.items():
                folder = Path(tmp) / f"{round_number}-{len(results[name])}-{name.replace(' ', '_').replace(',', '')}"
                folder.mkdir()
                server = ServerProcess(folder, *flags, fresh=True)  # a user's start, imports included
                try:
                    started = time.monotonic()
                    server.wait_ready(600)
                    ready_s = time.monotonic() - started
                    images_of(server.generate(prompt=PROMPTS[0]))  # warm
                    measured = load(server, args.clients, args.requests)
                    measured["overhead"] = overhead(server, 6)
                    measured["ready_s"] = ready_s
                finally:
                    server.stop(120)
                results[name].append(measured)
                print(f"round {round_number} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in measured.items()),
                      flush=True)
            generate_s.append(generate_once(Path(tmp) / f"generate-{round_number}"))
            print(f"round {round_number} generate per request: {generate_s[-1]:.2f} s", flush=True)
    median = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in results.items()}
    base = median["1 replica"]["rpm"]
    print(f"\n{datetime.date.today()} {platform.node()} {platform.processor() or platform.machine()}, "
          f"{args.rounds} rounds, {args.clients} clients x {args.requests} requests")
    print("| configuration | requests/min | vs 1 replica | p50 latency (s) | p95 latency (s) | server overhead "
          "per request | ready after (s) |")
    print("|---|---|---|---|---|---|---|")
    for name, m in median.items():
        print(f"| serve, {name} | {m['rpm']:.1f} | {m['rpm'] / base:.2f}x | {m['p50']:.2f} | {m['p95']:.2f} | "
              f"{100 * m['overhead']:.1f}% | {m['ready_s']:.1f} |")
    per_request = statistics.median(generate_s)
    print(f"| `paradiff generate` per request (1 process, start + load + 1 image) | {60 / per_request:.1f} | "
          f"{60 / per_request / base:.2f}x | {per_request:.2f} | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
