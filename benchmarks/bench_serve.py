"""`paradiff serve` against `paradiff generate` per request, on the embedded demo pipeline (64x64, 8 steps) or on a
larger FLUX.2-shaped pipeline folder (`--model flux2`: 8 heads x 64, 2 double + 4 single blocks, 32 M transformer
parameters, 128x128, 3 steps; the pipeline of BENCHMARKS.md's "End-to-end pipelines (b)", built here once, seeded).

    .venv/bin/python benchmarks/bench_serve.py                  # demo pipeline, ~4 min on 2 cores
    .venv/bin/python benchmarks/bench_serve.py --rounds 3 --requests 8
    .venv/bin/python benchmarks/bench_serve.py --model flux2 --rounds 2 --requests 3   # ~20 min on 2 cores
    .venv/bin/python benchmarks/bench_serve.py --cores     # how two busy processes share the cores (dp2 ceiling)

Configurations, each a real server on 127.0.0.1 asked by 4 concurrent httpx clients:

- one replica (1 process), --max-batch 1
- one replica (1 process), --max-batch 2: waiting requests of the same size and steps share one pipeline call
- dp2: two replicas (2 processes)
- tp2: one replica split over 2 processes

Per configuration and round: requests per minute over the load, p50 / p95 latency (client side), and the server's
overhead per request, from a separate run of sequential requests (one client, nothing queued): the client's latency
minus the pipeline call's own time (the output rank's span in requests.jsonl), over that span; the server-side figure
(the server's accepted -> answered time instead of the client's) is given too. Batching: the pipeline calls of a load that drew 2 images (requests with the same span in requests.jsonl) against
twice the single-image call. `generate` per request = the whole
`paradiff generate` command for one prompt (start, load, one image). Rounds are interleaved (every configuration
once per round, then one `generate`); medians over rounds. Before each configuration the script waits (at most
`--quiet-wait` s) for the machine to go quiet, and it records the CPU-seconds other processes used during each load
(machine busy time from /proc/stat minus the server's process tree and this script), and the CPU the server's
processes and this script's clients used: requests per CPU-minute (requests per minute / cores used) compares the
configurations' work per request when the share of the cores each got differs. On a shared machine read the ratios,
not the rates.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))  # paradiff_testkit (docs/testing.md)

from _common import cpu_seconds, machine_line, system_busy_seconds, wait_for_quiet  # noqa: E402
from results import figure, write_result  # noqa: E402
from bench_pipelines import LARGE_FLUX2, build_folder  # noqa: E402

from paradiff_testkit.serve import ServerProcess, images_of  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {  # --configs key: (label, server flags)
    "single": ("1 replica", ["--max-batch", "1"]),
    "batch2": ("1 replica, batch 2", ["--max-batch", "2"]),
    "dp2": ("dp2", ["--dp", "2"]),
    "tp2": ("tp2", ["--tp", "2"]),
}
PROMPTS = ["a red circle on a blue background, top left", "a yellow square on a green background, bottom right"]
# model: (size, steps); the demo's are the server's defaults for the embedded pipeline
MODELS = {"demo": ((64, 64), 8), "flux2": ((128, 128), 3)}


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU-seconds of process `root` and every live descendant (and the reaped children they waited
    for), from /proc/PID/stat."""
    ticks = os.sysconf("SC_CLK_TCK")
    parents, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = sum(int(v) for v in fields[11:15]) / ticks  # utime stime cutime cstime
    total = 0.0
    for pid, seconds in cpu.items():
        walk = pid
        while walk > 1 and walk != root:
            walk = parents.get(walk, 1)
        if walk == root:
            total += seconds
    return total


def load(server: ServerProcess, clients: int, requests: int) -> dict:
    latencies: list[float] = []
    lock = threading.Lock()

    def client(number: int) -> None:
        import httpx

        with httpx.Client(base_url=server.url, timeout=900) as http:
            for index in range(requests):
                started = time.monotonic()
                images_of(http.post("/v1/images/generations",
                                    json={"prompt": PROMPTS[index % 2], "seed": number * 100 + index}))
                with lock:
                    latencies.append(time.monotonic() - started)

    threads = [threading.Thread(target=client, args=(number,)) for number in range(clients)]
    before = len(server.log())
    busy0, tree0, own0 = system_busy_seconds(), tree_cpu_seconds(server.process.pid), cpu_seconds()
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - started
    ours = tree_cpu_seconds(server.process.pid) - tree0 + cpu_seconds() - own0
    foreign = max(0.0, system_busy_seconds() - busy0 - ours)
    # pipeline calls of the load: the requests that shared one call have the same replica and span
    calls: dict[tuple, int] = {}
    for entry in server.log()[before:]:
        key = (entry["replica"], entry["started"], entry["finished"])
        calls[key] = calls.get(key, 0) + 1
    pairs = [finished - started for (_, started, finished), count in calls.items() if count == 2]
    return {"rpm": 60 * len(latencies) / wall, "p50": statistics.median(latencies),
            "p95": float(np.percentile(latencies, 95)), "foreign_cores": foreign / wall, "ours_cores": ours / wall,
            "calls": len(calls), "pair_calls": len(pairs), "pair_span_s": statistics.median(pairs) if pairs else 0.0}


def _matmul_rate(size: int, queue) -> None:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    started, count = time.perf_counter(), 0
    while time.perf_counter() - started < 6:
        a @ b
        count += 1
    queue.put(count / (time.perf_counter() - started))


def cores_check(rounds: int = 2) -> None:
    """What two replicas could give on this machine at best: matmuls on one torch thread, in one process, then in
    two processes at once (a machine whose cores slow each other down caps dp2 below 2x)."""
    from paradiff.distributed.spawn import local_context

    context = local_context()  # the processes local ranks start as
    for size in (256, 1024):
        for number in range(rounds):
            rates = {}
            for processes in (1, 2):
                queue = context.Queue()
                workers = [context.Process(target=_matmul_rate, args=(size, queue)) for _ in range(processes)]
                for worker in workers:
                    worker.start()
                rates[processes] = statistics.mean(queue.get() for _ in workers)
                for worker in workers:
                    worker.join()
            print(f"{size} x {size} matmuls, round {number}: one process {rates[1]:.1f}/s, each of two at once "
                  f"{rates[2]:.1f}/s: two give {2 * rates[2] / rates[1]:.2f}x one", flush=True)


def overhead(server: ServerProcess, count: int) -> dict:
    """Medians over `count` sequential requests: the pipeline call's span, and (latency - span) / span with the
    client's latency and with the server's own (accepted -> answered)."""
    before = len(server.log())
    client_latency = []
    for index in range(count):
        started = time.monotonic()
        images_of(server.generate(prompt=PROMPTS[index % 2], seed=1000 + index))
        client_latency.append(time.monotonic() - started)
    entries = server.log()[before:]
    spans = [e["finished"] - e["started"] for e in entries]
    return {"span_s": statistics.median(spans),
            "overhead": statistics.median((c - s) / s for c, s in zip(client_latency, spans)),
            "overhead_server": statistics.median((e["latency_s"] - s) / s for e, s in zip(entries, spans))}


def generate_once(folder: Path, model_args: list[str]) -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "paradiff.cli", "generate", *model_args, "--prompt", PROMPTS[0],
                    "--out", str(folder)], check=True, capture_output=True, timeout=900)
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="demo",
                        help="demo: the embedded pipeline; flux2: the larger FLUX.2-shaped folder (built once)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=6, help="per client")
    parser.add_argument("--overhead-requests", type=int, default=6, help="sequential requests for the overhead")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    parser.add_argument("--batch-window", type=float, default=0.0,
                        help="the servers' --batch-window (s): how long a round waits for requests sent together to "
                             "join it (more replicas, or a batch); it changes nothing for 1 replica at batch 1")
    parser.add_argument("--quiet-wait", type=float, default=30.0,
                        help="seconds to wait at most, before each configuration, for the machine to go quiet")
    parser.add_argument("--cores", action="store_true",
                        help="only check how two busy processes share this machine's cores (dp2's ceiling), ~50 s")
    args = parser.parse_args()
    if args.cores:
        cores_check()
        return 0
    configs = dict(CONFIGS[key.strip()] for key in args.configs.split(","))
    (width, height), steps = MODELS[args.model]
    model_args = ["--height", str(height), "--width", str(width), "--steps", str(steps)]
    if args.model == "flux2":
        folder = build_folder("flux2", LARGE_FLUX2, REPO / ".cache" / "bench")
        model_args = [folder, *model_args]
        print(f"model: {folder}", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in configs}
    generate_s: list[float] = []
    began = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for round_number in range(args.rounds):
            for name, flags in configs.items():
                folder = Path(tmp) / f"{round_number}-{len(results[name])}-{name.replace(' ', '_').replace(',', '')}"
                folder.mkdir()
                quiet = wait_for_quiet(timeout_s=args.quiet_wait)
                server = ServerProcess(folder, *model_args, *flags, "--batch-window", str(args.batch_window),
                                       fresh=True)  # a user's start, imports included
                try:
                    started = time.monotonic()
                    server.wait_ready(900)
                    ready_s = time.monotonic() - started
                    images_of(server.generate(prompt=PROMPTS[0]))  # warm
                    measured = load(server, args.clients, args.requests)
                    measured.update(overhead(server, args.overhead_requests))
                    measured["ready_s"] = ready_s
                    measured["busy_before"] = quiet
                finally:
                    server.stop(300)
                results[name].append(measured)
                print(f"round {round_number} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in measured.items()),
                      flush=True)
            wait_for_quiet(timeout_s=args.quiet_wait)
            generate_s.append(generate_once(Path(tmp) / f"generate-{round_number}", model_args))
            print(f"round {round_number} generate per request: {generate_s[-1]:.2f} s", flush=True)
    median = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in results.items()}
    base = median[next(iter(median))]["rpm"]
    print(f"\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC (began "
          f"{datetime.datetime.fromtimestamp(began, datetime.timezone.utc):%H:%M}); {machine_line()}")
    print(f"model {args.model} {width}x{height}, {steps} steps; {args.rounds} rounds, {args.clients} clients x "
          f"{args.requests} requests; overhead from {args.overhead_requests} sequential requests; "
          f"--batch-window {args.batch_window:g}")
    print("| configuration | requests/min | vs 1 replica | p50 latency (s) | p95 latency (s) | pipeline call (s) | "
          "server overhead per request (client / server side) | ready after (s) | other processes' cores during "
          "the load | requests per CPU-minute (server and clients) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, m in median.items():
        print(f"| serve, {name} | {m['rpm']:.1f} | {m['rpm'] / base:.2f}x | {m['p50']:.2f} | {m['p95']:.2f} | "
              f"{m['span_s']:.2f} | {100 * m['overhead']:.1f}% / {100 * m['overhead_server']:.1f}% | "
              f"{m['ready_s']:.1f} | {m['foreign_cores']:.2f} | {m['rpm'] / m['ours_cores']:.1f} |")
    per_request = statistics.median(generate_s)
    for name, runs in results.items():
        pairs = [r for r in runs if r["pair_calls"]]
        if pairs:
            pair = statistics.median(r["pair_span_s"] for r in pairs)
            single = statistics.median(r["span_s"] for r in pairs)
            print(f"batching ({name}): {sum(r['pair_calls'] for r in runs)} of {sum(r['calls'] for r in runs)} "
                  f"pipeline calls under load drew 2 images, median {pair:.2f} s, against 2 x {single:.2f} s for "
                  f"a single-image call (sequential, same server): {pair / (2 * single):.2f}x the two single calls")
    print(f"| `paradiff generate` per request (1 process, start + load + 1 image) | {60 / per_request:.1f} | "
          f"{60 / per_request / base:.2f}x | {per_request:.2f} | | | | | | |")
    print("\nevery round (rpm; other processes' cores):")
    for name, runs in results.items():
        print(f"  {name}: " + "; ".join(f"{r['rpm']:.1f} ({r['foreign_cores']:.2f})" for r in runs))
    print(f"  generate: " + "; ".join(f"{s:.2f} s" for s in generate_s))
    first = next(iter(median))
    figures = [figure(f"server overhead per request, {name} (client side)", round(100 * m["overhead"], 1), "%",
                      "<= 3", note=f"{100 * m['overhead_server']:.1f}% inside the server; call {m['span_s']:.2f} s")
               for name, m in median.items()]
    figures += [figure(f"{name} / {first}, requests per minute", round(m["rpm"] / base, 2), "x",
                       ">= 1.8" if name.startswith("dp2") else None, note=f"median of {args.rounds} rounds")
                for name, m in median.items() if name != first]
    figures.append(figure(f"serve ({first}) / generate, requests per minute", round(base * per_request / 60, 1), "x"))
    write_result("bench_serve", f"paradiff serve, {args.model} pipeline {width}x{height}, {steps} steps: "
                 f"{', '.join(median)}", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
