"""The bounded queue of `paradiff serve`, on rank 0: which requests each replica runs next, and their deadlines.

A round gives each data-parallel replica at most one batch: first each replica takes the oldest waiting request, then
each batch is joined by later ones with the same size, steps and guidance (ImageRequest.batch_key) while the images
fit in `max_batch`. The round is what rank 0
broadcasts; a request waiting past its deadline is answered 504 instead of being run.
"""

from __future__ import annotations

import base64
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from paradiff.serve.protocol import ImageRequest, RequestError


@dataclass
class Job:
    id: int
    request: ImageRequest
    accepted: float  # time.monotonic()
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    status: int = 0
    result: Any = None  # list of PNG bytes on success; the error message otherwise
    replica: int | None = None
    started: float | None = None
    finished: float | None = None
    accepted_wall: float = field(default_factory=time.time)
    _callbacks: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _events: list = field(default_factory=list)  # what happened while it ran (steps, previews), for listeners
    _listeners: list = field(default_factory=list)

    def finish(self, status: int, result: Any) -> bool:
        with self._lock:
            if self.done.is_set():
                return False  # answered once, never twice
            self.status, self.result, self.finished = status, result, time.monotonic()
            self.done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
        return True

    def add_done_callback(self, callback) -> None:
        """Call `callback()` once the job is answered (at once if it is already)."""
        with self._lock:
            if not self.done.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def emit(self, event: dict) -> None:
        """An event of the running job (a step ended, a preview is ready): kept, and given to every listener.
        Listeners run under the job's lock, so each sees the events in order: they must only hand them on."""
        with self._lock:
            if self.done.is_set():
                return
            self._events.append(event)
            for listener in self._listeners:
                listener(event)

    def add_listener(self, listener) -> None:
        """`listener(event)` for each event of the job, those already emitted first."""
        with self._lock:
            for event in self._events:
                listener(event)
            self._listeners.append(listener)

    def work_item(self) -> dict:
        r = self.request
        return {"id": self.id, "prompt": r.prompt, "seeds": r.seeds(), "width": r.width, "height": r.height,
                "steps": r.steps, "guidance": r.guidance, "negative_prompt": r.negative_prompt,
                "true_cfg_scale": r.true_cfg_scale, "kind": r.kind, "frames": r.frames, "fps": r.fps,
                "loras": list(r.loras), "partial_images": r.partial_images,
                "adapter": dict(zip(("name", "path", "sha256"), r.adapter)) if r.adapter else None,
                **(_edit_inputs(r) if r.images else {})}


def _edit_inputs(request: ImageRequest) -> dict:
    """An edit's uploaded files (base64 in the round's JSON: every rank decodes the same bytes) and strength."""
    return {"images": [base64.b64encode(data).decode() for data in request.images],
            "mask": base64.b64encode(request.mask).decode() if request.mask is not None else None,
            "strength": request.strength}


class Scheduler:
    def __init__(self, max_queue: int = 64, max_batch: int = 1, request_timeout_s: float = 600.0,
                 on_finish=None, window_s: float = 0.0) -> None:
        self.max_queue, self.max_batch, self.request_timeout_s = max_queue, max_batch, request_timeout_s
        self.window_s = window_s  # how long a round waits for company after the first request of an idle spell
        self._lock = threading.Condition()
        self._waiting: list[Job] = []
        self._running: dict[int, Job] = {}
        self._ids = itertools.count(1)
        self._draining = False
        self._closed: str | None = None
        self._on_finish = on_finish  # called as on_finish(job) once per answered job

    # -- the HTTP side ------------------------------------------------------------------------------------------
    def submit(self, request: ImageRequest, deadline: bool = True) -> Job:
        """Queue `request`; its deadline is --request-timeout from now (`deadline` False: none, for an asynchronous
        job that waits for its turn however long the queue is)."""
        with self._lock:
            if self._closed is not None:
                raise RequestError(503, f"the server is not serving: {self._closed}")
            if self._draining:
                raise RequestError(503, "the server is shutting down and takes no new requests")
            if len(self._waiting) >= self.max_queue:
                raise RequestError(503, f"the queue is full ({self.max_queue} waiting requests); retry later")
            now = time.monotonic()
            job = Job(next(self._ids), request, now, now + self.request_timeout_s if deadline else float("inf"))
            self._waiting.append(job)
            self._lock.notify_all()
            return job

    def depth(self) -> tuple[int, int]:
        with self._lock:
            return len(self._waiting), len(self._running)

    # -- rank 0's loop ------------------------------------------------------------------------------------------
    def next_round(self, replicas: int, wait_s: float = 0.05) -> dict:
        """{"kind": "work", "batches": [items of replica 0, ...]}, {"kind": "idle"} or {"kind": "stop"}."""
        with self._lock:
            if not self._waiting and not self._draining:
                self._lock.wait(timeout=wait_s)
            if self._waiting and self.window_s > 0 and not self._draining:
                # requests sent together arrive a few ms apart: let them join this round (other replicas, a batch)
                until = self._waiting[0].accepted + self.window_s
                while time.monotonic() < until and self._waiting_images() < self.max_batch * replicas:
                    self._lock.wait(timeout=max(0.0, until - time.monotonic()))
            self._expire(time.monotonic())
            if not self._waiting:
                return {"kind": "stop" if self._draining and not self._running else "idle"}
            now = time.monotonic()
            chosen = self._take_batches(replicas)
            for replica, batch in enumerate(chosen):
                for job in batch:
                    job.replica, job.started = replica, now
                    self._running[job.id] = job
            return {"kind": "work", "batches": [[job.work_item() for job in batch] for batch in chosen]}

    def _waiting_images(self) -> int:
        return sum(job.request.n for job in self._waiting)

    def _take_batches(self, replicas: int) -> list[list[Job]]:
        """Spread first, then batch: each replica takes the oldest waiting request (so idle replicas never wait while
        a request could run), then each batch is joined by later compatible requests while its images fit in
        max_batch."""
        batches = [[self._waiting.pop(0)] if self._waiting else [] for _ in range(replicas)]
        for batch in batches:
            if not batch:
                continue
            key, images = batch[0].request.batch_key(), batch[0].request.n
            for job in list(self._waiting):
                if job.request.batch_key() == key and images + job.request.n <= self.max_batch:
                    self._waiting.remove(job)
                    batch.append(job)
                    images += job.request.n
        return batches

    def _expire(self, now: float) -> None:
        for job in [job for job in self._waiting if job.deadline < now]:
            self._waiting.remove(job)
            self._answer(job, 504, f"the request waited {now - job.accepted:.1f} s in the queue, past the server's "
                                   f"--request-timeout of {self.request_timeout_s:g} s")

    def complete(self, job_id: int, status: int, result: Any) -> Job | None:
        with self._lock:
            job = self._running.pop(job_id, None)
            if job is not None:
                self._answer(job, status, result)
            self._lock.notify_all()
            return job

    def time_out(self, job: Job) -> None:
        """The request's deadline passed while it waited or ran: answer it 504 now (a result that comes later is
        dropped: a request is answered once)."""
        with self._lock:
            if job in self._waiting:
                self._waiting.remove(job)
            self._answer(job, 504, f"the request was not finished within the server's --request-timeout of "
                                   f"{self.request_timeout_s:g} s")

    def cancel(self, job: Job, status: int, message: str) -> None:
        """Answer `job` now with `status` (its client hung up): a waiting job leaves the queue; a running one is
        answered, and rank 0 cancels its work (answered_running)."""
        with self._lock:
            if job in self._waiting:
                self._waiting.remove(job)
            self._answer(job, status, message)

    def withdraw(self, job: Job) -> bool:
        """Take `job` out of the queue unanswered if it still waits (True); False once it runs or was answered."""
        with self._lock:
            if job in self._waiting:
                self._waiting.remove(job)
                return True
            return False

    def answered_running(self) -> list[int]:
        """The running jobs already answered (504, or cancelled): their work is no longer wanted."""
        with self._lock:
            return [job.id for job in self._running.values() if job.done.is_set()]

    def running(self, job_id: int) -> Job | None:
        with self._lock:
            return self._running.get(job_id)

    def running_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._running)

    def _answer(self, job: Job, status: int, result: Any) -> None:
        if job.finish(status, result) and self._on_finish is not None:
            self._on_finish(job)

    # -- shutdown -----------------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Take no new request; the loop stops once the waiting and running ones are answered."""
        with self._lock:
            self._draining = True
            self._lock.notify_all()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def closed(self) -> str | None:
        return self._closed

    def close(self, reason: str, status: int = 503) -> None:
        """Answer every waiting and running request with `status` and refuse new ones (the server is failing)."""
        with self._lock:
            self._closed = reason
            for job in self._waiting + list(self._running.values()):
                self._answer(job, status, f"the server failed before this request finished: {reason}")
            self._waiting.clear()
            self._running.clear()
            self._lock.notify_all()
