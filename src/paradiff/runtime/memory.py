"""Per-rank memory figures: CUDA's allocator peak on GPUs, and on CPUs the peak anonymous resident memory (RssAnon:
heap and mmapped allocations, which is where weights and activations live; file-backed pages such as shared
libraries are not counted).

Linux exposes no resettable RssAnon peak (VmHWM counts file pages too and resets only for the whole process), so on
CPU a background thread samples /proc/self/statm while a measurement is active. Weight reads and forwards release
the GIL, so the sampler keeps running through them; a 5 ms period catches every allocation that lives at least that
long, which weights and layer activations do.
"""

from __future__ import annotations

import ctypes
import os
import threading
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_anon_bytes() -> int:
    """This process's anonymous resident memory now (resident minus file-backed and shared pages)."""
    try:
        with open("/proc/self/statm") as handle:
            fields = handle.read().split()
        return (int(fields[1]) - int(fields[2])) * _PAGE
    except OSError:  # not Linux: fall back to the lifetime peak, the best this platform offers
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory so far: CUDA's allocator peak on a GPU, the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def parameter_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the parameters these modules hold in memory (meta placeholders excluded; shared storage once)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for module in modules:
        for param in module.parameters():
            if param.device.type == "meta":
                continue
            for tensor in _plain_tensors(param):
                storage = tensor.untyped_storage()
                key = (str(tensor.device), storage.data_ptr())
                if key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
    return total


def _plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding `tensor`'s bytes: itself, or the inner tensors of a wrapper subclass (torchao's quantized
    weights hold no storage of their own)."""
    if not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]
    # (an FSDP2 DTensor names its device mesh too: only tensors hold bytes)
    return [t for item in inner if isinstance(item, torch.Tensor) for t in _plain_tensors(item)]


def release_freed_memory(device: torch.device) -> None:
    """Hand memory freed by dropped weights back to the system, so the next stage starts from a lower peak.

    On CPU, glibc keeps freed blocks below its mmap threshold (which grows to 32 MiB after large frees) in its heap;
    malloc_trim returns the free pages of every arena. (Dropped weights are freed by reference counting at once; no
    garbage collection pass is needed.)
    """
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def rss_anon_reading() -> dict[str, int]:
    return {"RssAnon": rss_anon_bytes()}


class PeakSampler:
    """The peak of each figure `read()` returns (name -> bytes), sampled every `interval_s` by a daemon thread while
    inside `with`, and once on entry, on exit and at each `sample()`. `samples` counts the reads."""

    def __init__(self, read: Callable[[], dict[str, int]] = rss_anon_reading, interval_s: float = 0.005) -> None:
        self.read = read
        self.interval_s = interval_s
        self.peak: dict[str, int] = {}
        self.samples = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def reset(self) -> None:
        with self._lock:
            self.peak = {}
        self.sample()

    def sample(self) -> None:
        values = self.read()
        with self._lock:
            self.samples += 1
            for name, value in values.items():
                if value > self.peak.get(name, -1):
                    self.peak[name] = value

    def __enter__(self) -> "PeakSampler":
        self.sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paradiff-peak-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._thread = None
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()


class PeakMemory:
    """The peak memory of this process on `device` since the last `reset()`, while `active()`."""

    def __init__(self, device: torch.device, interval_s: float = 0.005) -> None:
        self.device = device
        self._sampler = PeakSampler(interval_s=interval_s)

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._sampler.reset()

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        self._sampler.sample()
        return self._sampler.peak["RssAnon"]

    @contextmanager
    def active(self) -> Iterator["PeakMemory"]:
        """Sample while inside (CPU); nested use keeps the outer sampler."""
        if self.device.type == "cuda" or self._sampler.running:
            yield self
            return
        with self._sampler:
            yield self
