"""`paradiff serve` scaled out on Ray Serve: each Ray Serve replica is one paradiff mesh (the N ranks a `paradiff serve`
runs, in a placement-group bundle of N CPUs, or GPUs, and its frontend in the replica's own process), and Ray does
the rest: the HTTP proxy (the same OpenAI API), routing, autoscaling on queue length, and starting a failed replica
again.

    paradiff serve --ray --ray-replicas 1:4 --ray-route prompt-hash --tp 2 ...   # a local Ray cluster, or
    RAY_ADDRESS=auto paradiff serve --ray ...                                      # the one `ray start` runs

    from paradiff.serve.ray import build_app          # the same, as an application for serve.run / a RayService
    serve.run(build_app(["--tp", "2", "--steps", "8"], ranks=2, replicas=(1, 4), route="adapter"))

`Mesh` starts its mesh's ranks (`paradiff serve` workers, FRONTEND_ELSEWHERE set) on a store it hosts, and runs in
its own process what a `paradiff serve` runs on its rank 0 beside its share of the pipeline: the frontend
(app.Frontend: scheduler, request log, metrics, jobs; the ASGI application behind HttpGuard) and the dispatcher. A
request Ray's proxy hands to it goes through that application in-process, as uvicorn calls it for a plain server (an
HTTP call to a server of its own cost ~13 ms a request: docs/serve.md). Its health check is the frontend's state, so
a mesh whose rank died (the dispatcher stops it) is replaced by Ray. With route "none" (Ray's power-of-two choice)
the Mesh is the ingress itself: Ray's proxy hands each request to a Mesh replica, with no hop of ours in between (a
Router replica in front costs a process hop and a Ray call per request: docs/serve.md). With a routing key,
`Router` (the ingress, one replica, no CPU of its own) reads each request's body and routes it by the key through
Ray Serve's model multiplexing (requests with the same key go to the replica that served it last, while it is not
overloaded): "prompt-hash" (a hash of the prompt, in PROMPT_BUCKETS buckets: repeated prompts land together, for
caches) or "adapter" (the request's `loras`: the replicas keep their adapters' state).

The documented rule for a request in flight on a replica that fails: it fails (the client gets the mesh's 500, or
Ray's when the replica's process is gone mid-request); it is not retried, since it may have run. A request that
reached no mesh (the replica's mesh has stopped and Ray has not replaced it yet) never ran: it is sent again, to a
replica Ray chooses (up to RETRIES times, a second apart, then 503), by the Router, or by the Mesh ingress that
found its own mesh stopped. So no request is answered twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from urllib.parse import quote
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from paradiff.serve.settings import RAY_INGRESSES

ROUTES = ("prompt-hash", "adapter", "none")
HAPROXY_DRAIN_S = 5  # --ray-ingress haproxy: how long a stopping ingress replica drains (haproxy_env)
# prompt-hash keys: a bounded number of buckets (Ray sends a key it has not seen to the replica with the fewest keys,
# so a key per prompt would pile new prompts on the newest replica)
PROMPT_BUCKETS = 16
GONE = 0  # Mesh.forward's status when its mesh had stopped (none of its ranks saw the request)
# a request that reached no server is sent again (Ray's router may choose the same replica until its health check,
# every 2 s, takes it out): up to RETRIES times, RETRY_PAUSE_S apart
RETRIES, RETRY_PAUSE_S = 10, 1.0
READY_TIMEOUT_S = 600.0
# how long a stopping Mesh waits for its ranks to end after its drain (Ray has drained its requests already), within
# Ray's graceful_shutdown_timeout_s (30 s) with the frontend's own stop; then they are killed
STOP_WAIT_S = 15.0
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


def _end_with_parent() -> None:
    """In each of the mesh's ranks before it runs: a process group of its own (killed as one), in the replica's session
    (a session of its own is a scheduling group of its own where the kernel groups by session: autogroup; measured, a
    rank alone in one waited 2.5x as long for the CPU on loaded cores); SIGKILL when this replica's process dies (Ray
    may kill it without running __del__; a rank whose frontend is elsewhere ignores SIGTERM, and nothing is left for
    it to answer)."""
    import ctypes

    os.setpgid(0, 0)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: __del__ stops it


class Mesh:
    """One paradiff mesh whose frontend runs in this Ray replica's process: the frontend a `paradiff serve` runs on its
    rank 0 (app.Frontend: scheduler, metrics, request log, jobs; its ASGI application behind HttpGuard; rank 0's
    dispatcher), here, and the mesh's `ranks` ranks (`paradiff serve ARGV` as workers, FRONTEND_ELSEWHERE set)
    started by it, on the store it hosts, and stopped with it. Ray's proxy hands a request to this process, which
    runs it through the same application in-process: no hop of ours. The frontend also listens on a free loopback
    port of the node (its /metrics, /health and the API, as a mesh's server did)."""

    def __init__(self, argv: list[str], ranks: int = 1) -> None:
        from paradiff.distributed.spawn import free_port, host_store, rank_env, rank_store
        from paradiff.distributed.store import get_json
        from paradiff.serve.app import Frontend, HttpGuard
        from paradiff.serve.app import build_app as http_app
        from paradiff.serve.dispatch import Dispatcher
        from paradiff.serve.ranks import FRONTEND_ELSEWHERE, SETTINGS_KEY
        from paradiff.serve.settings import ServeSettings

        self.port = free_port()
        self.out = tempfile.mkdtemp(prefix="paradiff-ray-")
        self.frontend: Any = None
        self.dispatcher: Any = None
        self.stopping = False
        self.others: Any = None  # a handle on this deployment, made when this mesh is first found stopped
        self.processes: list[subprocess.Popen] = []
        self.store = host_store(READY_TIMEOUT_S)  # 127.0.0.1, a port the OS picks; every rank is its client
        command = [sys.executable, "-m", "paradiff.cli", "serve", *argv, "--host", "127.0.0.1",
                   "--port", str(self.port), "--out", self.out]
        env = dict(os.environ, PARADIFF_WORKER="1", PARADIFF_CONSOLE_TTY="0", TORCHELASTIC_USE_AGENT_STORE="True",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **{FRONTEND_ELSEWHERE: "1"})
        self.processes = [subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=_end_with_parent,
                                           env=dict(env, **rank_env(rank, ranks, self.store.port)))
                          for rank in range(ranks)]
        try:
            self._wait(lambda: self.store.check([SETTINGS_KEY]), "its rank 0 had read its flags")
            settings = ServeSettings.from_json(get_json(self.store, SETTINGS_KEY, dict))
            self.frontend = Frontend(settings).start()
            replicas = settings.spec.parallel.data_degree
            self.dispatcher = Dispatcher(rank_store(self.store.port, settings.timeout), self.frontend, replicas,
                                         ranks // replicas, settings.timeout).start()
            self.app = HttpGuard(http_app(self.frontend), self.frontend)
            self._wait(lambda: self.frontend.health == "ready", "it was ready")
        except BaseException:
            self._stop()
            raise

    def _wait(self, condition, what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not condition():
            gone = [rank for rank, process in enumerate(self.processes) if process.poll() is not None]
            if gone or (self.frontend is not None and self.frontend.failed is not None):
                why = (f"rank {gone[0]} exited ({self.processes[gone[0]].returncode})" if gone
                       else self.frontend.failed)
                raise RuntimeError(f"paradiff mesh: {why} before {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"paradiff mesh: not {what} within {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.1)

    async def __call__(self, request: Request) -> Response:
        """The ingress (route "none"): the request through this mesh's application, here; to another replica when
        this mesh has stopped (the request ran on none of its ranks)."""
        method, path, headers, body = await forwarded(request)
        status, answer_headers, content = await self._answer(method, path, headers, body, request.receive)
        if status == GONE:
            return await answer_of(self._others(), method, path, headers, body)
        return Response(content, status_code=status, headers=answer_headers)

    def _others(self) -> Any:
        if self.others is None:  # a handle on this deployment: Ray chooses the replica (and soon not this one)
            context = serve.get_replica_context()
            self.others = serve.get_deployment_handle(context.deployment, context.app_name)
        return self.others

    @serve.multiplexed(max_num_models_per_replica=64)
    async def _affinity(self, key: str) -> str:
        return key  # nothing to load: the key only makes Ray send the same key to the same replica

    async def forward(self, method: str, path: str, headers: dict, body: bytes) -> tuple[int, dict, bytes]:
        """A request handed over by a Router (or by a replica whose mesh had stopped)."""
        key = serve.get_multiplexed_model_id()
        if key:
            await self._affinity(key)
        return await self._answer(method, path, headers, body)

    async def _answer(self, method: str, path: str, headers: dict, body: bytes,
                      disconnect=None) -> tuple[int, dict, bytes]:
        """The mesh's answer, or GONE when the mesh has stopped and the request ran on none of its ranks (it came
        after the stop, or waited in the queue: the frontend answers those 503 when it stops; a request that ran
        gets 500). `disconnect()`: the ingress request's ASGI receive, which says when its client hangs up."""
        if self.frontend.failed is not None:
            return GONE, {}, b""
        status, answer_headers, content = await self._run(method, path, headers, body, disconnect)
        if status == 503 and self.frontend.failed is not None:
            return GONE, {}, b""
        return status, answer_headers, content

    async def _run(self, method: str, path: str, headers: dict, body: bytes,
                   disconnect=None) -> tuple[int, dict, bytes]:
        """The mesh's ASGI application called here, as uvicorn calls it for a plain `paradiff serve` (Host: the
        mesh's own loopback address; the headers an ingress forwards); its status, kept headers and body."""
        path, _, query = path.partition("?")
        raw = [(b"host", f"127.0.0.1:{self.port}".encode()), (b"content-length", str(len(body)).encode())]
        raw += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": quote(path).encode(),
                 "query_string": query.encode(), "root_path": "", "headers": raw, "client": ("127.0.0.1", 0),
                 "server": ("127.0.0.1", self.port)}
        sent = []

        async def receive() -> dict:
            if not sent:
                sent.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            if disconnect is not None:
                try:
                    return await disconnect()  # http.disconnect once the client hangs up: the request is cancelled
                except Exception:  # noqa: BLE001 - Ray's channel to its proxy broke: no word of the client, as below
                    pass
            await asyncio.Event().wait()  # no client here (a Router's call): it waits for the answer
            return {"type": "http.disconnect"}

        answer: dict = {"status": 500, "headers": {}, "body": bytearray()}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
                answer["headers"] = {name.decode("latin-1"): value.decode("latin-1")
                                     for name, value in message.get("headers", ())
                                     if name.lower() in (b"content-type", b"retry-after")}
            elif message["type"] == "http.response.body":
                answer["body"] += message.get("body", b"")

        await self.app(scope, receive, send)
        return answer["status"], answer["headers"], bytes(answer["body"])

    async def check_health(self) -> None:
        """Ray's health check: the mesh has not stopped (a rank gone, a load that failed again, the dispatcher)."""
        if self.frontend.failed is not None:
            raise RuntimeError(f"paradiff mesh stopped: {self.frontend.failed}")

    def pid(self) -> int:
        """Rank 0's process id."""
        return self.processes[0].pid

    def _stop(self) -> None:
        """A drain (the ranks get "stop" and exit), bounded; then whatever still runs is killed."""
        if self.stopping:
            return
        self.stopping = True
        if self.frontend is not None and self.frontend.failed is None:
            self.frontend.drain()
        deadline = time.monotonic() + STOP_WAIT_S
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()) if self.dispatcher is not None else 0.1)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
        if self.dispatcher is not None:
            self.dispatcher.stop()
        if self.frontend is not None:
            self.frontend.stop()
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
    """What a mesh is given of an ingress request: its method, its path below the application's route prefix (with its
    query), the FORWARDED_HEADERS, its body."""
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
        return mesh.bind(list(argv), ranks)  # the ingress: no Router hop
    router = serve.deployment(Router, name="paradiff-router",
                              ray_actor_options={"num_cpus": 0, "runtime_env": NORMAL_PRIORITY},
                              max_ongoing_requests=1000)
    return router.bind(mesh.bind(list(argv), ranks), route)


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


def haproxy_env(folder: str) -> dict[str, str]:
    """The environment of a local Ray cluster whose ingress is HAProxy (`--ray-ingress haproxy`): Ray Serve's HAProxy
    mode (experimental in Ray 2.60; it turns direct ingress on: each ingress replica serves HTTP itself on a
    loopback port, and HAProxy, a C proxy, forwards to it: no Python proxy in the path); HAProxy's files (its
    configuration, sockets, server state) in `folder`, this server's own (not Ray's shared /tmp/haproxy-serve), which
    also names its processes; its stats page and Prometheus exporter on free ports (Ray's 8404 and 9101 would collide
    between two such servers on one machine); a stopping ingress replica drains for HAPROXY_DRAIN_S instead of Ray's
    30 s (HAProxy has taken it out of its backends by then; each downscale would otherwise take 30 s)."""
    from paradiff.distributed.spawn import free_port

    files = {"CONFIG_FILE_LOC": "haproxy.cfg", "SOCKET_PATH": "admin.sock", "SERVER_STATE_FILE": "server-state",
             "METRICS_SOCKET_PATH": "metrics.sock"}
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(HAPROXY_DRAIN_S),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": folder,
            **{f"RAY_SERVE_HAPROXY_{name}": os.path.join(folder, file) for name, file in files.items()}}


def end_processes_of(folder: str) -> None:
    """SIGKILL to every process whose command line names `folder` (the HAProxy a stopped cluster's manager had
    started: ray.shutdown kills the manager, not its child)."""
    mine = folder.encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    if mine in cmdline.read():
                        os.kill(int(entry), signal.SIGKILL)
            except OSError:  # gone meanwhile, or not ours to read
                pass


def check_ingress(ingress: str, address: str | None) -> None:
    """ValueError unless `ingress` is one of RAY_INGRESSES and can be set up: HAProxy only on the local cluster `run`
    starts (Ray reads its mode from the environment of the cluster's processes when they start)."""
    if ingress not in RAY_INGRESSES:
        raise ValueError(f"--ray-ingress {ingress!r}: expected one of {list(RAY_INGRESSES)}")
    address = address or os.environ.get("RAY_ADDRESS")
    if ingress == "haproxy" and address:
        raise ValueError(f"--ray-ingress haproxy with the Ray cluster at {address!r} (--ray-address / RAY_ADDRESS): "
                         "HAProxy is set up only on the local cluster `paradiff serve --ray` starts; on a cluster "
                         "you start, put RAY_SERVE_ENABLE_HA_PROXY=1 in `ray start`'s environment and leave "
                         "--ray-ingress out (docs/serve.md)")


def run(argv: list[str], ranks: int, replicas: tuple[int, int], route: str, host: str, port: int,
        address: str | None = None, ingress: str = "proxy") -> int:
    """`paradiff serve --ray`: a Ray cluster (`address`, RAY_ADDRESS, or a local one), Ray's HTTP proxy (or, with
    `ingress` "haproxy", HAProxy: a local cluster only) on host:port, the application until SIGTERM / Ctrl-C."""
    import ray

    from paradiff.runtime.console import say

    check_ingress(ingress, address)
    local = address is None and not os.environ.get("RAY_ADDRESS")  # a new cluster: its workers at normal priority
    # in /tmp, as Ray's own: HAProxy's sockets, FOLDER/NODE_ID/metrics.sock, must fit its 97 characters
    haproxy = tempfile.mkdtemp(prefix="paradiff-", dir="/tmp") if ingress == "haproxy" else None
    if haproxy:
        # read by Ray Serve's controller, HAProxy manager and replicas, which inherit the environment of the raylet
        # ray.init starts here: this process is the cluster's driver and nothing else
        os.environ.update(haproxy_env(haproxy))
    ready: list[bool] = []
    stopping: list[int] = []

    def on_signal(number: int, _frame: Any) -> None:
        """SIGTERM / Ctrl-C: once ready, the wait below ends (Ray Serve drains the meshes); before, the start is
        interrupted where it waits (Ray's own handler, which ray.init installs, would abort the process with C++
        frames and leave the cluster running)."""
        stopping.append(number)
        if not ready:
            raise KeyboardInterrupt

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, on_signal)
    try:
        ray.init(address="local" if local else address, include_dashboard=False, logging_level="WARNING",
                 log_to_driver=False, _system_config=LOCAL_CLUSTER if local else None)
        for number in (signal.SIGTERM, signal.SIGINT):  # ours again, over Ray's
            signal.signal(number, on_signal)
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # not its INFO lines: started, app ready, deleted
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(argv, ranks, replicas, route), name="paradiff", route_prefix="/")
        ready.append(True)
        say(f"paradiff serve --ray: ready at http://{host}:{port} ({replicas[0]}-{replicas[1]} replica(s) of "
            f"{ranks} rank(s), route {route}, ingress {ingress})")
        if ingress == "haproxy":
            say(f"paradiff serve --ray: HAProxy's stats page (port {os.environ['RAY_SERVE_HAPROXY_STATS_PORT']}) "
                f"and metrics (port {os.environ['RAY_SERVE_HAPROXY_METRICS_PORT']}) listen on all interfaces (Ray's "
                "HAProxy configuration); the API only on the address above")
        while not stopping:
            time.sleep(0.2)
    except KeyboardInterrupt:
        if not stopping:
            raise
        say("paradiff serve --ray: stopped before it was ready")
    finally:
        ready.append(True)  # a signal during the stop below waits for it
        if ray.is_initialized():
            # the application drained, then this driver gone (and the cluster with it when it started it); not
            # serve.shutdown, which would stop every application of a shared cluster (and wait 30 s for Ray's HAProxy
            # manager)
            try:
                serve.delete("paradiff")
            except Exception:  # noqa: BLE001 - Serve never started (interrupted): nothing of ours to delete
                pass
            ray.shutdown()
        if haproxy:
            end_processes_of(haproxy)
            shutil.rmtree(haproxy, ignore_errors=True)
    return 0
