"""Local rank spawning, written once: a free port, each rank's environment, and one supervised spawner.

Every caller that starts N local ranks (the CLI launcher, check_plan, the demo, benchmarks, tools) uses these, so
"no process left behind" and "the first failing rank is named" hold everywhere.
"""

from __future__ import annotations

import datetime
import importlib
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable

LOCALHOST = "127.0.0.1"
# what a launcher sends a server's rank 0 when it is itself asked to stop (SIGTERM): drain, then (asked again) stop at
# once. Their own signals, not SIGTERM: a SIGTERM to the whole process group reaches rank 0 directly as well, and the
# two must count as one request
DRAIN_SIGNAL, STOP_SIGNAL = signal.SIGUSR1, signal.SIGUSR2


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it; another process may still take it before we bind).
    Where the port is for the ranks' rendezvous, host_store is race-free: it keeps the port it binds."""
    with socket.socket() as sock:
        sock.bind((LOCALHOST, 0))
        return sock.getsockname()[1]


def host_store(timeout_s: float):
    """A c10d TCPStore served by this process on a port the OS picks while binding it (127.0.0.1:0), as torchrun's
    agent serves its workers' store. Nothing can take the port between choosing it and binding it (free_port's
    race: a port picked, closed, then bound by rank 0 later, by when another process may hold it). Ranks connect to
    `.port` as clients (rank_store); the store lives as long as this object."""
    import torch.distributed as dist

    return dist.TCPStore(LOCALHOST, 0, None, True, timeout=_store_timeout(timeout_s), wait_for_workers=False)


def rank_store(port: int, timeout_s: float):
    """A rank's client of the store host_store serves on `port`."""
    import torch.distributed as dist

    return dist.TCPStore(LOCALHOST, port, None, False, timeout=_store_timeout(timeout_s))


def _store_timeout(timeout_s: float) -> datetime.timedelta:
    # run_ranks(timeout_s=inf) (tools/train_demo.py) waits without limit; a store's timeout must be finite: torch's
    # default process-group timeout, 30 minutes, then
    return datetime.timedelta(seconds=timeout_s if math.isfinite(timeout_s) else 1800.0)


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The torch.distributed env:// variables of one local rank."""
    return dict(MASTER_ADDR=LOCALHOST, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))


class RankFailed(RuntimeError):
    """A spawned rank raised or died. `rank` and `summary` name the first failure; `failures` holds every one
    (rank -> traceback, or how the process ended); `results` the results of the ranks that finished."""

    def __init__(self, rank: int, summary: str, failures: dict[int, str], results: dict[int, Any]) -> None:
        self.rank = rank
        self.results = results
        self.summary = summary
        self.failures = failures
        text = "\n".join(f"--- rank {r} ---\n{detail}" for r, detail in sorted(failures.items()))
        super().__init__(f"rank {rank} failed first: {summary}\n{text}")


class RankTimeout(TimeoutError):
    """Ranks `missing` gave no result in time; `results` holds those of the ranks that finished."""

    def __init__(self, missing: list[int], timeout_s: float, results: dict[int, Any]) -> None:
        self.missing = missing
        self.results = results
        super().__init__(f"ranks {missing} gave no result within {timeout_s:.0f}s; all ranks were stopped.")


def _rank_entry(target: Callable[..., Any], rank: int, world_size: int, port: int, env: dict[str, str],
                kwargs: dict, gloo_timeout_s: float | None, hard_exit: bool, out: Any) -> None:
    os.environ.update(env, **rank_env(rank, world_size, port))
    if gloo_timeout_s is None:
        # the target's own env:// init connects to the parent's store (host_store) as a client, as under torchrun
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    try:
        import torch

        torch.set_num_threads(1)
        if gloo_timeout_s is not None:
            import torch.distributed as dist

            dist.init_process_group("gloo", store=rank_store(port, gloo_timeout_s), rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=gloo_timeout_s))
        try:
            out.put((rank, True, target(rank=rank, world_size=world_size, **kwargs)))
        finally:
            if gloo_timeout_s is not None:
                torch.distributed.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - sent to the parent, which names this rank
        out.put((rank, False, (f"{type(exc).__name__}: {exc}", traceback.format_exc())))
    # the queue's feeder thread must deliver the result before this process ends
    out.close()
    out.join_thread()
    if hard_exit:
        # skips interpreter finalisation, which can race gloo's threads releasing the last collectives and abort
        os._exit(0)


def run_ranks(target: Callable[..., Any], world_size: int, *, kwargs: dict | None = None,
              env: dict[str, str] | None = None, timeout_s: float = 600.0, grace_s: float = 15.0,
              gloo_timeout_s: float | None = None, hard_exit: bool = False) -> list[Any]:
    """Run `target(rank=, world_size=, **kwargs)` in `world_size` new processes (local_context); its results by rank.

    Each rank gets `env` plus MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK, one torch thread, and with
    `gloo_timeout_s` a gloo process group (destroyed after `target`). The ranks' store is served by this process
    (host_store, on the port MASTER_PORT names); without `gloo_timeout_s` the target's env:// init finds it through
    TORCHELASTIC_USE_AGENT_STORE, as under torchrun. `target` must be importable (spawn pickles it
    by name). Once a rank raises or dies the others get `grace_s` (they may be blocked in a collective with it), then
    every process still alive is killed and RankFailed names the first failing rank; after `timeout_s` RankTimeout
    names the ranks without a result. No process outlives this call.
    """
    context = local_context()
    out = context.Queue()
    store = host_store(timeout_s)
    port = store.port
    processes = [context.Process(target=_rank_entry, args=(target, rank, world_size, port, dict(env or {}),
                                                           dict(kwargs or {}), gloo_timeout_s, hard_exit, out))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    first: tuple[int, str] | None = None
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world_size:
            now = time.monotonic()
            if now > deadline:
                break
            try:
                rank, ok, value = out.get(timeout=0.2)
                if ok:
                    results[rank] = value
                else:
                    failures[rank] = value[1]
                    first = first or (rank, value[0])
            except queue.Empty:
                pass
            for rank, process in enumerate(processes):
                if rank not in results and rank not in failures and not process.is_alive() and out.empty():
                    failures[rank] = f"died with exit code {process.exitcode}"
                    first = first or (rank, failures[rank])
            if first is not None:
                deadline = min(deadline, now + grace_s)
    finally:
        for process in processes:
            process.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
        out.close()
        del store
    if first is not None:
        for rank in range(world_size):
            if rank not in results and rank not in failures:
                failures[rank] = "stopped: no result after a peer failed"
        raise RankFailed(first[0], first[1], failures, results)
    if len(results) < world_size:
        raise RankTimeout(sorted(set(range(world_size)) - set(results)), timeout_s, results)
    return [results[rank] for rank in range(world_size)]


# What a local worker imports before its first step: loaded once by the parent that forks the workers, where that is
# safe (start_commands). A fresh process spends about 3 s of CPU importing torch, diffusers and transformers and
# as much again on first use (diffusers' transformer package pulls in peft, transformers' modeling code,
# bitsandbytes, which compiles its ops on import, and scipy): per worker, before it has done anything.
# `paradiff` comes first: importing it installs the filters of optional backends' import-time warnings
# (runtime/import_noise.py), which must precede torch and diffusers in the fork server, a fresh interpreter.
WORKER_PRELOAD = ("paradiff", "torch", "torch.distributed", "diffusers", "diffusers.models.transformers",
                  "diffusers.models.autoencoders", "diffusers.pipelines.pipeline_utils", "transformers.modeling_utils",
                  "peft", "paradiff.api.model", "paradiff.api.pipeline")
# Device nodes of accelerators: where one exists, workers start as fresh interpreters. A library imported in the
# parent may ask whether CUDA is available, which initialises the driver, and a forked child cannot use a driver
# its parent initialised.
ACCELERATOR_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg", "/dev/accel0", "/dev/neuron0")


def can_fork_workers() -> bool:
    """Whether local workers may be forked from a parent that imported WORKER_PRELOAD: on a machine without
    accelerators, where the OS forks, unless PARADIFF_START_WORKERS=exec asks for fresh interpreters."""
    if os.environ.get("PARADIFF_START_WORKERS", "fork") == "exec" or not hasattr(os, "fork"):
        return False
    return not any(os.path.exists(node) for node in ACCELERATOR_NODES)


def local_context(preload: tuple[str, ...] = ()):
    """The multiprocessing context local ranks start from: where workers may be forked (can_fork_workers), a fork
    server that imported WORKER_PRELOAD (and `preload`) once, each rank forked from it in milliseconds; otherwise
    fresh interpreters ("spawn"). The server is one per process: the preload of whichever caller starts it wins."""
    import torch.multiprocessing as mp

    if not can_fork_workers():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([*WORKER_PRELOAD, *preload])
    return context


class ForkedCommand:
    """A worker forked from this process, with the part of subprocess.Popen's interface the launcher uses."""

    def __init__(self, pid: int, stderr: Any) -> None:
        self.pid, self.stderr, self.returncode = pid, stderr, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_commands(module: str, argv: list[str], envs: list[dict[str, str]]) -> list:
    """Start one worker per environment in `envs`, each running `python -m module argv` with its stderr in a pipe
    (`.stderr`); the Popen-like handles by rank. On a machine without accelerators the workers are forked from this
    process once it has imported WORKER_PRELOAD (a fraction of a second each instead of seconds of imports);
    otherwise, or if an import left a thread running (a fork would copy a process in the middle of its work), they
    are fresh interpreters."""
    if can_fork_workers():
        for name in WORKER_PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError:  # an optional dependency: the worker imports what it needs itself
                pass
        if threading.active_count() == 1:
            return [_fork_command(module, argv, env) for env in envs]
    return [subprocess.Popen([sys.executable, "-m", module, *argv], stderr=subprocess.PIPE, env=env) for env in envs]


def _fork_command(module: str, argv: list[str], env: dict[str, str]) -> ForkedCommand:
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(write_end)
        return ForkedCommand(pid, os.fdopen(read_end, "rb"))
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)
    exit_as_main(["-m", module, *argv], env)


def exit_as_main(target: list[str], env: dict[str, str]) -> None:
    """In a forked child: run `python *target` (["-m", MODULE, *ARGS] or [SCRIPT, *ARGS]) with environment `env` as
    a fresh interpreter would, and exit with its status (SystemExit's code; 1 and the traceback on an exception)."""
    import runpy

    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(target)
            sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
            runpy.run_path(target[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as an interpreter would: the traceback, exit code 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def stop_commands(workers: list, grace_s: float) -> None:
    """Terminate every worker still running, and kill those not gone after `grace_s`."""
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
