"""Helpers shared by the benchmark scripts: rank spawning, /proc sampling, and the in-process diffusers CPU patches.

Not a benchmark itself (run_all.py only runs bench_*.py).
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from paradiff.distributed import spawn
from paradiff.runtime.memory import PeakSampler
from paradiff.distributed.spawn import free_port  # noqa: F401 - the benchmarks' one free port

GB = 1e9


# ----------------------------------------------------------------------------------------------------------------
# /proc sampling


def read_status() -> tuple[dict[str, int], int]:
    """RssAnon / RssFile / RssShmem / VmHWM in bytes, and how many bytes the read itself cost (it shows in rchar)."""
    fd = os.open("/proc/self/status", os.O_RDONLY)
    try:
        raw = os.read(fd, 65536)  # one read syscall, so the sampler's own syscalls are countable
    finally:
        os.close(fd)
    values = {}
    for line in raw.split(b"\n"):
        if line.startswith((b"RssAnon:", b"RssFile:", b"RssShmem:", b"VmHWM:")):
            key, rest = line.split(b":", 1)
            values[key.decode()] = int(rest.split()[0]) * 1024
    return values, len(raw)


def read_io() -> dict[str, int]:
    fd = os.open("/proc/self/io", os.O_RDONLY)
    try:
        raw = os.read(fd, 65536)
    finally:
        os.close(fd)
    values = {}
    for line in raw.decode().splitlines():
        key, value = line.split(":")
        values[key.strip()] = int(value)
    values["_self_bytes"] = len(raw)
    return values


class MemorySampler(PeakSampler):
    """paradiff's PeakSampler over /proc/self/status (RssAnon, RssFile, RssShmem, VmHWM), every 5 ms by default.

    Counts the bytes its own reads add to /proc/self/io's rchar so they can be subtracted.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        super().__init__(read=self._read_counted, interval_s=interval_s)
        self.own_rchar = 0

    def _read_counted(self) -> dict[str, int]:
        values, cost = read_status()
        self.own_rchar += cost
        return values


def cpu_seconds() -> float:
    """This process's user + system CPU time, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def system_busy_seconds() -> float:
    """CPU-seconds every core of the machine has spent busy since boot (from /proc/stat), for all processes."""
    with open("/proc/stat") as handle:
        fields = [int(v) for v in handle.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class ForeignLoad:
    """CPU seconds used on the machine during a block by anything but this process's own (waited-for) children."""

    def __enter__(self) -> "ForeignLoad":
        self.busy, self.children, self.own = system_busy_seconds(), children_cpu_s(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        mine = children_cpu_s() - self.children + time.process_time() - self.own
        self.seconds = max(0.0, system_busy_seconds() - self.busy - mine)


def foreign_benchmarks() -> list[str]:
    """Other benchmark scripts running now (this machine has 2 cores: their load would skew these timings)."""
    mine, pid = set(), os.getpid()
    while pid > 1:  # this process and its ancestors (a shell that started it names this script too)
        mine.add(str(pid))
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    found = subprocess.run(["pgrep", "-af", "benchmarks/bench_"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in found if line.split()[0] not in mine and "pgrep" not in line]


def wait_for_quiet(max_busy_cores: float = 0.3, window_s: float = 1.0, timeout_s: float = 180.0,
                   quiet_s: float = 0.0, alone: bool = False) -> float:
    """Wait until the machine's other processes use under `max_busy_cores` cores over `window_s` (for `quiet_s` in a
    row, and with `alone` while no other benchmark script runs either).

    The benchmark machine is shared (2 cores); a run started next to someone else's job measures the contention.
    Returns the busy cores seen in the last window (waits at most `timeout_s`, then goes on anyway).
    """
    deadline = time.monotonic() + timeout_s
    quiet_since = time.monotonic()
    while True:
        busy0, own0, start = system_busy_seconds(), cpu_seconds(), time.monotonic()
        time.sleep(window_s)
        busy = (system_busy_seconds() - busy0 - (cpu_seconds() - own0)) / (time.monotonic() - start)
        others = foreign_benchmarks() if alone else []
        if others or busy >= max_busy_cores:
            if alone:
                print(f"waiting: other benchmarks {others}, {busy:.1f} cores busy", flush=True)
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return busy
        if time.monotonic() > deadline:
            return busy


class LoadWindow:
    """Machine-wide busy CPU and this process's CPU over a timed region, to tell our work from other processes'."""

    def __enter__(self) -> "LoadWindow":
        self.system0, self.own0, self.t0 = system_busy_seconds(), cpu_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        self.system = system_busy_seconds() - self.system0
        self.own = cpu_seconds() - self.own0


def foreign_cpu(windows: list[dict]) -> float:
    """CPU-seconds used by other processes during the ranks' (overlapping) windows: machine busy minus ours."""
    system = max(w["system"] for w in windows)
    return max(0.0, system - sum(w["own"] for w in windows))


# ----------------------------------------------------------------------------------------------------------------
# diffusers on CPU


@dataclass
class DiffusersCpuPatches:
    """What was patched, so BENCHMARKS.md can list it."""

    applied: list[str] = field(default_factory=list)


def patch_diffusers_for_cpu_tp() -> DiffusersCpuPatches:
    """Let diffusers 0.42.1's DTensor tensor parallelism run on a CPU/gloo mesh. Call inside a worker process only.

    1. `torch.accelerator.device_count()` is 0 without an accelerator, and `ModelMixin._resolve_parallel_config`
       computes `rank % torch.accelerator.device_count()` (ZeroDivisionError). Patched to return 1, giving device
       `cpu:0` (the accelerator type is already "cpu" there, so the mesh is a gloo "cpu" mesh).
    2. `diffusers.hooks.tensor_parallel._SUPPORTED_TP_DEVICES` lacks "cpu", so `apply_tensor_parallel` refuses the
       mesh. "cpu" is appended.
    Nothing else is needed for Flux2Transformer2DModel (checked: sharded load, full load + enable_parallelism and the
    forward pass all run with only these two).
    """
    import torch
    import diffusers.hooks.tensor_parallel as tp_hooks

    patches = DiffusersCpuPatches()
    if torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1  # type: ignore[assignment]
        patches.applied.append("torch.accelerator.device_count -> 1")
    if "cpu" not in tp_hooks._SUPPORTED_TP_DEVICES:
        tp_hooks._SUPPORTED_TP_DEVICES = tuple(tp_hooks._SUPPORTED_TP_DEVICES) + ("cpu",)
        patches.applied.append('diffusers.hooks.tensor_parallel._SUPPORTED_TP_DEVICES += ("cpu",)')
    return patches


def quiet_diffusers() -> None:
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()


# ----------------------------------------------------------------------------------------------------------------
# spawning ranks


def _numpy_results(rank: int, world_size: int, target: Callable[..., Any], kwargs: dict) -> Any:
    import torch
    from torch.utils import _pytree as pytree

    result = target(rank=rank, world_size=world_size, **kwargs)
    # torch's queues pass tensors as shared-memory handles that die with this process, which may exit before
    # the parent reads them: send copies as numpy arrays
    return pytree.tree_map(lambda v: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v, result)


def run_ranks(target: Callable[..., Any], world_size: int, timeout_s: float = 600.0, **kwargs: Any) -> list[Any]:
    """Run `target(rank=, world_size=, **kwargs)` in `world_size` fresh spawned processes; results by rank.

    Raises paradiff's RankFailed (a RuntimeError) naming the first failing rank, or RankTimeout (a TimeoutError)."""
    return spawn.run_ranks(_numpy_results, world_size, kwargs=dict(target=target, kwargs=kwargs), timeout_s=timeout_s,
                           grace_s=1.0, gloo_timeout_s=600 if world_size > 1 else None)


# ----------------------------------------------------------------------------------------------------------------
# reporting


def machine_line() -> str:
    import torch
    import diffusers

    try:
        cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"], capture_output=True, text=True,
                             timeout=5).stdout.split(":", 1)[-1].strip()
    except Exception:  # noqa: BLE001
        cpu = platform.processor()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()}-core CPU ({cpu}), {mem:.0f} GiB RAM, torch {torch.__version__}, "
            f"diffusers {diffusers.__version__}, gloo, python {platform.python_version()}")


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines)
