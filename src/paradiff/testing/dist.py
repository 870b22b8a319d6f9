"""A pool of gloo ranks started once and reused for many test cases.

Each world size gets one pool (ranks forked from a server that preloaded torch and diffusers: local_context). A case is an
importable function run on every rank; its return values come back as a list by rank. A rank that raises reports
its traceback; a case that does not finish in time kills the pool (it is restarted for the next case), so a hang
can never stall the suite.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import os
import queue
import time
import traceback
from typing import Any, Callable


from paradiff.distributed.spawn import host_store, local_context, rank_env, rank_store


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds every failing rank's traceback."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        text = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}")


class RankTimeout(AssertionError):
    pass


def _worker(rank: int, world_size: int, port: int, inbox: Any, outbox: Any, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(rank_env(rank, world_size, port))
    dist.init_process_group("gloo", store=rank_store(port, timeout_s), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    # What the fork server imported (torch, diffusers, transformers: millions of objects, shared copy-on-write) is
    # frozen out of the collector's reach before the first case, as release_groups freezes what each case leaves:
    # otherwise the first collection of every rank scans it all and touches (copies) its pages.
    gc.freeze()
    parent = os.getppid()
    while True:
        try:
            task = inbox.get(timeout=2.0)
        except queue.Empty:
            # a pool whose test process was killed would otherwise live on, its gloo threads polling forever
            if os.getppid() != parent:
                os._exit(0)
            continue
        if task is None:
            break
        module_name, function_name, kwargs = task
        try:
            function = getattr(importlib.import_module(module_name), function_name)
            outbox.put((rank, True, function(**kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
            outbox.put((rank, False, traceback.format_exc()))
        release_groups()
    dist.destroy_process_group()


def release_groups() -> None:
    """Destroy every process group but the world's once a case is done.

    Each gloo group keeps its own I/O threads for as long as it lives, and every case builds a mesh (about six
    groups). Without this a long-lived rank accumulates thousands of busy-polling threads and the whole machine slows
    to a crawl. Cases never keep a model across cases, so nothing still uses these groups.
    """

    import torch.distributed as dist

    gc.collect()
    # What survives a case (torch, diffusers, transformers and their module-level objects: millions of them) is
    # moved out of the collector's reach, so the next case's collection scans only what that case made: a full
    # collection over the imported libraries took 0.3-0.4 s, the largest cost of a small case.
    gc.freeze()
    world = dist.distributed_c10d._world
    for group in list(world.pg_map):
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


# Besides what every local worker preloads (distributed/spawn.py: WORKER_PRELOAD), what cases and commands import:
# the plans' example models and the command. A caller adds its own modules (`RankPool(preload=)`: the test suite's
# fixtures, paradiff_testkit.PRELOAD); the fork server is one per process, and the first preload to start it wins.
PRELOAD = ("paradiff.plan_tools.family_examples", "paradiff.cli", "paradiff.cli.worker")


class RankPool:
    """`world_size` gloo ranks forked once (local_context, importing PRELOAD and `preload`), each case an importable
    function run on every rank: `pool.run(case, **kwargs)` returns its results by rank."""

    def __init__(self, world_size: int, collective_timeout_s: float = 60.0, preload: tuple[str, ...] = ()) -> None:
        self.world_size = world_size
        context = local_context((*PRELOAD, *preload))
        self.inboxes = [context.Queue() for _ in range(world_size)]
        self.outbox = context.Queue()
        # the ranks' store, served here on a port bound once and kept (no other process can take it in between)
        self.store = host_store(collective_timeout_s)
        self.processes = [
            context.Process(
                target=_worker,
                args=(rank, world_size, self.store.port, self.inboxes[rank], self.outbox, collective_timeout_s),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def run(self, function: Callable[..., Any], timeout_s: float = 240.0, **kwargs: Any) -> list[Any]:
        """Run `function(**kwargs)` on every rank; return the results by rank or raise RankFailure / RankTimeout."""
        outcomes = self.run_outcomes(function, timeout_s=timeout_s, **kwargs)
        failures = {rank: value for rank, (ok, value) in enumerate(outcomes) if not ok}
        if failures:
            raise RankFailure(failures)
        return [value for _, value in outcomes]

    def run_outcomes(self, function: Callable[..., Any], timeout_s: float = 240.0, **kwargs: Any) -> list[tuple]:
        """Like run, but returns (ok, result or traceback or 'died ...') per rank, for fault-injection tests.

        A rank whose process exits is reported as died; once a rank has failed or died, the others get a short
        grace period, after which the pool is killed (they may be blocked in a collective) and reported as hung.
        """
        for inbox in self.inboxes:
            inbox.put((function.__module__, function.__name__, kwargs))
        outcomes: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        grace_end = None
        while len(outcomes) < self.world_size:
            try:
                rank, ok, value = self.outbox.get(timeout=0.2)
                outcomes[rank] = (ok, value)
            except queue.Empty:
                pass
            for rank, process in enumerate(self.processes):
                if rank not in outcomes and not process.is_alive():
                    outcomes[rank] = (False, f"died with exit code {process.exitcode}")
            if grace_end is None and any(not ok for ok, _ in outcomes.values()):
                grace_end = time.monotonic() + 15.0
            now = time.monotonic()
            if len(outcomes) < self.world_size and (now > deadline or (grace_end is not None and now > grace_end)):
                self.close(force=True)
                if grace_end is None:
                    raise RankTimeout(
                        f"{function.__name__} did not finish on ranks "
                        f"{sorted(set(range(self.world_size)) - set(outcomes))} within {timeout_s}s"
                    )
                for rank in range(self.world_size):
                    outcomes.setdefault(rank, (False, "hung: no result after a peer failed"))
        if any(not ok for ok, _ in outcomes.values()):
            self.close(force=True)  # ranks may have left collectives half done; start a fresh pool next time
        return [outcomes[rank] for rank in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        if not force:
            for inbox in self.inboxes:
                inbox.put(None)
            for process in self.processes:
                process.join(timeout=10)
        for process in self.processes:
            if process.is_alive():
                process.kill()
                # returns as soon as it is gone; a killed process with a large heap, on a loaded machine, took over
                # 5 s to be reaped (the load lane: "a worker process was left running")
                process.join(timeout=60)
