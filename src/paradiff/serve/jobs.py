"""Asynchronous video jobs of `paradiff serve` (OpenAI's /v1/videos), kept in a job store (serve/jobstore.py).

    POST   /v1/videos                 create a job (multipart/form-data as OpenAI's client sends it, or JSON): answered
                                      at once with the Video object, status "queued", progress 0
    GET    /v1/videos                 list (after, limit, order; newest first by default)
    GET    /v1/videos/{id}            the job: queued -> in_progress (progress by denoising steps) -> completed | failed
    GET    /v1/videos/{id}/content    the MP4 (variant=video), its first frame as PNG (variant=thumbnail)
    DELETE /v1/videos/{id}            cancel (a running job stops at the next denoising step) and delete

The store, `--jobs-db` (a SQLite file, by default `<--out>/jobs.db`, or a database server's URL), keeps every job's
parameters, state, progress, error and result files; several servers may share it (JobStore's owners). It survives
restarts:
- a job still queued when the server stopped (SIGTERM drains the running job and leaves the queued ones queued; a
  fault that stops the server does the same) runs when the server is ready again;
- a job that was running when the server died (kill -9, a machine lost) is marked failed, code "server_restarted",
  on the next start: it is not run again (a job that killed the server would kill it again); create it anew, its
  seed redraws the same video;
- results are kept per `--keep-results` (a count of completed jobs, e.g. 100, or an age: 30m, 12h, 7d); an older
  result's files are deleted, its job stays retrievable (`expires_at` says when) and its content answers 410;
- a deleted job's id stays known: it answers 404 saying it was deleted, not that it never existed.

Jobs (below) links the store to the scheduler: a queued job is submitted to it with no deadline; its round, steps and
cancellation are the synchronous requests' own, and its `progress` is read from the "step" events of its scheduler
job (the replica's step events, stream.py: the same events a streamed request's answer reads). This module imports
no torch.
"""

from __future__ import annotations

import math
import re
import threading
import time
from functools import partial
from typing import Any, Callable

from paradiff.runtime.console import say
from paradiff.serve.jobstore import JobStore, StoreError
from paradiff.serve.protocol import Limits, RequestError, parse_image_request, quoted, with_seed

STATES = ("queued", "in_progress", "completed", "failed")
ORPHANED = ("the server stopped while this job ran (it was killed or failed) and did not finish it; create it again "
            "(the same seed redraws the same video)")
AGES = {"s": 1, "m": 60, "h": 3600, "d": 86400}
LIST_LIMIT = (20, 100)  # default and most items of one GET /v1/videos page
# OpenAI's fields besides the request's own: `seconds` sets frames (seconds * fps + 1) when `frames` is not given;
# `input_reference` (an image to start from) is refused: the video pipelines served here take none
OPENAI_ONLY = ("seconds", "input_reference")
INTEGER_FIELDS = ("n", "seed", "steps", "frames", "fps")
NUMBER_FIELDS = ("guidance", "true_cfg_scale", "seconds")

def keep_results(text: str) -> tuple[str, float]:
    """--keep-results: ("count", N) for a plain number, ("age", seconds) for N followed by s, m, h or d."""
    match = re.fullmatch(r"\s*(\d+)\s*([smhd]?)\s*", str(text))
    if not match or int(match.group(1)) <= 0:
        raise ValueError(f"--keep-results {text!r}: expected a positive count of results (e.g. 100) or an age "
                         "(e.g. 30m, 12h, 7d)")
    number, unit = int(match.group(1)), match.group(2)
    return ("age", float(number * AGES[unit])) if unit else ("count", float(number))


def open_store(settings) -> JobStore:
    """The store a server's settings name (serve/settings.py: ServeSettings.jobs_db): a file or a database URL."""
    return JobStore(settings.jobs_where)


def video_object(job: dict) -> dict:
    """The job as OpenAI's Video object, plus paradiff's `parameters` (what was asked: seed, steps, frames...)."""
    return {"id": job["id"], "object": "video", "created_at": job["created_at"], "status": job["status"],
            "progress": job["progress"], "model": job["model"], "prompt": job["params"].get("prompt"),
            "size": job["size"], "seconds": job["seconds"], "completed_at": job["completed_at"],
            "expires_at": job["expires_at"], "error": job["error"], "remixed_from_video_id": None,
            "parameters": {k: v for k, v in job["params"].items() if k != "prompt"}}


def form_fields(form: list[tuple[str, Any]]) -> dict:
    """A multipart form as the JSON body it stands for: OpenAI's client sends every field as text (extra_body's
    numbers too, and an object as `name[key]` fields), so the numeric fields are read back as numbers."""
    body: dict[str, Any] = {}
    for name, value in form:
        if not isinstance(value, str):  # an uploaded file
            body[name] = value
            continue
        nested = re.fullmatch(r"([A-Za-z_]+)\[([^\]]*)\]", name)
        if nested:
            body.setdefault(nested.group(1), {})[nested.group(2)] = _number_text(nested.group(0), value)
        elif name in INTEGER_FIELDS or name in NUMBER_FIELDS:
            body[name] = _number_text(name, value)
        else:
            body[name] = value
    return body


def _number_text(name: str, value: str) -> Any:
    try:
        number = float(value)
    except ValueError:
        raise RequestError(400, f"{name}: expected a number, got {quoted(value)}", name) from None
    return int(number) if number.is_integer() else number



def video_seconds(value: Any) -> float:
    """OpenAI's `seconds` (a string there, "4"; a number taken too) as a finite positive number, or a 400 naming it."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) or number <= 0:
        raise RequestError(400, f"seconds: expected a positive number of seconds (e.g. \"4\"), got {quoted(value)}",
                           "seconds")
    return float(number)

class Jobs:
    """The jobs of one server: the store and their scheduler tickets."""

    def __init__(self, store: JobStore, policy: tuple[str, float], scheduler) -> None:
        self.store, self.policy, self.scheduler = store, policy, scheduler
        self.limits: Limits | None = None
        self._lock = threading.RLock()
        self._tickets: dict[str, Any] = {}  # video id -> its scheduler Job while it is submitted
        self._ids: dict[int, str] = {}  # scheduler job id -> video id
        self._held = False  # draining or stopping: nothing more is submitted
        self._unwritten: list[Callable[[], None]] = []  # finished jobs' results, in order, until the store takes them
        self._writing = threading.Lock()
        self._away = False  # the store did not answer rank 0's side (said once, until it answers again)
        self.interrupted = store.orphans(ORPHANED)
        self._expire()

    # -- the HTTP side ------------------------------------------------------------------------------------------
    def create(self, body: Any, limits: Limits, max_queue: int) -> dict:
        """The job of a POST /v1/videos body, queued (RequestError for a bad field or a full queue)."""
        if not isinstance(body, dict):
            raise RequestError(400, f"the body must be a JSON object or a form, got {type(body).__name__}")
        body = dict(body)
        if body.get("input_reference") not in (None, ""):
            raise RequestError(400, "input_reference: this server's video pipeline starts from no image; send "
                                    "the prompt alone")
        body.pop("input_reference", None)
        seconds = body.pop("seconds", None)
        if body.get("n") not in (None, 1):
            raise RequestError(400, f"n: a video job makes one video, got {quoted(body['n'])}", "n")
        fps = body.get("fps") if body.get("fps") is not None else limits.default_fps
        if seconds is not None and body.get("frames") is None:
            seconds = video_seconds(seconds)
            if isinstance(fps, int) and not isinstance(fps, bool) and 1 <= fps <= 120:
                frames = int(round(seconds * fps)) + 1
                if frames > limits.max_frames:
                    raise RequestError(400, f"seconds {seconds:g} at {fps} fps makes {frames} frames; at most "
                                            f"{limits.max_frames} here (seconds up to "
                                            f"{(limits.max_frames - 1) / fps:g} at {fps} fps)", "seconds")
                body["frames"] = frames
        request = with_seed(parse_image_request(body, limits, "video"))  # a drawn seed is kept: a re-run redraws it
        if self.store.count_queued() >= max_queue:
            error = RequestError(503, f"the queue is full ({max_queue} queued jobs); retry later")
            error.retry_after = 5
            raise error
        params = {k: v for k, v in body.items() if k not in ("model", "user", "n", "response_format")}
        params.update(seed=request.seed, steps=request.steps, fps=request.fps, size=f"{request.width}x{request.height}")
        if request.frames is not None:
            params["frames"] = request.frames
        frames = request.frames or limits.default_frames
        length = f"{frames / request.fps:g}" if frames else str(seconds or "")
        # this server's from the start while it takes work (it runs it, or releases it for the others)
        job = self.store.add("video", limits.model_name, params, params["size"], length,
                             claimed=self.limits is not None and not self._held)
        self.feed()
        return job

    def delete(self, job_id: str) -> bool:
        """Cancel (a queued job leaves the queue, a running one stops at its next denoising step) and delete."""
        job = self.store.get(job_id)
        if job is None or job["deleted_at"] is not None:
            return False
        self.store.deleted(job_id)  # first (a StoreError changes nothing): the ticket's answer changes nothing now
        with self._lock:
            ticket = self._tickets.pop(job_id, None)
        if ticket is not None:
            self.scheduler.cancel(ticket, 499, f"video {job_id} was deleted")
        return True

    # -- rank 0's side ------------------------------------------------------------------------------------------
    def ready(self, limits: Limits) -> None:
        self.limits = limits
        self.feed()

    def feed(self) -> None:
        """Submit the queued jobs not submitted yet (in order), while the scheduler takes them; first the results
        the store could not take when they came (StoreError: it was away)."""
        try:
            with self._writing:  # one thread writes them (a result written twice would be refused)
                while self._unwritten:
                    self._unwritten[0]()
                    self._unwritten.pop(0)
            if self.limits is None or self._held:
                return
            self.store.orphans(ORPHANED)  # a server sharing the store died: its jobs (below) run here
            self._feed()
        except StoreError as exc:
            self._store_away(exc)
            if self.store.cut_off():  # the others may soon take the jobs claimed here: none of them starts here now
                self._withdraw_waiting()
            return
        self._store_back()

    def _feed(self) -> None:
        for job in self.store.queued():
            with self._lock:
                if job["id"] in self._tickets or self._held or (job["owner"] is None
                                                                and not self.store.claim(job["id"])):
                    continue  # submitted already, or another server's now
                try:
                    request = parse_image_request(job["params"], self.limits, "video")
                except RequestError as exc:  # the server restarted with other limits
                    self.store.failed(job["id"], "invalid_request", f"the job no longer fits this server: {exc}")
                    continue
                try:
                    ticket = self.scheduler.submit(request, deadline=False)
                except RequestError:
                    self.store.release(job["id"])
                    return  # the scheduler's queue is full or it is stopping: the job stays queued
                self._tickets[job["id"]] = ticket
                self._ids[ticket.id] = job["id"]
            ticket.add_listener(lambda event, i=job["id"]: self._on_event(i, event))
            ticket.add_done_callback(lambda t=ticket, i=job["id"]: self._done(i, t))

    def _store_away(self, exc: StoreError) -> None:
        """Rank 0's side met the store away (a database server restarting, a network cut): said once; image
        requests go on, the jobs wait (feed retries once a second, through the dispatcher)."""
        if not self._away:
            self._away = True
            say(f"paradiff serve: the video jobs' store {exc.where} cannot be reached ({exc.reason}): the jobs wait for "
                "it (finished results are kept until it takes them); image requests go on")

    def store_state(self) -> tuple[bool, int]:
        """Whether the store answered rank 0's side last, and the finished jobs' results waiting for it (/metrics)."""
        return not self._away, len(self._unwritten)

    def _store_back(self) -> None:
        if self._away:
            self._away = False
            say("paradiff serve: the video jobs' store answers again")

    def started(self, ticket_ids: list[int]) -> None:
        """Rank 0 broadcasts a round with these scheduler jobs: theirs are in progress."""
        for ticket_id in ticket_ids:
            job_id = self._ids.get(ticket_id)
            if job_id is not None:
                try:
                    self.store.started(job_id)
                    self._cancel_if_deleted(job_id)
                except StoreError as exc:  # it stays queued in the store while it runs; its result completes it
                    self._store_away(exc)

    def _on_event(self, job_id: str, event: dict) -> None:
        """An event of the job's scheduler ticket: a step's event is its progress (steps done of all, 0-99 until it
        completes)."""
        if event["type"] == "step" and event["total"] > 0:
            try:
                if not self.store.progress(job_id, min(99, 100 * event["done"] // event["total"])):
                    self._cancel_if_deleted(job_id, later=True)  # listeners run under the ticket's lock: after it
            except StoreError as exc:  # a progress not written: the next step's is
                self._store_away(exc)

    def _cancel_if_deleted(self, job_id: str, later: bool = False) -> None:
        """A job deleted through a server sharing the store (its DELETE could not reach this server's ticket):
        cancelled here, now or (`later`) from a thread of its own once the caller lets go of the ticket."""
        job = self.store.get(job_id)
        if job is None or job["deleted_at"] is None:
            return
        with self._lock:
            ticket = self._tickets.pop(job_id, None)
            if ticket is not None:
                self._ids.pop(ticket.id, None)
        if ticket is None:
            return
        cancel = partial(self.scheduler.cancel, ticket, 499, f"video {job_id} was deleted")
        if later:
            threading.Thread(target=cancel, daemon=True).start()
        else:
            cancel()

    def hold(self) -> None:
        """Draining or stopping: the jobs still waiting in the scheduler leave it and stay queued in the store (they
        run after the restart); a running job finishes."""
        with self._lock:
            self._held = True
            for job_id in self._withdraw_waiting():
                try:
                    self.store.release(job_id)
                except StoreError as exc:  # still claimed: the others take it once this server is gone
                    self._store_away(exc)

    def _withdraw_waiting(self) -> list[str]:
        """The jobs still waiting in the scheduler leave it (a running one stays); their ids."""
        withdrawn = []
        with self._lock:
            for job_id, ticket in list(self._tickets.items()):
                if self.scheduler.withdraw(ticket):
                    del self._tickets[job_id]
                    self._ids.pop(ticket.id, None)
                    withdrawn.append(job_id)
        return withdrawn

    def _done(self, job_id: str, ticket) -> None:
        with self._lock:
            if self._tickets.get(job_id) is not ticket:
                return  # withdrawn or deleted
            del self._tickets[job_id]
            self._ids.pop(ticket.id, None)
        if ticket.status == 200:
            files = [{"variant": variant, "mime": file["mime"], "data": file["data"]}
                     for file, variant in zip(ticket.result["files"], ("video", "thumbnail"))]
            kind, value = self.policy
            write = partial(self._completed, job_id, files, int(time.time() + value) if kind == "age" else None)
        else:
            code = {499: "cancelled", 504: "timeout"}.get(ticket.status, "generation_failed" if ticket.status >= 500
                                                          else "invalid_request")
            write = partial(self.store.failed, job_id, code, str(ticket.result))
        self._unwritten.append(write)  # written by feed, now or once the store answers again
        self.feed()

    def _completed(self, job_id: str, files: list[dict], expires_at: int | None) -> None:
        self.store.completed(job_id, files, expires_at)
        self._expire()

    def _expire(self) -> None:
        self.store.expire(self.policy, time.time())

    def content(self, job_id: str, variant: str) -> tuple[bytes, str]:
        """The result file of a completed job: (bytes, mime), or a RequestError saying why there is none."""
        if variant not in ("video", "thumbnail", "spritesheet"):
            raise RequestError(400, f"variant {quoted(variant)}: expected 'video' or 'thumbnail'", "variant")
        job = self.known(job_id)
        if variant == "spritesheet":
            raise RequestError(400, "variant 'spritesheet': not made by this server; 'video' and 'thumbnail' are",
                               "variant")
        if job["status"] != "completed":
            raise RequestError(409 if job["status"] != "failed" else 400,
                               f"video {job_id} is {job['status']}: its content exists once it is completed")
        if job["expired"]:
            raise RequestError(410, f"the result of video {job_id} expired at {job['expires_at']} (--keep-results "
                                    "keeps the newest results) and was deleted; create the job again")
        result = self.store.result(job_id, variant)
        if result is None:
            raise RequestError(404, f"video {job_id} has no {variant}")
        return result

    def known(self, job_id: str, deleted: bool = False) -> dict:
        """The job `job_id`, or a 404 saying why not (`deleted`: a deleted job's record too, as a list's cursor)."""
        job = self.store.get(job_id)
        if job is None:
            raise RequestError(404, f"no video {quoted(job_id)} on this server (ids look like video_...; GET "
                                    "/v1/videos lists them)")
        if job["deleted_at"] is not None and not deleted:
            raise RequestError(404, f"video {job_id} was deleted at {job['deleted_at']}")
        return job

