"""`paradiff serve` on Ray Serve (paradiff.serve.ray): a local Ray cluster (one node, loopback), meshes of one rank of
the demo pipeline, bounded waits on states observed (Ray's replica states, the meshes' /metrics)."""

from __future__ import annotations

import importlib.util
import itertools
import os
import signal
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

if importlib.util.find_spec("ray") is None:  # found, not imported: collecting this file stays cheap
    pytest.skip("ray[serve] is not installed (pip install 'paradiff[ray]')", allow_module_level=True)


def replica_states() -> dict[str, int]:
    from ray import serve

    application = serve.status().applications.get("paradiff")
    if application is None or "paradiff-mesh" not in application.deployments:
        return {}
    return {str(state): count for state, count in application.deployments["paradiff-mesh"].replica_states.items()}


def wait_until(condition, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s: {replica_states()}"
        time.sleep(0.1)


def running(count: int) -> bool:
    states = replica_states()
    return states.get("RUNNING", 0) == count and sum(states.values()) == count


def meshes() -> dict[int, dict]:
    """The meshes on this machine: Mesh replica pid -> {"port": its frontend's loopback port, "ranks": [pids by
    rank]} (the ranks are started by their Mesh replica: its children, `paradiff serve` workers)."""
    found: dict[int, list[tuple[int, int, int]]] = {}  # Mesh replica pid -> [(rank, pid, port)]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            env = dict(item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0") if b"=" in item)
        except (OSError, ValueError, IndexError):
            continue
        if b"paradiff.cli" in words and b"--port" in words and any(b"paradiff-ray-" in w for w in words):
            found.setdefault(parent, []).append((int(env.get(b"RANK", b"0")), int(entry.name),
                                                 int(words[words.index(b"--port") + 1])))
    return {parent: {"port": ranks[0][2], "ranks": [pid for _, pid, _ in sorted(ranks)]}
            for parent, ranks in found.items()}


def start_ray(**options) -> None:
    """A new local Ray cluster (never one found running on this machine), started again when its node did not come
    up: on loaded cores Ray's raylet can fail to register within Ray's fixed 30 s, before anything of the test ran."""
    import ray

    for attempt in range(3):
        try:
            ray.init(address="local", **options)
            return
        except Exception as error:
            if "timed out during startup" not in str(error) or attempt == 2:
                raise
            ray.shutdown()


@pytest.fixture
def fast_autoscaling_metrics(monkeypatch):
    """Ray Serve's replicas and handles push their queue lengths every 0.5 s instead of 10 (read when Ray starts).
    Its HTTP proxy gets 60 s to report ready and to answer a health check instead of 5 and 10: in the load lane
    (the suite beside two busy loops) the first proxy was not ready within 5 s, Ray's controller killed it, and
    `serve.start` failed on the dead actor before anything of paradiff's ran."""
    for name in ("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S",
                 "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S"):
        monkeypatch.setenv(name, "0.5")
    for name in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        monkeypatch.setenv(name, "60")


@pytest.mark.slow
@pytest.mark.ray
def test_two_replicas_a_killed_rank_and_autoscaling(fast_autoscaling_metrics):
    """Autoscaled from 1 to 2 meshes under a burst; a rank of one mesh killed (SIGKILL) mid-request: that request
    fails (500), the other mesh answers every other request, Ray starts a new mesh; back to 1 once idle."""
    import httpx
    import ray
    from ray import serve

    from paradiff.distributed.spawn import free_port
    from paradiff.serve.ray import build_app

    port = free_port()
    start_ray(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(["--steps", "1", "--max-steps", "2000"], ranks=1, replicas=(1, 2), route="none",
                        target_ongoing_requests=1, upscale_delay_s=0.5, downscale_delay_s=3, look_back_period_s=2)
        serve.run(app, name="paradiff", route_prefix="/")
        wait_until(lambda: running(1), "one mesh running")
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
        answers: list[tuple[float, int]] = []  # (when answered, status) of every request
        stop = threading.Event()

        def ask(prompt: str, steps: int) -> int:
            status = client.post("/v1/images/generations", json={"prompt": prompt, "steps": steps}).status_code
            answers.append((time.monotonic(), status))
            return status

        def burst(number: int) -> None:  # route "none": Ray's power-of-two choice by queue length
            for index in itertools.count():
                if stop.is_set():
                    return
                ask(f"long {number} {index}", 100)

        with ThreadPoolExecutor(4) as pool:
            clients = [pool.submit(burst, number) for number in range(4)]  # 4 ongoing, 1 wanted per mesh
            try:
                wait_until(lambda: running(2) and len(meshes()) == 2, "scaled to two meshes under the burst")
                first = meshes()
                wait_until(lambda: all("paradiff_requests_running 1" in httpx.get(
                    f"http://127.0.0.1:{server['port']}/metrics").text for server in first.values()),
                    "a request running on each mesh")
                victim = max(first)  # the newer Mesh replica: the one Ray added
                os.kill(first[victim]["ranks"][0], signal.SIGKILL)
                killed = time.monotonic()
                wait_until(lambda: any(pid not in first for pid in meshes()), "Ray starting a new mesh")
            finally:
                stop.set()
            for future in clients:
                future.result(timeout=600)
        after = [status for when, status in answers if when > killed]
        failed = [status for _, status in answers if status != 200]
        # what ran on the killed mesh: one batch, of up to 3 of the 4 clients' requests (the other mesh ran one)
        assert failed and set(failed) == {500} and len(failed) <= 3, answers
        assert after.count(200) >= 1, answers  # the other mesh answered meanwhile
        wait_until(lambda: running(1), "back to one mesh once idle")
        assert ask("after", 1) == 200
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.ray
def test_haproxy_ingress_through_the_command(tmp_path):
    """`paradiff serve --ray --ray-ingress haproxy` as a user runs it (its own session, as a terminal's job): its
    port is HAProxy's (on loopback), which forwards to the mesh replica's own HTTP port (no Python proxy); an
    answer equals the mesh's own for the same request; Ctrl-C (SIGINT to the whole process group, as a terminal sends
    it) drains and ends it with status 0, and takes its HAProxy (which Ray's manager started) with it."""
    import base64
    import subprocess
    import sys

    import httpx
    import psutil

    from paradiff.distributed.spawn import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "paradiff.cli", "serve", "--ray", "--ray-ingress", "haproxy",
                               "--port", str(port), "--steps", "1", "--out", str(tmp_path / "out")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    said: list[str] = []  # its console, line by line, as it says them
    reader = threading.Thread(target=lambda: said.extend(server.stdout), daemon=True)
    reader.start()
    try:
        # until ready and then the line on HAProxy's stats ports (said once), or the server's end
        wait_until(lambda: any("listen on all interfaces" in line for line in said) or server.poll() is not None,
                   "the server ready")
        assert server.poll() is None, f"the server ended ({server.poll()}): {said}"
        listeners = [c for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port]
        assert [c.laddr.ip for c in listeners] == ["127.0.0.1"], listeners
        haproxy = psutil.Process(listeners[0].pid)
        assert haproxy.name() == "haproxy", haproxy.cmdline()
        assert any(f"paradiff serve --ray: ready at http://127.0.0.1:{port}" in line for line in said), said

        def image(url: str) -> bytes:
            answer = httpx.post(url + "/v1/images/generations", json={"prompt": "a cat", "seed": 7}, timeout=120)
            assert answer.status_code == 200, answer.text
            return base64.b64decode(answer.json()["data"][0]["b64_json"])

        (mesh,) = meshes().values()
        assert image(f"http://127.0.0.1:{port}") == image(f"http://127.0.0.1:{mesh['port']}")
        # the mesh's video jobs in the command's store, shared by every mesh (its frontend opened it)
        words = Path(f"/proc/{mesh['ranks'][0]}/cmdline").read_bytes().split(b"\0")
        store = tmp_path / "out" / "jobs.db"
        assert words[words.index(b"--jobs-db") + 1] == f"sqlite:///{store}".encode() and store.exists()
        with sqlite3.connect(store) as connection:  # one server has it open: the mesh
            assert connection.execute("SELECT COUNT(*) FROM job_owners").fetchone()[0] == 1
        before = len(said)
        os.killpg(server.pid, signal.SIGINT)
        assert server.wait(timeout=120) == 0, said
        reader.join(timeout=60)
        rest = "".join(said[before:])
        assert "Traceback" not in rest and "error" not in rest.lower(), rest
        assert not [line for line in said if "INFO" in line], said  # not Ray Serve's
        assert not haproxy.is_running() or haproxy.status() == psutil.STATUS_ZOMBIE
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_routing_keys():
    from paradiff.serve.ray import PROMPT_BUCKETS, routing_key

    body = b'{"prompt": "a cat", "loras": {"lora1": 0.5, "lora0": 1}}'
    assert routing_key(body, "none") == ""
    assert routing_key(body, "adapter") == 'adapters:{"lora0": 1, "lora1": 0.5}'
    assert routing_key(b'{"prompt": "a cat"}', "adapter") == "adapters:default"
    assert routing_key(body, "prompt-hash") == routing_key(b'{"prompt": "a cat"}', "prompt-hash")
    keys = {routing_key(f'{{"prompt": "p{i}"}}'.encode(), "prompt-hash") for i in range(200)}
    assert len(keys) == PROMPT_BUCKETS
    assert routing_key(b"not json", "prompt-hash") == routing_key(b"[1]", "adapter") == ""


def test_build_app_without_a_cluster():
    """The application build_app and app_from_env make, built but not run (no Ray cluster: `make test` runs it): the
    Mesh itself the ingress with route "none" (no Router hop), the Router in front of it with a routing key, both at
    normal priority, one bundle per rank, fixed or autoscaled replicas, and a bad route refused; what an ingress
    forwards of a request."""
    import asyncio

    from starlette.requests import Request

    from paradiff.serve.ray import Mesh, app_from_env, build_app, forwarded

    with pytest.raises(ValueError, match=r"--ray-route 'sticky': expected one of \['prompt-hash', 'adapter', 'none'\]"):
        build_app([], route="sticky")
    direct = build_app(["--steps", "2"])._bound_deployment
    assert (direct.name, direct.func_or_class, direct.init_args) == ("paradiff-mesh", Mesh, (["--steps", "2"], 1))

    async def receive():
        return {"type": "http.request", "body": b'{"prompt": "a"}', "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/app/v1/videos", "root_path": "/app", "query_string": b"limit=2",
             "headers": [(b"authorization", b"Bearer k"), (b"cookie", b"c"), (b"content-type", b"application/json")]}
    assert asyncio.run(forwarded(Request(scope, receive))) == (
        "POST", "/v1/videos?limit=2", {"authorization": "Bearer k", "content-type": "application/json"},
        b'{"prompt": "a"}')
    scope.update(path="/health", root_path="", query_string=b"")
    assert asyncio.run(forwarded(Request(scope, receive)))[:2] == ("POST", "/health")
    router = build_app(["--steps", "2"], ranks=2, replicas=(1, 3), route="adapter")._bound_deployment
    mesh_app, route = router.init_args
    mesh = mesh_app._bound_deployment
    assert (router.name, mesh.name, route, mesh.init_args) == ("paradiff-router", "paradiff-mesh", "adapter",
                                                               (["--steps", "2"], 2))
    assert mesh._replica_config.placement_group_bundles == [{"CPU": 1}, {"CPU": 1}]
    for deployment in (router, mesh):  # not Ray's nice 15, which the mesh's server and ranks would inherit
        assert deployment.ray_actor_options["runtime_env"]["env_vars"]["RAY_worker_niceness"] == "0"
    autoscaling = mesh._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.initial_replicas) == (1, 3, 1)
    fixed = app_from_env({"args": "--tp 2 --steps 4", "ranks": 2, "replicas": "2", "route": "prompt-hash",
                          "device": "GPU"})._bound_deployment
    mesh = fixed.init_args[0]._bound_deployment
    assert fixed.init_args[1] == "prompt-hash" and mesh.init_args == (["--tp", "2", "--steps", "4"], 2)
    assert mesh.num_replicas == 2 and mesh._deployment_config.autoscaling_config is None
    assert mesh._replica_config.placement_group_bundles == [{"GPU": 1}, {"GPU": 1}]


def test_a_mesh_runs_each_request_through_the_servers_own_application_in_its_process(tmp_path):
    """No cluster, no rank (`make test` runs it): the Mesh replica hands a request to the frontend's ASGI application
    in its own process (no HTTP hop), behind the same guard as a plain server's uvicorn (the key, foreign origins, the
    request checks, the request log), with the mesh's loopback Host; once its mesh has stopped, a request it would
    have queued is GONE (sent to another replica). The settings rank 0 hands it as JSON are the flags' settings."""
    import asyncio
    import json

    from paradiff.cli.args import build_parser
    from paradiff.cli.serve import settings_of
    from paradiff.serve.app import Frontend, HttpGuard
    from paradiff.serve.app import build_app as http_app
    from paradiff.serve.ray import GONE, Mesh
    from paradiff.serve.settings import ServeSettings

    settings = settings_of(build_parser().parse_args(["serve", "--out", str(tmp_path), "--tp", "2", "--api-key", "k",
                                                      "--port", "8123", "--allow-host", "a.example"]))
    assert ServeSettings.from_json(json.loads(json.dumps(settings.as_json()))) == settings
    mesh = object.__new__(Mesh)
    mesh.port, mesh.stopping, mesh.frontend = 8123, True, Frontend(settings)
    mesh.app = HttpGuard(http_app(mesh.frontend), mesh.frontend)
    mesh.frontend.replica_state(0, "ready")
    mesh.frontend.replica_ready(0, {"kind": "image", "accepts": ["prompt", "num_inference_steps"], "replicas": 1,
                                    "adapters": []}, [{"rank": 0, "memory": 1}], 0)
    key, generate = {"authorization": "Bearer k"}, "/v1/images/generations"

    async def ask() -> list:
        return [await mesh._answer("GET", "/health", {}, b""),
                await mesh._answer("POST", generate, {"content-type": "application/json"}, b'{"prompt": "x"}'),
                await mesh._answer("POST", generate, {**key, "content-type": "application/json"},
                                   b'{"prompt": "x", "n": 99}'),
                await mesh._answer("GET", "/v1/models", {**key, "origin": "http://evil.example"}, b""),
                await mesh._answer("GET", "/v1/models?x=1", key, b"")]

    health, keyless, bad, foreign, models = asyncio.run(ask())
    assert health == (200, {"content-type": "application/json"}, b'{"status":"ready"}')
    assert keyless[0] == 401 and "API key" in keyless[2].decode()
    assert bad[0] == 400 and json.loads(bad[2])["error"]["param"] == "n"
    assert foreign[0] == 403 and "evil.example" in foreign[2].decode()
    assert models[0] == 200 and json.loads(models[2])["data"][0]["id"] == "paradiff-demo"
    logged = [json.loads(line)["status"] for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert logged == [401, 400, 403]
    mesh.frontend.fail("rank(s) [0] stopped answering")
    assert asyncio.run(mesh._answer("POST", generate, key, b'{"prompt": "x"}'))[0] == GONE
    mesh.frontend.stop()
