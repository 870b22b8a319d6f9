"""The HTTP side of `paradiff serve`, on rank 0: FastAPI endpoints in a uvicorn thread, the scheduler they feed, and
what rank 0's dispatcher (dispatch.py) asks of them (a replica ready, the answers of its batch, a fault's outcome).

    POST /v1/images/generations   OpenAI's image request (prompt, n, size, response_format b64_json) + paradiff's
                                  fields (seed, steps, guidance, negative_prompt, true_cfg_scale)
    POST /v1/videos               the same for video pipelines (+ frames, fps), answered with base64 MP4 files
    GET  /v1/models               the one model served
    GET  /health                  {"status": "loading" | "ready" | "degraded" | "draining" | "failed"}; never needs the
                                  API key
    GET  /metrics                 Prometheus text
    GET  /openapi.json, /docs     the schema of the loaded pipeline (schema.py)

Every error answer is JSON in OpenAI's error shape, counted in /metrics and one line of requests.jsonl;
HttpGuard refuses foreign hosts and origins, missing keys, large and non-JSON bodies before FastAPI reads them.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hmac
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from paradiff.cli.report import say
from paradiff.serve.metrics import Metrics
from paradiff.serve.protocol import Limits, RequestError, parse_image_request
from paradiff.serve.safety import RequestGuard, public_message, timed_h11_protocol
from paradiff.serve.schema import openapi_document
from paradiff.serve.scheduler import Job, Scheduler

OPEN_PATHS = ("/health",)
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

    def __init__(self, args: argparse.Namespace, model_name: str) -> None:
        self.args = args
        self.api_key = args.api_key or os.environ.get("PARADIFF_API_KEY") or None
        self.model_name = model_name
        self.closing = False  # a fault stopped the server: it finishes what runs and exits
        self.failed: str | None = None
        self.replica_states: dict[int, str] = {0: "loading"}  # replica -> its state (dispatch.py)
        self._loaded: set[int] = set()  # the replicas that have been ready once
        self.generation = 0
        self.metrics = Metrics()
        self.guard = RequestGuard(args.host, args.port, args.allow_host, args.allow_origin)
        self.limits: Limits | None = None
        self.scheduler = Scheduler(max_queue=args.max_queue, max_batch=args.max_batch,
                                   request_timeout_s=args.request_timeout, on_finish=self._on_finish,
                                   window_s=args.batch_window, policy=getattr(args, "schedule", "fair"),
                                   max_wait_s=getattr(args, "max_wait", None))
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self._log = (self.out / "requests.jsonl").open("a", buffering=1)
        self._log_lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None
        self._cancelled: set[int] = set()  # running requests rank 0 cancelled (their round not answered yet)

    # -- lifetime -----------------------------------------------------------------------------------------------
    def start(self) -> "Frontend":
        import uvicorn

        config = uvicorn.Config(HttpGuard(build_app(self), self), host=self.args.host, port=self.args.port,
                                log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                                loop="asyncio", http=timed_h11_protocol(self.args.read_timeout), timeout_keep_alive=5,
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="paradiff-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.args.host}:{self.args.port}")
            time.sleep(0.02)
        say(f"paradiff serve: listening on http://{self.args.host}:{self.args.port} (loading the pipeline)")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
        self._log.close()

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
        args = self.args
        self.metrics.memory({entry["rank"]: entry["memory"] for entry in ranks})
        self._loaded.add(index)
        if self.limits is None:
            accepts = frozenset(info["accepts"])
            self.limits = Limits(max_n=args.max_n, max_side=server_max_side(args), max_steps=server_max_steps(args),
                                 max_frames=server_max_frames(args), default_size=(args.width, args.height),
                                 default_steps=args.steps, default_guidance=args.guidance_scale,
                                 default_true_cfg=args.true_cfg_scale, default_frames=args.frames,
                                 default_fps=args.fps, model_name=self.model_name, kind=info["kind"], accepts=accepts,
                                 adapters=tuple((name, scale) for name, scale in info["adapters"]))
            # classic CFG (two branches when guidance > 1): a pipeline with a negative prompt and no true_cfg_scale
            self.scheduler.classic_cfg = "negative_prompt" in accepts and "true_cfg_scale" not in accepts
            self.replicas = info["replicas"]
        self.generation = max(self.generation, generation)
        again = " again, after a fault" if generation else ""
        which = f"replica {index} " if self.replicas > 1 else ""
        if generation or all(self.replica_states.get(r) in ("ready", "busy") for r in range(self.replicas)):
            say(f"paradiff serve: {which if generation else ''}ready{again}: {self.model_name} ({info['kind']}s) on "
                f"{len(ranks) * self.replicas} rank(s), {self.replicas} replica(s), at http://{args.host}:{args.port}")

    replicas = 1

    def drain(self) -> None:
        self.scheduler.drain()

    def fail(self, cause: str) -> None:
        """The server stops: waiting requests get 503, running ones on healthy replicas finish."""
        self.closing = True
        self.failed = cause
        self.scheduler.close(cause, keep_running=True)

    # -- rank 0's dispatcher ------------------------------------------------------------------------------------
    def to_cancel(self) -> list[int]:
        """The running requests already answered (504, or the client hung up) not yet cancelled: rank 0 cancels them."""
        ids = [job_id for job_id in self.scheduler.answered_running() if job_id not in self._cancelled]
        self._cancelled.update(ids)
        return ids

    def finish_batch(self, items: list[dict], channel, summaries: list[dict]) -> None:
        """A replica ran `items`: answer each (its result from the store, a refusal, a request's own fault)."""
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

    def replica_fault(self, index: int, replicas: int, cause: str, decision: str) -> None:
        which = f"replica {index}: " if replicas > 1 else ""
        say(f"paradiff serve: fault: {which}{cause}; " + (
            f"recovering: loading {'its' if replicas > 1 else 'the'} pipeline again" if decision == "recover"
            else "stopping"))
        # the state first: a client answered 500 next and asking /health at once must not still read "ready"
        self.replica_state(index, "loading" if decision == "recover" else "failed")
        if decision == "stop":
            self.failed = cause

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
                why = (failed or {}).get(item["id"], cause) or "cancelled"
                self.scheduler.complete(item["id"], 500, f"the request failed in the pipeline: {public_message(why)}")

    def _cost(self, job_id: int) -> float:
        return self.scheduler.cost_of(job_id)

    # -- the HTTP side ------------------------------------------------------------------------------------------
    def _on_finish(self, job: Job) -> None:
        latency = job.finished - job.accepted
        images = job.request.n if job.status == 200 else 0
        self.metrics.request_done(job.status, latency if job.status == 200 else None, images,
                                  job.request.steps * images)
        entry = {"id": job.id, "status": job.status, "kind": job.request.kind, "images": job.request.n,
                 "steps": job.request.steps, "seed": job.request.seed, "accepted": job.accepted_wall,
                 "latency_s": round(latency, 6)}
        if job.status == 200:
            entry.update(replica=job.result["replica"], started=job.result["started"],
                         finished=job.result["finished"])
        else:
            entry["error"] = str(job.result)
        with self._log_lock:
            self._log.write(json.dumps(entry) + "\n")
        say(f"paradiff serve: request {job.id}: {job.status} in {latency:.2f} s"
            + (f" (replica {entry['replica']})" if job.status == 200 else f": {entry['error']}"))

    async def generate(self, body: Any, kind: str, disconnected=None, headers: dict | None = None) -> tuple[int, dict]:
        """`disconnected()`: an awaitable check that the client hung up; then the request is answered 499 and, if it
        runs, cancelled at the next denoising step. `headers`: filled with the answer's extra headers (Retry-After)."""
        if self.health not in ("ready", "degraded") or self.limits is None:
            return self.refused(503, f"the server is {self.health}; retry when GET /health says ready",
                                f"POST {_endpoint(kind)}")
        try:
            request = parse_image_request(body, self.limits, kind)
            job = self.scheduler.submit(request)
        except RequestError as exc:
            if exc.retry_after is not None and headers is not None:
                headers["Retry-After"] = str(exc.retry_after)
            return self.refused(exc.status, str(exc), f"POST {_endpoint(kind)}")
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
        data = [{"b64_json": base64.b64encode(file["data"]).decode(), **({"mime_type": file["mime"]}
                                                                         if kind == "video" else {})}
                for file in job.result["files"]]
        return 200, {"created": int(job.accepted_wall), "data": data}

    def refused(self, status: int, message: str, what: str) -> tuple[int, dict]:
        """A request answered with an error before it reached the queue: counted in /metrics, one line of
        requests.jsonl (`what`: "METHOD PATH"), and the JSON error answer."""
        self.metrics.request_done(status)
        entry = {"id": None, "status": status, "request": what, "accepted": time.time(), "error": message}
        with self._log_lock:
            if not self._log.closed:
                self._log.write(json.dumps(entry) + "\n")
        return _error(status, message)

    def refusal(self, status: int, message: str, what: str, headers: dict | None = None) -> JSONResponse:
        status, body = self.refused(status, message, what)
        return JSONResponse(body, status_code=status, headers=headers)

    def models(self) -> dict:
        adapters = [{"name": name, "scale": scale} for name, scale in (self.limits.adapters if self.limits else ())]
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "paradiff", "adapters": adapters}]}

    def render_metrics(self) -> str:
        queued, running = self.scheduler.depth()
        running_on = self.scheduler.running_on()
        return self.metrics.render(queued, running, self.health, queued_cost=self.scheduler.queued_cost()[0],
                                   expected_wait=self.scheduler.expected_wait(), replicas=dict(self.replica_states),
                                   replica_running={r: running_on.get(r, 0) for r in self.replica_states})


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _error(status: int, message: str) -> tuple[int, dict]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}} (code: the HTTP status)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, {"error": {"message": message, "type": kind, "param": None, "code": status}}


def _endpoint(kind: str) -> str:
    return "/v1/images/generations" if kind == "image" else "/v1/videos"


MAX_HEADER_BYTES = 16 * 1024  # the request line and headers; above it uvicorn answers 400 and closes


def server_max_side(args: argparse.Namespace) -> int:
    """--max-side, or twice the server's default size (rounded down to a multiple of 16): a request may not ask for
    more than four times the pixels the server was started for."""
    return args.max_side if args.max_side is not None else max(16, 2 * max(args.width, args.height) // 16 * 16)


def server_max_steps(args: argparse.Namespace) -> int:
    """--max-steps, or twice the server's default steps."""
    return args.max_steps if args.max_steps is not None else 2 * args.steps


def server_max_frames(args: argparse.Namespace) -> int:
    """--max-frames, or twice --frames (257 where the pipeline's own default count is used)."""
    if args.max_frames is not None:
        return args.max_frames
    return 2 * args.frames if args.frames else 257


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
        try:
            frontend.guard.check_sender(headers)
            if frontend.api_key and path not in OPEN_PATHS and not preflight:
                given = headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {frontend.api_key}".encode()):
                    raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'")
            length = headers.get("content-length")
            max_body = frontend.args.max_body_bytes
            if length is not None and (not length.isdigit() or int(length) > max_body):
                raise RequestError(413, f"the request body ({length} bytes) is larger than --max-body-bytes "
                                        f"{max_body}")
            frontend.guard.check_body(method, path, headers)
        except RequestError as exc:
            return await frontend.refusal(exc.status, str(exc), f"{method} {path}")(scope, receive, send)
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
    max_body, read_timeout = frontend.args.max_body_bytes, frontend.args.read_timeout
    if frontend.args.allow_origin:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=frontend.args.allow_origin, allow_methods=["GET", "POST"],
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
        try:
            return json.loads(raw)
        except RecursionError:
            raise RequestError(400, "the body is not JSON this server reads: nested too deeply") from None
        except ValueError as exc:
            raise RequestError(400, f"the body is not JSON: {exc}") from None

    async def answer(request: Request, kind: str):
        try:
            body = await body_of(request)
        except RequestError as exc:
            return frontend.refusal(exc.status, str(exc), f"POST {_endpoint(kind)}")
        headers: dict = {}
        status, payload = await frontend.generate(body, kind, request.is_disconnected, headers)
        return JSONResponse(payload, status_code=status, headers=headers or None)

    @app.post("/v1/images/generations")
    async def images(request: Request):
        return await answer(request, "image")

    @app.post("/v1/videos")
    async def videos(request: Request):
        return await answer(request, "video")

    @app.get("/v1/models")
    async def models():
        return frontend.models()

    @app.get("/health")
    async def health():
        health = frontend.health
        return JSONResponse({"status": health}, status_code=200 if health in ("ready", "degraded") else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(frontend.render_metrics(), media_type="text/plain; version=0.0.4")

    return app
