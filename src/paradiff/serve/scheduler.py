"""The bounded queue of `paradiff serve`, on rank 0: which requests each free replica runs next, and their deadlines.

Each data-parallel replica runs on its own and asks for work as soon as it is free (ranks.py). The free replicas
first take one waiting request each (so an idle replica never waits while a request could run), then each batch is
joined by later ones with the same size, steps and guidance (ImageRequest.batch_key) while the images fit in
`max_batch`. Which request goes first is the policy's:

- "fifo": the oldest;
- "fair" (the default): the one whose arrival plus FAIR_SLACK times its own expected run time is smallest. A
  request's cost is pixels x frames x steps x CFG branches x images (request_cost); the seconds per unit of cost
  are learnt from the requests answered so far. So a short image request that arrives while a long video waits goes
  first, and a long request is never passed by requests that arrive later than its arrival plus FAIR_SLACK times
  its own run time (no starvation). Before the first answer the rate is unknown and "fair" orders as "fifo".

The expected wait of a new request is the cost queued and running, over the replicas, at the learnt rate; above
`max_wait_s` the request is refused up front (503 with Retry-After). A request waiting past its deadline is answered
504 instead of being run.
"""

from __future__ import annotations

import base64
import itertools
import math
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
    cost: float = 0.0  # request_cost
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
        Listeners run under the job's lock, so each sees the events in order: they must only hand them on or record
        them (a row of the job store), never wait."""
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


POLICIES = ("fair", "fifo")
# a request may be passed by shorter ones that arrive within this many times its own expected run time: with 1, a
# burst of long requests held short ones behind two of them (a long one that waited its run time goes first)
FAIR_SLACK = 4.0
RATE_MEMORY = 0.3  # the weight of the newest answer in the learnt seconds per unit of cost (an exponential average)


def request_cost(request: ImageRequest, classic_cfg: bool = False) -> float:
    """pixels x frames x steps x CFG branches x images: what one request asks of a replica, in the scheduler's unit.
    Two CFG branches with a true CFG scale above 1, or with a guidance above 1 where the pipeline runs classic CFG
    (`classic_cfg`: its call takes no true_cfg_scale)."""
    r = request
    branches = 2 if (r.true_cfg_scale or 0) > 1 or (classic_cfg and (r.guidance or 0) > 1) else 1
    return float(r.width * r.height * (r.frames or 1) * r.steps * branches * r.n)


class Scheduler:
    def __init__(self, max_queue: int = 64, max_batch: int = 1, request_timeout_s: float = 600.0,
                 on_finish=None, window_s: float = 0.0, policy: str = "fair", max_wait_s: float | None = None,
                 clock=time.monotonic) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--schedule {policy!r}: expected one of {list(POLICIES)}")
        self.max_queue, self.max_batch, self.request_timeout_s = max_queue, max_batch, request_timeout_s
        self.window_s = window_s  # how long a batch waits for company after the first request of an idle spell
        self.policy, self.max_wait_s, self.clock = policy, max_wait_s, clock
        self.replicas = 1  # how many replicas share the queue (set by the frontend once they are known)
        self.classic_cfg = False  # the pipeline runs classic CFG on guidance > 1 (request_cost)
        self.seconds_per_cost: float | None = None  # learnt from answered requests
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
            cost = request_cost(request, self.classic_cfg)
            if len(self._waiting) >= self.max_queue:
                error = RequestError(503, f"the queue is full ({self.max_queue} waiting requests); retry later")
                # when the queue ahead should have moved by one request's worth (a guess of 1 s before any is known)
                wait = self._expected_wait(cost)
                error.retry_after = max(1, math.ceil((wait or 1.0) / max(1, len(self._waiting))))
                raise error
            if self.max_wait_s is not None:
                wait = self._expected_wait(cost)
                if wait is not None and wait > self.max_wait_s:
                    error = RequestError(503, f"the expected wait is {wait:.1f} s, over the server's --max-wait of "
                                              f"{self.max_wait_s:g} s; retry later")
                    error.retry_after = max(1, math.ceil(wait - self.max_wait_s))
                    raise error
            now = self.clock()
            job = Job(next(self._ids), request, now, now + self.request_timeout_s if deadline else float("inf"))
            job.cost = cost
            self._waiting.append(job)
            self._lock.notify_all()
            return job

    def depth(self) -> tuple[int, int]:
        with self._lock:
            return len(self._waiting), len(self._running)

    def queued_cost(self) -> tuple[float, float]:
        """(cost waiting, cost running)."""
        with self._lock:
            return sum(job.cost for job in self._waiting), sum(job.cost for job in self._running.values())

    def expected_wait(self) -> float | None:
        """Seconds a request arriving now would wait before it runs (None while the rate is unknown)."""
        with self._lock:
            return self._expected_wait(0.0)

    def _expected_wait(self, cost: float) -> float | None:
        """What is queued and running, spread over the replicas, at the learnt rate; under "fair" only the waiting
        requests that would run before one of `cost` count."""
        if self.seconds_per_cost is None:
            return None
        now = self.clock()
        ahead = [job for job in self._waiting
                 if self.policy == "fifo" or self._priority(job) <= now + FAIR_SLACK * cost * self.seconds_per_cost]
        running = sum(max(0.0, job.cost * self.seconds_per_cost - (now - (job.started or now)))
                      for job in self._running.values())
        return (sum(job.cost for job in ahead) * self.seconds_per_cost + running) / max(1, self.replicas)

    def _priority(self, job: Job) -> float:
        if self.policy == "fifo" or self.seconds_per_cost is None:
            return job.accepted
        return job.accepted + FAIR_SLACK * job.cost * self.seconds_per_cost

    # -- rank 0's dispatch --------------------------------------------------------------------------------------
    def next_round(self, replicas: int | list[int], wait_s: float = 0.05) -> dict:
        """Work for the free replicas (`replicas`: their indices, or how many, all free):
        {"kind": "work", "batches": [items of the first free replica, ...]}, {"kind": "idle"} or {"kind": "stop"}."""
        free = list(range(replicas)) if isinstance(replicas, int) else list(replicas)
        with self._lock:
            if not self._waiting and not self._draining and self._closed is None:
                self._lock.wait(timeout=wait_s)
            if self._waiting and self.window_s > 0 and not self._draining:
                # requests sent together arrive a few ms apart: let them join this batch (other replicas, a batch)
                until = min(job.accepted for job in self._waiting) + self.window_s
                while self.clock() < until and self._waiting_images() < self.max_batch * len(free):
                    self._lock.wait(timeout=max(0.0, until - self.clock()))
            now = self.clock()
            self._expire(now)
            if not self._waiting or not free:
                ending = self._draining or self._closed is not None
                return {"kind": "stop" if ending and not self._waiting and not self._running else "idle"}
            chosen = self._take_batches(len(free))
            for replica, batch in zip(free, chosen):
                for job in batch:
                    job.replica, job.started = replica, now
                    self._running[job.id] = job
            return {"kind": "work", "batches": [[job.work_item() for job in batch] for batch in chosen]}

    def _waiting_images(self) -> int:
        return sum(job.request.n for job in self._waiting)

    def _take_batches(self, replicas: int) -> list[list[Job]]:
        """Spread first, then batch: each replica takes the first waiting request in the policy's order (so idle
        replicas never wait while a request could run), then each batch is joined by later compatible requests while
        its images fit in max_batch."""
        self._waiting.sort(key=lambda job: (self._priority(job), job.id))
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

    def complete(self, job_id: int, status: int, result: Any, seconds: float | None = None) -> Job | None:
        """Answer a running job; `seconds`: how long its batch ran (taught to the rate, per unit of cost)."""
        with self._lock:
            job = self._running.pop(job_id, None)
            if job is not None:
                if status == 200 and seconds is not None and job.cost > 0:
                    rate = seconds / job.cost
                    self.seconds_per_cost = rate if self.seconds_per_cost is None else (
                        RATE_MEMORY * rate + (1 - RATE_MEMORY) * self.seconds_per_cost)
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

    def close(self, reason: str, status: int = 503, keep_running: bool = False) -> None:
        """Answer every waiting request (and running one, unless `keep_running`: the replicas still alive finish
        theirs) with `status` and refuse new ones (the server is failing)."""
        with self._lock:
            self._closed = reason
            for job in self._waiting + ([] if keep_running else list(self._running.values())):
                self._answer(job, status, f"the server failed before this request finished: {reason}")
            self._waiting.clear()
            if not keep_running:
                self._running.clear()
            self._lock.notify_all()

    def cost_of(self, job_id: int) -> float:
        with self._lock:
            job = self._running.get(job_id)
            return job.cost if job is not None else 0.0

    def running_on(self) -> dict[int, int]:
        """replica -> how many requests it runs."""
        with self._lock:
            counts: dict[int, int] = {}
            for job in self._running.values():
                counts[job.replica] = counts.get(job.replica, 0) + 1
            return counts
