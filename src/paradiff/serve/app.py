"""The HTTP side of `paradiff serve`, on rank 0: FastAPI endpoints in a uvicorn thread, the scheduler they feed, and
what rank 0's dispatcher (dispatch.py) asks of them (a replica ready, the answers of its batch, a fault's outcome).

    POST /v1/images/generations   OpenAI's image request (prompt, n, size, response_format b64_json) + paradiff's
                                  fields (seed, steps, guidance, negative_prompt, true_cfg_scale)
    POST /v1/images/edits         OpenAI's edit (multipart: image or image[], mask, prompt, n, size, ...) on a pipeline
                                  whose call takes an image (images.py)
    POST /v1/images/variations    answered 400: not served (edits are)
    POST /v1/videos               an asynchronous video job (OpenAI's videos API; jobs.py): GET /v1/videos lists,
                                  GET /v1/videos/{id} follows, GET /v1/videos/{id}/content downloads (MP4, thumbnail),
                                  DELETE /v1/videos/{id} cancels and deletes
    GET  /v1/info                 what the loaded pipeline takes (kind, sizes, steps, frames, adapters): for the page
    GET  /                        the web page (static/index.html), which uses the routes above and nothing else
    GET  /v1/models, /v1/models/{id}   the one model served
    GET  /health                  {"status": "loading" | "ready" | "degraded" | "draining" | "failed"}; never needs the
                                  API key
    GET  /metrics                 Prometheus text
    GET  /openapi.json, /docs     the schema of the loaded pipeline (schema.py)

Every error answer is JSON in OpenAI's error shape, counted in /metrics and one line of requests.jsonl;
HttpGuard refuses foreign hosts and origins, missing keys, large and non-JSON bodies before FastAPI reads them.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hmac
import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from paradiff.runtime.console import say
from paradiff.serve.images import MIME_TYPES, encode_output, parse_edit_request
from paradiff.serve.jobs import LIST_LIMIT, Jobs, form_fields, keep_results, open_store, video_object
from paradiff.serve.adapters import adapter_endpoint, adapter_registry
from paradiff.serve.metrics import Metrics
from paradiff.serve.protocol import (ENDPOINTS, ImageRequest, Limits, RequestError, error_body, parse_image_request,
                                     quoted, with_seed)
from paradiff.serve.safety import RequestGuard, public_message, timed_h11_protocol
from paradiff.serve.schema import openapi_document
from paradiff.serve.scheduler import Job, Scheduler
from paradiff.serve.settings import ServeSettings
from paradiff.serve.stream import ProgressRouter, stream_images, wants_stream

OPEN_PATHS = ("/health", "/")  # the page holds no data: it asks for the key when the server has one
STATIC = Path(__file__).parent / "static"
DISCONNECT_POLL_S = 0.1  # how often a waiting request checks that its client is still there


def check_listen_address(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (None when it can), checked before any worker starts."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


class Frontend:
    """Rank 0's server: HTTP endpoints, scheduler, metrics and the request log."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.api_key = settings.api_key or os.environ.get("PARADIFF_API_KEY") or None
        self.model_name = settings.served_name
        self.closing = False  # a fault stopped the server: it finishes what runs and exits
        self.failed: str | None = None
        self.replica_states: dict[int, str] = {0: "loading"}  # replica -> its state (dispatch.py)
        self._loaded: set[int] = set()  # the replicas that have been ready once
        self.generation = 0
        self.metrics = Metrics()
        self.guard = RequestGuard(settings.host, settings.port, settings.allow_host, settings.allow_origin)
        self.limits: Limits | None = None
        self.scheduler = Scheduler(max_queue=settings.max_queue, max_batch=settings.max_batch,
                                   request_timeout_s=settings.request_timeout, on_finish=self._on_finish,
                                   window_s=settings.batch_window, policy=settings.schedule,
                                   max_wait_s=settings.max_wait)
        self.out = Path(settings.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self._log = (self.out / "requests.jsonl").open("a", buffering=1)
        self._log_lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None
        self._cancelled: set[int] = set()  # running requests rank 0 cancelled (their round not answered yet)
        self.loaded_at = int(time.time())  # the pipeline's load time: /v1/models' `created`
        self.replicas = 1
        self.progress = ProgressRouter(self._step_progress, self._preview)  # step events and previews (stream.py)
        self.jobs = Jobs(open_store(settings), keep_results(settings.keep_results), self.scheduler)
        self.adapters = adapter_registry(settings)  # per-request adapters (serve/adapters.py), or None

    # -- lifetime -----------------------------------------------------------------------------------------------
    def start(self) -> "Frontend":
        import uvicorn

        settings = self.settings
        config = uvicorn.Config(HttpGuard(build_app(self), self), host=settings.host, port=settings.port,
                                log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                                loop="asyncio", http=timed_h11_protocol(settings.read_timeout), timeout_keep_alive=5,
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="paradiff-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {settings.host}:{settings.port}")
            time.sleep(0.02)
        say(f"paradiff serve: listening on http://{settings.host}:{settings.port} (loading the pipeline)")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
        self._log.close()
        self.jobs.store.close()

    @property
    def health(self) -> str:
        """failed, draining; loading until every replica has loaded once; then ready when every replica serves,
        degraded when some do while others load again after a fault, loading when none does."""
        if self.failed is not None:
            return "failed"
        if self.scheduler.draining:
            return "draining"
        serving = [state in ("ready", "busy") for state in self.replica_states.values()]
        if self.limits is None or not any(serving) or len(self._loaded) < len(self.replica_states):
            return "loading"
        return "ready" if all(serving) else "degraded"

    def replica_state(self, index: int, state: str) -> None:
        self.replica_states[index] = state
        self.scheduler.replicas = max(1, sum(s in ("ready", "busy") for s in self.replica_states.values()))

    def replica_ready(self, index: int, info: dict, ranks: list[dict], generation: int) -> None:
        """Replica `index` loaded (again, when `generation` > 0); the first one sets the request limits."""
        settings = self.settings
        self.metrics.memory({entry["rank"]: entry["memory"] for entry in ranks})
        self._loaded.add(index)
        if self.limits is None:
            accepts = frozenset(info["accepts"])
            self.limits = Limits(max_n=settings.max_n, max_side=settings.limit_side, max_steps=settings.limit_steps,
                                 max_frames=settings.limit_frames, default_size=(settings.width, settings.height),
                                 default_steps=settings.steps, default_guidance=settings.guidance_scale,
                                 default_true_cfg=settings.true_cfg_scale, default_frames=settings.frames,
                                 default_fps=settings.fps, model_name=self.model_name, kind=info["kind"],
                                 accepts=accepts,
                                 adapters=tuple((name, scale) for name, scale in info["adapters"]),
                                 inputs=frozenset(info.get("inputs", ())), pipeline=info.get("pipeline", ""))
            # classic CFG (two branches when guidance > 1): a pipeline with a negative prompt and no true_cfg_scale
            self.scheduler.classic_cfg = "negative_prompt" in accepts and "true_cfg_scale" not in accepts
            self.replicas = info["replicas"]
            self.loaded_at = int(time.time())
            if self.adapters is not None:
                self.adapters.modules = frozenset(info.get("adapter_modules", ())) or None
        self.generation = max(self.generation, generation)
        again = " again, after a fault" if generation else ""
        which = f"replica {index} " if self.replicas > 1 else ""
        first = not generation and len(self._loaded) == self.replicas
        if generation or all(self.replica_states.get(r) in ("ready", "busy") for r in range(self.replicas)):
            say(f"paradiff serve: {which if generation else ''}ready{again}: {self.model_name} ({info['kind']}s) on "
                f"{len(ranks) * self.replicas} rank(s), {self.replicas} replica(s), at "
                f"http://{settings.host}:{settings.port}; "
                f"{info.get('previews', 'no previews')}")
        if first and self.jobs.interrupted:
            say(f"paradiff serve: {len(self.jobs.interrupted)} video job(s) ran when the server last stopped without "
                "a drain: marked failed (server_restarted)")
        if info["kind"] == "video" and not self.scheduler.draining and self.failed is None:
            self.jobs.ready(self.limits)  # the jobs still queued (from before a restart too) run now

    replicas = 1

    def drain(self) -> None:
        self.jobs.hold()  # the queued video jobs stay queued in the store: they run after the restart
        self.scheduler.drain()

    def fail(self, cause: str) -> None:
        """The server stops: waiting requests get 503, running ones on healthy replicas finish; queued video jobs
        stay queued in the store (they run after the restart)."""
        self.closing = True
        self.failed = cause
        self.jobs.hold()
        self.scheduler.close(cause, keep_running=True)

    # -- rank 0's dispatcher ------------------------------------------------------------------------------------
    def feed_jobs(self) -> None:
        """Now and then (JOBS_LOOK_S): the video jobs left unclaimed in the store (a server sharing it drained, or
        died: serve/jobs.py) are submitted here while this server takes work."""
        self.jobs.feed()

    def started(self, items: list[dict]) -> None:
        """A replica was handed `items` (the dispatcher): the video jobs among them are in progress."""
        self.jobs.started([item["id"] for item in items])

    def to_cancel(self) -> list[int]:
        """The running requests already answered (504, or the client hung up) not yet cancelled: rank 0 cancels them."""
        ids = [job_id for job_id in self.scheduler.answered_running() if job_id not in self._cancelled]
        self._cancelled.update(ids)
        return ids

    def finish_batch(self, items: list[dict], channel, summaries: list[dict], replica: int = 0) -> None:
        """A replica ran `items`: answer each (its result from the store, a refusal, a request's own fault)."""
        # every preview is sent before its final image
        self.progress.finish_round(channel, [replica], [item["id"] for item in items])
        for summary in summaries:
            if summary["step_s"]:
                self.metrics.replica_steps(replica, summary["step_s"])
        self.metrics.memory({s["rank"]: s["memory"] for s in summaries})
        self.metrics.rss({s["rank"]: s["rss"] for s in summaries})
        seconds = max(s["seconds"] for s in summaries)
        self.metrics.pipeline_time(seconds)
        failed = {int(k): v for s in summaries for k, v in s["failed"].items()}
        cancelled = {int(k): v for s in summaries for k, v in s["cancelled"].items()}
        refused = {int(k): v for s in summaries for k, v in s["refused"].items()}
        by_id = {item["id"]: item for item in items}
        self.metrics.cancelled(len(cancelled), sum((by_id[i]["steps"] - ran) * len(by_id[i]["seeds"])
                                                   for i, ran in cancelled.items()))
        for job_id, problem in refused.items():
            self._cancelled.discard(job_id)
            self.scheduler.complete(job_id, 400, problem)
        ran = [item for item in items if item["id"] not in refused]
        self._answer_batch(ran, channel, None, failed, seconds)

    def replica_fault(self, index: int, replicas: int, cause: str, decision: str, channel=None,
                      items: list[dict] | None = None) -> None:
        which = f"replica {index}: " if replicas > 1 else ""
        say(f"paradiff serve: fault: {which}{cause}; " + (
            f"recovering: loading {'its' if replicas > 1 else 'the'} pipeline again" if decision == "recover"
            else "stopping"))
        # the state first: a client answered 500 next and asking /health at once must not still read "ready"
        self.replica_state(index, "loading" if decision == "recover" else "failed")
        if decision == "stop":
            self.failed = cause
        if channel is not None:
            try:
                self.progress.finish_round(channel, [index], [item["id"] for item in items or []])
            except Exception:  # noqa: BLE001 - the store may be gone with the fault; its previews are lost with it
                pass

    def fail_batch(self, items: list[dict], channel, cause: str) -> None:
        self._answer_batch(items, channel, cause)

    def _answer_batch(self, items: list[dict], channel, cause: str | None, failed: dict | None = None,
                      seconds: float | None = None) -> None:
        """Every item is answered and its result read out of the store (deleted), answered or not; `seconds` (the
        batch's time) teaches the scheduler its rate, shared by cost."""
        total = sum(self._cost(item["id"]) for item in items) or 1.0
        for item in items:
            result = channel.take_result(item["id"])
            self._cancelled.discard(item["id"])
            if result is not None:
                share = None if seconds is None else seconds * self._cost(item["id"]) / total
                self.scheduler.complete(item["id"], 200, result, seconds=share)
            else:
                # the whole cause is on the console (replica_fault); the client gets its first line, paths cut.
                # No cause: a request cancelled after its answer (504, hang-up); completing it again is a no-op
                fault = (failed or {}).get(item["id"]) or {
                    "status": 500, "error": f"the request failed in the pipeline: {cause or 'cancelled'}"}
                self.scheduler.complete(item["id"], fault["status"], public_message(fault["error"]))

    def _cost(self, job_id: int) -> float:
        return self.scheduler.cost_of(job_id)

    # -- the HTTP side ------------------------------------------------------------------------------------------
    def _step_progress(self, replica: int, progress: dict) -> None:
        """A replica's step event (stream.py): its rate to /metrics, and to each running request as its "step" event,
        which its listeners read (a video job's progress: serve/jobs.py)."""
        if progress["elapsed_s"] > 0:
            self.metrics.replica_rate(replica, progress["step"] / progress["elapsed_s"])
        for job_id in progress["ids"]:
            job = self.scheduler.running(job_id)
            if job is not None:
                done, total = progress["items"].get(str(job_id), (progress["step"], progress["steps"]))
                job.emit({"type": "step", "step": progress["step"], "steps": progress["steps"], "done": done,
                          "total": total})

    def _preview(self, job_id: int, index: int, png: bytes) -> None:
        job = self.scheduler.running(job_id)
        if job is not None:
            job.emit({"type": "partial_image", "index": index, "data": png})

    def _on_finish(self, job: Job) -> None:
        latency = job.finished - job.accepted
        images = job.request.n if job.status == 200 else 0
        self.metrics.request_done(job.status, latency if job.status == 200 else None, images,
                                  job.request.steps * images)
        entry = {"id": job.id, "status": job.status, "kind": job.request.kind, "images": job.request.n,
                 "steps": job.request.steps, "seed": job.request.seed, "accepted": job.accepted_wall,
                 "latency_s": round(latency, 6)}
        entry["adapter"] = job.request.adapter[0] if job.request.adapter else None
        if job.status == 200:
            entry.update(replica=job.result["replica"], started=job.result["started"],
                         finished=job.result["finished"], batch=job.result.get("batch"))
        else:
            entry["error"] = str(job.result)
        with self._log_lock:
            self._log.write(json.dumps(entry) + "\n")
        say(f"paradiff serve: request {job.id}: {job.status} in {latency:.2f} s"
            + (f" (replica {entry['replica']})" if job.status == 200 else f": {entry['error']}"))

    async def generate(self, body: Any, kind: str, disconnected=None, headers: dict | None = None) -> tuple[int, dict]:
        """`disconnected()`: an awaitable check that the client hung up; then the request is answered 499 and, if it
        runs, cancelled at the next denoising step. `kind` "edit": `body` is the multipart form's (field, value)
        pairs. `headers`: filled with the answer's extra headers (Retry-After)."""
        if self.health not in ("ready", "degraded") or self.limits is None:
            return self.refused(503, f"the server is {self.health}; retry when GET /health says ready",
                                f"POST {_endpoint(kind)}")
        try:
            job = self.scheduler.submit(self.parse(body, kind))
        except RequestError as exc:
            if exc.retry_after is not None and headers is not None:
                headers["Retry-After"] = str(exc.retry_after)
            return self.refused(exc.status, str(exc), f"POST {_endpoint(kind)}", exc.param, exc.code)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        job.add_done_callback(lambda: loop.call_soon_threadsafe(_settle, done))
        while not done.done():
            left = job.deadline - time.monotonic()
            if left <= 0:
                self.scheduler.time_out(job)
                break
            try:
                await asyncio.wait_for(asyncio.shield(done), timeout=min(left, DISCONNECT_POLL_S) if disconnected
                                       else left)
            except asyncio.TimeoutError:
                if disconnected is not None and await disconnected():
                    self.scheduler.cancel(job, 499, "the client closed the connection before the answer")
                    break
        if job.status != 200:
            return _error(job.status, str(job.result))
        return 200, answer_of(job)

    def parse(self, body: Any, kind: str) -> ImageRequest:
        """A request's body (an edit's form pairs) as the ImageRequest queued: `model` naming an adapter selects it
        (serve/adapters.py), a seed drawn where none is given; a RequestError naming the field at fault."""
        body, adapter = self.adapters.resolve_model(body) if self.adapters else (body, None)
        request = (parse_edit_request(body, self.limits) if kind == "edit"
                   else parse_image_request(body, self.limits, kind))
        if adapter is not None:
            request = dataclasses.replace(request, adapter=(adapter["name"], adapter["path"], adapter["sha256"]))
        return with_seed(request)

    def refused(self, status: int, message: str, what: str, param: str | None = None,
                code: str | None = None) -> tuple[int, dict]:
        """A request answered with an error before it reached the queue: counted in /metrics, one line of
        requests.jsonl (`what`: "METHOD PATH"), and the JSON error answer."""
        self.metrics.request_done(status)
        entry = {"id": None, "status": status, "request": what, "accepted": time.time(), "error": message}
        with self._log_lock:
            if not self._log.closed:
                self._log.write(json.dumps(entry) + "\n")
        return _error(status, message, param, code)

    def refusal(self, status: int, message: str, what: str, headers: dict | None = None, param: str | None = None,
                code: str | None = None) -> JSONResponse:
        status, body = self.refused(status, message, what, param, code)
        return JSONResponse(body, status_code=status, headers=headers)

    def models(self) -> dict:
        return {"object": "list", "data": [self.model(), *(self.adapters.model_entries() if self.adapters else [])]}

    def model(self) -> dict:
        """OpenAI's model object (`created`: when the pipeline was loaded) and the adapters loaded with it."""
        adapters = [{"name": name, "scale": scale} for name, scale in (self.limits.adapters if self.limits else ())]
        return {"id": self.model_name, "object": "model", "created": self.loaded_at, "owned_by": "paradiff",
                "adapters": adapters}

    def info(self) -> dict:
        """What the loaded pipeline takes, for the web page (null while it loads)."""
        limits = self.limits
        if limits is None:
            return {"status": self.health, "pipeline": None}
        return {"status": self.health, "pipeline": {
            "model": limits.model_name, "kind": limits.kind,
            "size": f"{limits.default_size[0]}x{limits.default_size[1]}",
            "size_multiple": limits.size_multiple, "max_side": limits.max_side, "steps": limits.default_steps,
            "max_steps": limits.max_steps, "frames": limits.default_frames, "max_frames": limits.max_frames,
            "fps": limits.default_fps, "max_n": limits.max_n, "guidance": limits.default_guidance,
            "negative_prompt": "negative_prompt" in limits.accepts,
            "adapters": [{"name": name, "scale": scale} for name, scale in limits.adapters]}}

    def create_video(self, body: Any) -> dict:
        """POST /v1/videos: the job, queued; a RequestError saying why not."""
        if self.health not in ("ready", "degraded") or self.limits is None:
            raise RequestError(503, f"the server is {self.health}; retry when GET /health says ready")
        if self.limits.kind != "video":
            raise RequestError(400, "/v1/videos: this server's pipeline makes images; use /v1/images/generations")
        return self.jobs.create(body, self.limits, self.settings.max_queue)

    def render_metrics(self) -> str:
        queued, running = self.scheduler.depth()
        running_on = self.scheduler.running_on()
        return self.metrics.render(queued, running, self.health, queued_cost=self.scheduler.queued_cost()[0],
                                   expected_wait=self.scheduler.expected_wait(), replicas=dict(self.replica_states),
                                   replica_running={r: running_on.get(r, 0) for r in self.replica_states},
                                   job_store=self.jobs.store_state())


def answer_of(job: Job) -> dict:
    """A finished job's 200 answer: OpenAI's ImagesResponse, each item with its seed (image i: seed + i) and, for a
    video, its mime type; images in the asked output format."""
    request = job.request
    data = []
    for file, seed in zip(job.result["files"], request.seeds()):
        item = {"b64_json": None, "seed": seed}
        if request.kind == "video":
            item.update(b64_json=base64.b64encode(file["data"]).decode(), mime_type=file["mime"])
        else:
            encoded = encode_output(file["data"], request.output_format, request.output_compression)
            item["b64_json"] = base64.b64encode(encoded).decode()
        data.append(item)
    answer = {"created": int(job.accepted_wall), "data": data, "size": f"{request.width}x{request.height}"}
    if request.kind != "video":
        answer.update(output_format=request.output_format, mime_type=MIME_TYPES[request.output_format])
    return answer


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> tuple[int, dict]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}} (code: a string, protocol.error_body)."""
    return status, error_body(status, message, param, code)


def byte_range(data: bytes, mime: str, header: str | None) -> Response:
    """A result's bytes as a file is served: whole (200, Accept-Ranges), or the one range a `Range: bytes=A-B` header
    asks for (206; 416 for a range outside them), which a browser's video player sends to seek."""
    size = len(data)
    whole = {"accept-ranges": "bytes"}
    match = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header or "")
    if not match or match.groups() == ("", ""):
        return Response(data, media_type=mime, headers=whole)  # none, or several ranges: the whole file (RFC 9110)
    first, last = match.groups()
    if first == "":  # the last N bytes
        start, end = max(0, size - int(last)), size - 1
    else:
        start, end = int(first), min(size - 1, int(last)) if last else size - 1
    if start >= size or start > end:
        return Response(status_code=416, headers={**whole, "content-range": f"bytes */{size}"})
    return Response(data[start:end + 1], status_code=206, media_type=mime,
                    headers={**whole, "content-range": f"bytes {start}-{end}/{size}"})


def retry_headers(exc: RequestError) -> dict | None:
    """Retry-After for an error that says when a retry is worth it."""
    return {"retry-after": str(exc.retry_after)} if exc.retry_after else None


def _endpoint(kind: str) -> str:
    return ENDPOINTS[kind]


# the request line and headers: uvicorn (h11) closes a connection whose headers pass it while still arriving; the
# application answers 431 to those that arrived whole
MAX_HEADER_BYTES = 16 * 1024


def server_max_side(settings: ServeSettings) -> int:
    """The largest side a request may ask (ServeSettings.limit_side)."""
    return settings.limit_side


def server_max_steps(settings: ServeSettings) -> int:
    """The most steps a request may ask (ServeSettings.limit_steps)."""
    return settings.limit_steps


def server_max_frames(settings: ServeSettings) -> int:
    """The most frames a video request may ask (ServeSettings.limit_frames)."""
    return settings.limit_frames


class HttpGuard:
    """The ASGI application uvicorn runs: the header checks (safety.py), the API key and the body's announced size
    before FastAPI sees a request; and an error no endpoint answered as one console line instead of a traceback
    (FastAPI has answered it already, with the JSON of `internal_error`)."""

    def __init__(self, app: FastAPI, frontend: Frontend) -> None:
        self.app, self.frontend = app, frontend

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        frontend = self.frontend
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        method, path = scope["method"], scope["path"]
        preflight = method == "OPTIONS" and "access-control-request-method" in headers \
            and frontend.guard.allows_origin(headers.get("origin", ""))
        extra = None
        try:
            size = sum(len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > MAX_HEADER_BYTES:  # h11 bounds only headers that arrive in pieces
                raise RequestError(431, f"the request headers are {size} bytes; at most {MAX_HEADER_BYTES}")
            frontend.guard.check_sender(headers)
            if frontend.api_key and path not in OPEN_PATHS and not preflight:
                scheme, _, given = headers.get("authorization", "").strip().partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                         frontend.api_key.encode()):
                    extra = {"WWW-Authenticate": 'Bearer realm="paradiff"'}
                    raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'")
            length = headers.get("content-length")
            max_body = frontend.settings.max_body_bytes
            if length is not None and (not length.isdigit() or int(length) > max_body):
                raise RequestError(413, f"the request body ({length} bytes) is larger than --max-body-bytes "
                                        f"{max_body}")
            frontend.guard.check_body(method, path, headers)
        except RequestError as exc:
            return await frontend.refusal(exc.status, str(exc), f"{method} {path}", extra, param=exc.param,
                                          code=exc.code)(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        except Exception as exc:  # noqa: BLE001 - answered (500, JSON) by internal_error; said once, here
            say(f"paradiff serve: internal error on {method} {path}: {type(exc).__name__}: {exc}")


def build_app(frontend: Frontend) -> FastAPI:
    import paradiff

    version = getattr(paradiff, "__version__", "0")
    app = FastAPI(title="paradiff serve", version=version,
                  description="A diffusers pipeline split over a device mesh, loaded once.")
    # the schema of the loaded pipeline: its one generation endpoint, its bounds (schema.py)
    app.openapi = lambda: openapi_document(frontend.limits, app.title, version, bool(frontend.api_key))
    max_body, read_timeout = frontend.settings.max_body_bytes, frontend.settings.read_timeout
    if frontend.settings.allow_origin:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=frontend.settings.allow_origin,
                           allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["authorization", "content-type"])

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # no such path (404), another method (405)
        message = {404: f"no endpoint {request.url.path}; docs/serve.md lists them",
                   405: f"{request.url.path} does not take {request.method}"}.get(exc.status_code, str(exc.detail))
        return frontend.refusal(exc.status_code, message, f"{request.method} {request.url.path}", exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # said on the console by HttpGuard
        return frontend.refusal(500, "internal server error (the server's console names it)",
                                f"{request.method} {request.url.path}")

    async def body_of(request: Request) -> Any:
        """JSON, or (POST /v1/videos, as OpenAI's client sends it) a multipart form read as the JSON it stands for."""
        raw = await bytes_of(request)
        if request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
            return form_fields(await form_of(request, raw))
        try:
            return json.loads(raw)
        except RecursionError:
            raise RequestError(400, "the body is not JSON this server reads: nested too deeply") from None
        except ValueError as exc:
            raise RequestError(400, f"the body is not JSON: {exc}") from None

    async def bytes_of(request: Request) -> bytes:
        """The body, within --max-body-bytes and --read-timeout."""
        raw = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                raw.extend(chunk)
                if len(raw) > max_body:
                    raise RequestError(413, f"the request body is larger than --max-body-bytes {max_body}")

        try:
            await asyncio.wait_for(read(), timeout=read_timeout)
        except asyncio.TimeoutError:
            raise RequestError(408, f"the body was not received within --read-timeout {read_timeout:g} s") from None
        except ClientDisconnect:
            raise RequestError(499, "the client disconnected before its body was received") from None
        return bytes(raw)

    async def answer(request: Request, kind: str):
        try:
            body = await body_of(request)
        except RequestError as exc:
            return frontend.refusal(exc.status, str(exc), f"POST {_endpoint(kind)}", param=exc.param, code=exc.code)
        if kind == "image" and wants_stream(body):  # server-sent events
            return await stream_images(frontend, body, _error)
        headers: dict = {}
        status, payload = await frontend.generate(body, kind, request.is_disconnected, headers)
        return JSONResponse(payload, status_code=status, headers=headers or None)

    @app.post("/v1/images/generations")
    async def images(request: Request):
        return await answer(request, "image")

    @app.post("/v1/videos")
    async def videos(request: Request):
        try:
            body = await body_of(request)
        except RequestError as exc:
            return frontend.refusal(exc.status, str(exc), "POST /v1/videos", param=exc.param)
        try:  # in a thread: the store may be a database server a network away
            job = await asyncio.to_thread(frontend.create_video, body)
        except RequestError as exc:
            return frontend.refusal(exc.status, str(exc), "POST /v1/videos", retry_headers(exc), exc.param, exc.code)
        return JSONResponse(video_object(job))

    async def job_call(what: str, call):
        """A video job call, in a thread (the store may be a database server a network away: a slow answer holds no
        other request), its RequestError the error answer."""
        try:
            return await asyncio.to_thread(call)
        except RequestError as exc:
            return frontend.refusal(exc.status, str(exc), what, retry_headers(exc), exc.param, exc.code)

    @app.get("/v1/videos")
    async def video_list(request: Request):
        query = request.query_params

        def page():
            limit, order = query.get("limit", str(LIST_LIMIT[0])), query.get("order", "desc")
            if not (limit.isascii() and limit.isdigit()) or not 1 <= int(limit) <= LIST_LIMIT[1]:
                raise RequestError(400, f"limit {quoted(limit)}: expected an integer from 1 to {LIST_LIMIT[1]}",
                                   "limit")
            if order not in ("asc", "desc"):
                raise RequestError(400, f"order {quoted(order)}: expected 'asc' or 'desc'", "order")
            after = query.get("after")
            if after is not None:  # a job deleted since the page that named it still marks its place
                frontend.jobs.known(after, deleted=True)
            jobs, more = frontend.jobs.store.page(after, int(limit), order)
            data = [video_object(job) for job in jobs]
            return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                    "last_id": data[-1]["id"] if data else None, "has_more": more}

        return await job_call("GET /v1/videos", page)

    @app.get("/v1/videos/{video_id}")
    async def video(video_id: str):
        return await job_call("GET /v1/videos/{id}", lambda: video_object(frontend.jobs.known(video_id)))

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(request: Request, video_id: str, variant: str = "video"):
        def content():
            data, mime = frontend.jobs.content(video_id, variant)
            return byte_range(data, mime, request.headers.get("range"))

        return await job_call("GET /v1/videos/{id}/content", content)

    @app.delete("/v1/videos/{video_id}")
    async def video_delete(video_id: str):
        def delete():
            frontend.jobs.known(video_id)
            frontend.jobs.delete(video_id)
            return {"id": video_id, "object": "video.deleted", "deleted": True}

        return await job_call("DELETE /v1/videos/{id}", delete)

    @app.get("/v1/info")
    async def info():
        return frontend.info()

    @app.get("/")
    async def page():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/v1/models")
    async def models():
        return frontend.models()

    add_openai_routes(app, frontend, bytes_of)
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return await adapter_endpoint(frontend, request, "load", body_of)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return await adapter_endpoint(frontend, request, "unload", body_of)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: a load balancer's probe (the same status, no body)
    async def health():
        health = frontend.health
        return JSONResponse({"status": health}, status_code=200 if health in ("ready", "degraded") else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(frontend.render_metrics(), media_type="text/plain; version=0.0.4")

    return app


def add_openai_routes(app: FastAPI, frontend: Frontend, bytes_of) -> None:
    """OpenAI's routes beyond generations: edits (multipart), variations (refused), one model by id.
    `bytes_of(request)`: the body within --max-body-bytes and --read-timeout."""

    @app.post("/v1/images/edits")
    async def edits(request: Request):
        try:
            fields = await form_of(request, await bytes_of(request))
        except RequestError as exc:
            return frontend.refusal(exc.status, str(exc), "POST /v1/images/edits", param=exc.param, code=exc.code)
        if wants_stream(fields):  # server-sent events, as for a generation
            return await stream_images(frontend, fields, _error, "edit")
        status, payload = await frontend.generate(fields, "edit", request.is_disconnected)
        return JSONResponse(payload, status_code=status)

    @app.post("/v1/images/variations")
    async def variations():
        return frontend.refusal(400, "/v1/images/variations is not served: no pipeline here draws variations without "
                                     "a prompt; send the image and a prompt to POST /v1/images/edits",
                                "POST /v1/images/variations", code="unsupported_endpoint")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        adapter = next((entry for entry in (frontend.adapters.model_entries() if frontend.adapters else [])
                        if entry["id"] == model_id), None)
        if adapter is not None:  # an adapter loaded per request (serve/adapters.py): a model id of its own
            return adapter
        if model_id != frontend.model_name:
            return frontend.refusal(404, f"model {quoted(model_id)} is not served here; this server serves "
                                         f"{frontend.model_name!r}", f"GET /v1/models/{model_id}", param="model",
                                    code="model_not_found")
        return frontend.model()


async def form_of(request: Request, body: bytes) -> list[tuple[str, Any]]:
    """A multipart/form-data body (already read, bounded) as (field, text or file bytes) pairs."""
    from starlette.datastructures import UploadFile
    from starlette.formparsers import MultiPartException, MultiPartParser

    async def chunks():
        yield body

    try:
        form = await MultiPartParser(request.headers, chunks(), max_files=16, max_fields=64,
                                     max_part_size=len(body) + 1).parse()
    except MultiPartException as exc:
        raise RequestError(400, f"the body is not a multipart form this server reads: {exc.message}") from None
    fields = []
    for name, value in form.multi_items():
        fields.append((name, await value.read() if isinstance(value, UploadFile) else value))
    await form.close()
    return fields
