"""Start the local workers of one run and supervise them: a failure never leaves processes behind or peers waiting."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from .report import say

WORKER_MODULE = "paradiff.cli"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(argv: list[str], world: int, worker_module: str = WORKER_MODULE, grace_s: float = 10.0) -> int:
    """Start `world` local workers (`python -m worker_module argv`) and supervise them; 0, or 1 if any failed.

    When one worker exits non-zero, the others get `grace_s` to notice (their collectives fail as soon as the peer's
    connections close, and they report which rank failed and why), then are terminated (SIGTERM, then SIGKILL), so a
    failure never leaves processes behind or peers waiting in a collective.
    """
    base_env = dict(os.environ, PARADIFF_WORKER="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                    LOCAL_WORLD_SIZE=str(world))
    workers = [
        subprocess.Popen([sys.executable, "-m", worker_module, *argv],
                         env=dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank)))
        for rank in range(world)
    ]
    failed: tuple[int, int] | None = None
    try:
        while any(worker.poll() is None for worker in workers):
            for rank, worker in enumerate(workers):
                code = worker.poll()
                if code not in (None, 0) and failed is None:
                    failed = (rank, code)
            if failed is not None:
                deadline = time.monotonic() + grace_s
                while time.monotonic() < deadline and any(worker.poll() is None for worker in workers):
                    time.sleep(0.05)
                break
            time.sleep(0.05)
    finally:
        _stop(workers, 5.0)
    failures = [(rank, w.returncode) for rank, w in enumerate(workers) if w.returncode]
    if failed is not None or failures:
        first = failed or failures[0]
        others = ", ".join(f"rank {rank}: {code}" for rank, code in failures if rank != first[0])
        say(f"paradiff: rank {first[0]} exited with code {first[1]} first; stopped the run"
            + (f" (exit codes of the others: {others})." if others else "."))
        return 1
    return 0


def _stop(workers: list[subprocess.Popen], grace_s: float) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.terminate()
    deadline = time.monotonic() + grace_s
    for worker in workers:
        try:
            worker.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
