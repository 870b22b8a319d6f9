"""Rank 0's dispatcher: hands each data-parallel replica its next batch as soon as that replica is free, reads its
answers, and decides what a replica's fault leads to. A thread beside rank 0's own replica loop (ranks.py).

Each replica is a mesh of its own, in a process group of its own, with keys of its own in the store ("r1/gen0/...").
The dispatcher puts batch n of replica r under "work/n"; the replica's first rank takes it, checks it and broadcasts
it to its ranks, which run it and put their summaries under "batch/n/summary/RANK"; once all are there the
dispatcher answers the batch's requests and the replica is free again. No replica waits for another.

A fault in replica r (an exception on one of its ranks, or one of its processes gone) ends its batch on its ranks
only: they write their errors, abort their own process group and say they are alive. The dispatcher answers the
batch's requests (500 naming the cause), and decides "recover": the replica alone joins a new process group (the
next generation of its keys) and loads the pipeline again, while the other replicas go on serving (/health says
"degraded" meanwhile). It decides "stop" when a rank of the replica is gone (no launcher starts it again; under Ray
Serve, Ray does), when the load itself failed again, or when the server is already stopping: then the waiting
requests are answered 503, /health says failed, the other replicas finish what they run and every rank exits non-zero.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

from paradiff.serve.ranks import ALIVE_WAIT_S, ERROR, READY, SUMMARY, Channel, process_alive

DISPATCH_POLL_S = 0.005  # how often a dispatcher with a busy or loading replica looks at the replicas' keys
# how long it waits for a request when every replica is free: a request (or a drain) wakes it at once, so only a fault
# of an idle replica is seen up to this much later; 200 looks a second cost an idle dp2 x tp2 server 12 % of a core
DISPATCH_IDLE_WAIT_S = 0.05
PROCESS_CHECK_S = 0.1  # how often it looks whether the ranks' processes on this machine still run
JOBS_LOOK_S = 1.0  # how often it looks for video jobs left in the store unclaimed (serve/jobs.py: JobStore's owners)


@dataclass
class ReplicaState:
    index: int
    channel: Channel  # the replica's keys, in its current generation
    state: str = "loading"  # loading | ready | busy | failed | stopping | stopped
    number: int = 0  # batches handed to it in this generation
    items: list[dict] = field(default_factory=list)  # the batch it runs
    pids: dict[int, int] = field(default_factory=dict)  # its ranks on this machine: rank in the replica -> pid
    first_rank: int = 0  # its ranks are first_rank ... first_rank + size - 1


class Dispatcher:
    def __init__(self, store, frontend, replicas: int, size: int, timeout_s: float, clock=time.monotonic) -> None:
        # clock: the seconds a fault's wait is measured in (a test's fake clock; the loop's own polls stay real)
        self.frontend, self.size, self.timeout_s, self.clock = frontend, size, timeout_s, clock
        self.replicas = [ReplicaState(r, Channel(store, 0, size, scope=f"r{r}"), first_rank=r * size)
                         for r in range(replicas)]
        self.failed = False
        self._checked_processes = 0.0
        self._looked_at_jobs = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paradiff-dispatch", daemon=True)
        frontend.replica_states = {r.index: r.state for r in self.replicas}

    def start(self) -> "Dispatcher":
        self._thread.start()
        return self

    def join(self) -> None:
        self._thread.join()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # -- the loop -----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                processes = time.monotonic() > self._checked_processes + PROCESS_CHECK_S
                if processes:
                    self._checked_processes = time.monotonic()
                if time.monotonic() > self._looked_at_jobs + JOBS_LOOK_S:
                    self._looked_at_jobs = time.monotonic()
                    # video jobs no server has claimed (one sharing the store drained or died): they run here
                    self.frontend.feed_jobs()
                for replica in self.replicas:
                    self._look_at(replica, processes)
                self._publish_cancellations()
                self._exchange()
                if all(replica.state in ("stopped", "failed") for replica in self.replicas):
                    return
                self._hand_out()
        except Exception as exc:  # noqa: BLE001 - the store is gone (a rank took the server down): say it once
            if not self._stop.is_set():
                self.frontend.fail(f"the dispatcher stopped: {type(exc).__name__}: {exc}")
                self.failed = True

    def _look_at(self, replica: ReplicaState, processes: bool = True) -> None:
        channel = replica.channel
        if replica.state in ("failed", "stopped"):
            return
        if replica.state == "stopping":
            if channel.has("stopped"):
                channel.delete("stopped")
                self._set(replica, "stopped")
            return
        dead = [rank for rank, pid in replica.pids.items() if not process_alive(pid)] if processes else []
        if channel.has("fault") or dead:
            self._fault(replica)
            return
        if replica.state == "loading" and channel.has("ready"):
            ready = channel.take(READY, "ready")
            # every rank on this machine, global rank 0 included: its pid is this process's, which runs as long as
            # this thread does, but its loop (the main thread) may take long to leave a failed collective and say it
            # is alive; it is waited for as any local rank, not taken for dead after ALIVE_WAIT_S
            host = socket.gethostname()
            replica.pids = {entry["rank"] - replica.first_rank: entry["pid"] for entry in ready["ranks"]
                            if entry["host"] == host}
            if channel.generation:
                channel.forget_generation(channel.generation - 1)
            self._set(replica, "ready")
            self.frontend.replica_ready(replica.index, ready["info"], ready["ranks"], channel.generation)
        elif replica.state == "busy" and all(channel.has("batch", replica.number, "summary", rank)
                                             for rank in range(self.size)):
            summaries = [channel.take(SUMMARY, "batch", replica.number, "summary", rank) for rank in range(self.size)]
            for summary in summaries:
                summary["rank"] += replica.first_rank
            self.frontend.finish_batch(replica.items, channel, summaries, replica.index)
            self._forget_batch(replica, summaries)
            replica.items = []
            self._set(replica, "ready")
            self.frontend.metrics.store_keys(channel.keys())

    def _hand_out(self) -> None:
        """The waiting requests the scheduler gives the free replicas; "stop" to them once a drain (or a failing
        server) has nothing left. Waits on the scheduler when nothing is queued: up to DISPATCH_POLL_S while a replica
        runs or loads, DISPATCH_IDLE_WAIT_S while all are free."""
        free = [replica for replica in self.replicas if replica.state == "ready"]
        if not free:
            time.sleep(DISPATCH_POLL_S)
            return
        wait_s = DISPATCH_IDLE_WAIT_S if len(free) == len(self.replicas) else DISPATCH_POLL_S
        decision = self.frontend.scheduler.next_round([replica.index for replica in free], wait_s)
        if decision["kind"] == "stop":
            for replica in free:
                replica.number += 1
                replica.channel.put({"kind": "stop", "items": []}, "work", replica.number)
                self._set(replica, "stopping")
        elif decision["kind"] == "work":
            for replica, items in zip(free, decision["batches"]):
                if items:
                    replica.number += 1
                    replica.items = items
                    self._set(replica, "busy")
                    self.frontend.started(items)
                    replica.channel.put({"kind": "work", "items": items}, "work", replica.number)

    def _publish_cancellations(self) -> None:
        """A key in the running replica's store for each running request already answered (504, client gone)."""
        for job_id in self.frontend.to_cancel():
            for replica in self.replicas:
                if any(item["id"] == job_id for item in replica.items):
                    replica.channel.put(True, "cancel", job_id)

    def _exchange(self) -> None:
        """Between looks at the replicas: each busy one's step events and previews (stream.py's ProgressRouter), from
        its keys to the frontend, which hands them to the requests (a video job's progress, a stream's previews)."""
        for replica in self.replicas:
            if replica.state == "busy":
                self.frontend.progress.poll(replica.channel, [replica.index])

    def _forget_batch(self, replica: ReplicaState, summaries: list[dict]) -> None:
        """Every summary of the batch read: its cancel and request-fault agreement keys go (its step event went with
        the round: Frontend.finish_batch)."""
        channel = replica.channel
        for item in replica.items:
            channel.delete("cancel", item["id"])
        for chunk in {c for s in summaries for c in s["agreements"]}:
            for rank in range(self.size):
                channel.delete("round", replica.number, "fail", chunk, rank)
            channel.delete("round", replica.number, "verdict", replica.index, chunk)

    def _set(self, replica: ReplicaState, state: str) -> None:
        replica.state = state
        self.frontend.replica_state(replica.index, state)

    # -- a replica's fault --------------------------------------------------------------------------------------
    def _fault(self, replica: ReplicaState) -> None:
        """Wait until each rank of the replica says it is alive or is seen gone (a rank on this machine: while its
        process runs, up to the collective timeout; elsewhere ALIVE_WAIT_S), answer the replica's batch and decide."""
        channel = replica.channel
        if not channel.has("fault"):
            channel.put(True, "fault")  # its ranks that wait in the store learn of it (a rank of it died)
        started = self.clock()

        def settled(rank: int) -> bool:
            if channel.has("alive", rank):
                return True
            if rank in replica.pids:
                return not process_alive(replica.pids[rank]) or self.clock() > started + self.timeout_s
            return self.clock() > started + ALIVE_WAIT_S

        while not all(settled(rank) for rank in range(self.size)):
            time.sleep(0.02)
        alive = [rank for rank in range(self.size) if channel.has("alive", rank)]
        errors = {rank: channel.get(ERROR, "error", rank) for rank in range(self.size) if channel.has("error", rank)}
        first = replica.first_rank
        root = [f"rank {first + rank}: {error['error']}" for rank, error in sorted(errors.items()) if not error["comm"]]
        dead = sorted(first + rank for rank in set(range(self.size)) - set(alive))
        if dead:
            root.append(f"rank(s) {dead} stopped answering (the process died or was killed)")
        cause = "; ".join(root) or "; ".join(f"rank {first + r}: {e['error']}" for r, e in sorted(errors.items()))
        reloading = any(error["loading"] for error in errors.values())  # the load failed again: do not loop
        decision = "stop" if dead or reloading or self.frontend.closing else "recover"
        self.frontend.replica_fault(replica.index, len(self.replicas), cause, decision, channel, replica.items)
        self.frontend.fail_batch(replica.items, channel, cause)
        for item in replica.items:
            channel.delete("cancel", item["id"])
        replica.items, replica.number = [], 0
        channel.put(decision, "decision")
        if decision == "stop":
            self.failed = True
            self._set(replica, "failed")
            self.frontend.fail(cause)
        else:
            channel.generation += 1
            self._set(replica, "loading")

