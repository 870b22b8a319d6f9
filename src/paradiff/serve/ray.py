"""`paradiff serve` scaled out on Ray Serve: each Ray Serve replica is one paradiff mesh (a `paradiff serve` with its
local launcher and its N ranks, in a placement-group bundle of N CPUs, or GPUs), and Ray does the rest: the HTTP
proxy (the same OpenAI API), routing, autoscaling on queue length, and starting a failed replica again.

    paradiff serve --ray --ray-replicas 1:4 --ray-route prompt-hash --tp 2 ...   # a local Ray cluster, or
    RAY_ADDRESS=auto paradiff serve --ray ...                                      # the one `ray start` runs

    from paradiff.serve.ray import build_app          # the same, as an application for serve.run / a RayService
    serve.run(build_app(["--tp", "2", "--steps", "8"], ranks=2, replicas=(1, 4), route="adapter"))

`Mesh` holds one paradiff server on a free loopback port of its node and forwards requests to it unchanged; its
health check is the server's /health, so a mesh whose rank died (the server stops) is replaced by Ray. With route
"none" (Ray's power-of-two choice) the Mesh is the ingress itself: Ray's proxy hands each request to a Mesh replica,
with no hop of ours in between (a Router replica in front cost a process hop and a Ray call per request: docs/serve.md).
With a routing key, `Router` (the ingress, one replica, no CPU of its own) reads each request's body and routes it by
the key through Ray Serve's model multiplexing (requests with the same key go to the replica that served it last,
while it is not overloaded): "prompt-hash" (a hash of the prompt, in PROMPT_BUCKETS buckets: repeated prompts land
together, for caches) or "adapter" (the request's `loras`: the replicas keep their adapters' state).

The documented rule for a request in flight on a replica that fails: it fails (the client gets the server's 500, or
a 500 when the server's process is gone mid-request); it is not retried, since it may have run. A request that
reached no server (the replica's server is gone and Ray has not replaced it yet: the connection is refused) never
ran: it is sent again, to a replica Ray chooses (up to RETRIES times, a second apart, then 503), by the Router, or
by the Mesh ingress that found its own server gone. So no request is answered twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import Response

ROUTES = ("prompt-hash", "adapter", "none")
# prompt-hash keys: a bounded number of buckets (Ray sends a key it has not seen to the replica with the fewest keys,
# so a key per prompt would pile new prompts on the newest replica)
PROMPT_BUCKETS = 16
GONE = 0  # Mesh.forward's status when its server could not be reached (it never saw the request)
# a request that reached no server is sent again (Ray's router may choose the same replica until its health check,
# every 2 s, takes it out): up to RETRIES times, RETRY_PAUSE_S apart
RETRIES, RETRY_PAUSE_S = 10, 1.0
READY_TIMEOUT_S = 600.0
FORWARDED_HEADERS = ("authorization", "content-type", "origin")
# Ray starts its workers at nice 15 (its `worker_niceness`, so that its own GCS and raylet get the CPU first), and a
# mesh's server and ranks, started by its Mesh replica, inherit it: on a busy machine they and every hop of a request
# (proxy, Router, Mesh) then wait behind every normal-priority process. Our deployments' workers run at normal
# priority, as a `paradiff serve` does; so does every worker of the local cluster `paradiff serve --ray` starts.
NORMAL_PRIORITY = {"env_vars": {"RAY_worker_niceness": "0"}}
LOCAL_CLUSTER = {"worker_niceness": 0}  # the system config of a local cluster we start (Ray's proxy included)


def routing_key(body: bytes, route: str) -> str:
    """The multiplexing key of a request body ("" when the route is "none" or the body is not a JSON object)."""
    if route == "none":
        return ""
    try:
        fields = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(fields, dict):
        return ""
    if route == "adapter":
        loras = fields.get("loras")
        return "adapters:" + (json.dumps(loras, sort_keys=True) if isinstance(loras, dict) else "default")
    prompt = fields.get("prompt")
    digest = hashlib.sha1(str(prompt).encode(errors="replace")).digest()
    return f"prompt:{int.from_bytes(digest[:4], 'big') % PROMPT_BUCKETS}"


def _terminate_with_parent() -> None:
    """In the mesh's launcher before it runs: SIGTERM when this replica's process dies (Ray may kill it without
    running __del__); the launcher then stops its ranks as on any SIGTERM."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: __del__ stops it


class Mesh:
    """One paradiff mesh: `paradiff serve ARGV` on a free loopback port, started by this Ray replica and stopped
    with it."""

    def __init__(self, argv: list[str]) -> None:
        import httpx

        from paradiff.distributed.spawn import free_port

        self.port = free_port()
        self.out = tempfile.mkdtemp(prefix="paradiff-ray-")
        command = [sys.executable, "-m", "paradiff.cli", "serve", *argv, "--host", "127.0.0.1",
                   "--port", str(self.port), "--out", self.out]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=_terminate_with_parent)
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=None)
        self.others: Any = None  # a handle on this deployment, made when this mesh's server is first found gone
        deadline = time.monotonic() + READY_TIMEOUT_S
        with httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=5) as probe:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"paradiff serve exited ({self.process.returncode}) before it was ready")
                try:
                    if probe.get("/health").json().get("status") == "ready":
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    self._stop()
                    raise RuntimeError(f"paradiff serve was not ready within {READY_TIMEOUT_S:.0f} s")
                time.sleep(0.1)

    async def __call__(self, request: Request) -> Response:
        """The ingress (route "none"): the request to this mesh's server; to another replica when the server is
        gone (the request never reached it)."""
        method, path, headers, body = await forwarded(request)
        status, answer_headers, content = await self.forward(method, path, headers, body)
        if status == GONE:
            if self.others is None:  # a handle on this deployment: Ray chooses the replica (and soon not this one)
                context = serve.get_replica_context()
                self.others = serve.get_deployment_handle(context.deployment, context.app_name)
            return await answer_of(self.others, method, path, headers, body)
        return Response(content, status_code=status, headers=answer_headers)

    @serve.multiplexed(max_num_models_per_replica=64)
    async def _affinity(self, key: str) -> str:
        return key  # nothing to load: the key only makes Ray send the same key to the same replica

    async def forward(self, method: str, path: str, headers: dict, body: bytes) -> tuple[int, dict, bytes]:
        key = serve.get_multiplexed_model_id()
        if key:
            await self._affinity(key)
        import httpx

        try:
            answer = await self.client.request(method, path, headers=headers, content=body)
        except httpx.ConnectError:
            return GONE, {}, b""  # the request never reached the server: the Router sends it elsewhere
        keep = {name: value for name, value in answer.headers.items()
                if name.lower() in ("content-type", "retry-after")}
        return answer.status_code, keep, answer.content

    async def check_health(self) -> None:
        """Ray's health check: the server's process runs and /health does not say failed."""
        if self.process.poll() is not None:
            raise RuntimeError(f"paradiff serve exited ({self.process.returncode})")
        answer = await self.client.get("/health", timeout=10)
        if answer.json().get("status") == "failed":
            raise RuntimeError("paradiff serve says failed")

    def pid(self) -> int:
        """The launcher's process id (tests kill its ranks)."""
        return self.process.pid

    def _stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        shutil.rmtree(self.out, ignore_errors=True)  # its requests.jsonl: the mesh's own log, gone with it

    def __del__(self) -> None:
        self._stop()


class Router:
    """The ingress: every path of the OpenAI API, forwarded to a Mesh replica chosen by the routing key."""

    def __init__(self, mesh: Any, route: str) -> None:
        self.mesh, self.route = mesh, route

    async def __call__(self, request: Request) -> Response:
        method, path, headers, body = await forwarded(request)
        key = routing_key(body, self.route) if method == "POST" else ""
        return await answer_of(self.mesh.options(multiplexed_model_id=key) if key else self.mesh, method, path,
                               headers, body)


async def forwarded(request: Request) -> tuple[str, str, dict, bytes]:
    """What a mesh's server is sent of an ingress request: its method, its path below the application's route prefix
    (with its query), the FORWARDED_HEADERS, its body."""
    path, prefix = request.scope["path"], request.scope.get("root_path", "").rstrip("/")
    if prefix and path.startswith(prefix):  # Ray Serve's scope: the path with the route prefix, root_path the prefix
        path = path[len(prefix):] or "/"
    if request.url.query:
        path += "?" + request.url.query
    headers = {name: value for name, value in request.headers.items() if name.lower() in FORWARDED_HEADERS}
    return request.method, path, headers, await request.body()


async def answer_of(handle: Any, method: str, path: str, headers: dict, body: bytes) -> Response:
    """The answer of a Mesh replica `handle` chooses; sent again while the chosen replica's server was gone."""
    for _ in range(RETRIES + 1):
        status, answer_headers, content = await handle.forward.remote(method, path, headers, body)
        if status != GONE:
            return Response(content, status_code=status, headers=answer_headers)
        await asyncio.sleep(RETRY_PAUSE_S)
    return Response(json.dumps({"error": {"message": "no paradiff mesh could be reached; retry later",
                                          "type": "server_error", "param": None, "code": 503}}),
                    status_code=503, headers={"content-type": "application/json", "retry-after": "5"})


def build_app(argv: list[str], ranks: int = 1, replicas: tuple[int, int] = (1, 1), route: str = "none",
              target_ongoing_requests: float = 2.0, upscale_delay_s: float = 30.0, downscale_delay_s: float = 600.0,
              look_back_period_s: float = 30.0, device: str = "CPU") -> Any:
    """The Ray Serve application: `replicas` = (min, max) meshes of `ranks` ranks each (one bundle of one `device`
    per rank, packed on one node), autoscaled on ongoing requests per replica, routed by `route` (the Mesh is the
    ingress with route "none", a Router in front of it otherwise)."""
    if route not in ROUTES:
        raise ValueError(f"--ray-route {route!r}: expected one of {list(ROUTES)}")
    low, high = replicas
    scaling = ({"num_replicas": low} if low == high else
               {"autoscaling_config": {"min_replicas": low, "max_replicas": high, "initial_replicas": low,
                                       "target_ongoing_requests": target_ongoing_requests,
                                       "upscale_delay_s": upscale_delay_s, "downscale_delay_s": downscale_delay_s,
                                       "look_back_period_s": look_back_period_s}})
    mesh = serve.deployment(Mesh, name="paradiff-mesh", max_ongoing_requests=64, health_check_period_s=2,
                            health_check_timeout_s=30, graceful_shutdown_timeout_s=30,
                            ray_actor_options={"num_cpus": 0, "runtime_env": NORMAL_PRIORITY},
                            placement_group_bundles=[{device: 1}] * ranks,
                            placement_group_strategy="STRICT_PACK", **scaling)
    if route == "none":
        return mesh.bind(list(argv))  # the ingress: no Router hop
    router = serve.deployment(Router, name="paradiff-router",
                              ray_actor_options={"num_cpus": 0, "runtime_env": NORMAL_PRIORITY},
                              max_ongoing_requests=1000)
    return router.bind(mesh.bind(list(argv)), route)


def app_from_env(args: dict | None = None) -> Any:
    """build_app for a Ray Serve config file or a KubeRay RayService (`import_path: paradiff.serve.ray:app_from_env`,
    an application builder): from the config's `args` (keys `args`, `ranks`, `replicas`, `route`, `device`), else
    from PARADIFF_RAY_ARGS (the mesh's `paradiff serve` flags, split like a shell), PARADIFF_RAY_RANKS,
    PARADIFF_RAY_REPLICAS (N or MIN:MAX), PARADIFF_RAY_ROUTE, PARADIFF_RAY_DEVICE (CPU or GPU)."""
    import shlex

    def get(name: str, default: str) -> str:
        return str((args or {}).get(name, os.environ.get(f"PARADIFF_RAY_{name.upper()}", default)))

    replicas = get("replicas", "1").split(":")
    return build_app(shlex.split(get("args", "")), int(get("ranks", "1")), (int(replicas[0]), int(replicas[-1])),
                     get("route", "none"), device=get("device", "CPU"))


def run(argv: list[str], ranks: int, replicas: tuple[int, int], route: str, host: str, port: int,
        address: str | None = None) -> int:
    """`paradiff serve --ray`: a Ray cluster (`address`, RAY_ADDRESS, or a local one), Ray's HTTP proxy on
    host:port, the application until SIGTERM / Ctrl-C."""
    import ray

    from paradiff.runtime.console import say

    local = address is None and not os.environ.get("RAY_ADDRESS")  # a new cluster: its workers at normal priority
    ray.init(address="local" if local else address, include_dashboard=False, logging_level="WARNING",
             log_to_driver=False, _system_config=LOCAL_CLUSTER if local else None)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(argv, ranks, replicas, route), name="paradiff", route_prefix="/")
    say(f"paradiff serve --ray: ready at http://{host}:{port} ({replicas[0]}-{replicas[1]} replica(s) of {ranks} "
        f"rank(s), route {route})")
    stopping = []
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stopping.append(True))
    while not stopping:
        time.sleep(0.2)
    serve.shutdown()
    ray.shutdown()
    return 0
