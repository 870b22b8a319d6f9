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
from typing import Iterable, Iterator

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


def parameter_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the parameters these modules hold in memory (meta placeholders excluded; shared storage once)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for module in modules:
        for param in module.parameters():
            if param.device.type == "meta":
                continue
            storage = param.untyped_storage()
            key = (str(param.device), storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


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


class PeakMemory:
    """The peak memory of this process on `device` since the last `reset()`, while `active()`."""

    def __init__(self, device: torch.device, interval_s: float = 0.005) -> None:
        self.device = device
        self.interval_s = interval_s
        self._peak = 0
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        with self._lock:
            self._peak = rss_anon_bytes()

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        now = rss_anon_bytes()
        with self._lock:
            self._peak = max(self._peak, now)
            return self._peak

    @contextmanager
    def active(self) -> Iterator["PeakMemory"]:
        """Sample while inside (CPU); nested use keeps the outer sampler."""
        if self.device.type == "cuda" or self._thread is not None:
            yield self
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="paradiff-peak-memory", daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.peak()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = rss_anon_bytes()
            with self._lock:
                if now > self._peak:
                    self._peak = now
