"""When one rank fails inside a forward, every rank ends with an error that names it, within a bounded time.

The failing rank writes its cause to the process group's store before re-raising. The other ranks are blocked in a
collective, which the backend ends (peer connection closed at once when the process dies; the process group's
timeout otherwise); they then read the store and raise a DistributedError naming the failing rank and its cause.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch.distributed as dist

from paradiff.distributed.store import get_json, put_json
from paradiff.errors import DistributedError, native_message

KEY = "paradiff/failed/{rank}"
COMM_ERROR_MARKERS = ("gloo", "nccl", "connection closed", "timed out", "timeout", "connection reset", "broken pipe")


def is_comm_error(exc: BaseException) -> bool:
    name = type(exc).__name__
    if name in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc).lower() for marker in COMM_ERROR_MARKERS)


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def report_failure(exc: BaseException) -> None:
    """Record this rank's failure for its peers (best effort: the store may be gone too)."""
    try:
        payload = {"time": time.time(), "error": f"{type(exc).__name__}: {exc}"}
        put_json(_store(), KEY.format(rank=dist.get_rank()), payload)
    except Exception:  # noqa: BLE001 - reporting must never mask the original error
        pass


def read_failures(since: float, wait_s: float = 3.0) -> dict[int, str]:
    """Failures other ranks reported after `since`, waiting up to `wait_s` for a report to land."""
    deadline = time.monotonic() + wait_s
    found: dict[int, str] = {}
    while True:
        for rank in range(dist.get_world_size()):
            key = KEY.format(rank=rank)
            try:
                if rank != dist.get_rank() and _store().check([key]):
                    payload = get_json(_store(), key, {"time": float, "error": str})
                    if payload["time"] >= since:
                        found[rank] = payload["error"]
            except Exception:  # noqa: BLE001 - a dead store means no report can come
                return found
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def guarded_call(call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The "failure_guard" forward wrapper: report local failures; turn a cut-off collective into an error naming
    the culprit. Installed by `paradiff.api.attach.attach` (runtime/wrappers.py sits above this layer)."""
    started = time.time() - 1.0
    try:
        return call(*args, **kwargs)
    except DistributedError:
        raise
    except Exception as exc:
        if not is_comm_error(exc):
            report_failure(exc)
            raise
        failures = read_failures(started)
        if failures:
            detail = "; ".join(f"rank {rank} failed with {error}" for rank, error in sorted(failures.items()))
            raise DistributedError(f"{detail}. Rank {dist.get_rank()} stopped because its collective was cut "
                                   f"off ({type(exc).__name__}).") from exc
        raise DistributedError(
            f"a collective failed on rank {dist.get_rank()} and no rank reported an error: a peer process "
            f"probably crashed or was killed, or is stuck ({type(exc).__name__}: {native_message(exc)})."
        ) from exc
