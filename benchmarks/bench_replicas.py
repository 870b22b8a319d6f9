"""Independent data-parallel replicas and the cost-aware queue of `paradiff serve`, on the embedded demo pipeline
(or `--model flux2`, the FLUX.2-shaped folder of bench_pipelines), each a real server on 127.0.0.1:

- dp2 against one replica, requests per minute, without a batch window (4 concurrent clients; goal >= 1.9x);
- p95 wait (accepted -> started, from requests.jsonl) of short requests (1 step) while long ones (8x the steps, 4x
  the pixels) keep the replica busy, under --schedule fifo and --schedule fair (one replica);
- with --ray (or alone: --only ray-overhead, ~6 min): Ray Serve's overhead per request (a local Ray cluster, one
  mesh of one rank): sequential requests, interleaved, through Ray's HTTP proxy (route "none": the Mesh replica is
  the ingress), through it with a routing key (route prompt-hash: the Router replica in front of a second mesh),
  straight to the mesh's own port, and to a plain `paradiff serve`; each split by its server's requests.jsonl into
  the time in the server and the time outside it. The goal (<= 5%) is on the time Ray's path adds outside the
  server, over the plain server's latency: the server's own time swings by several x between two consecutive
  requests on loaded cores, which a ratio of a few whole latencies measures instead of Ray. Ray's own part of it:
  a bare echo deployment (answering as many bytes as the demo's answer) through the same proxy, against the same
  echo on uvicorn, in the same rounds.

Rounds are interleaved; medians over rounds. The result goes to benchmarks/results/bench_replicas.json.

    .venv/bin/python benchmarks/bench_replicas.py --rounds 1 --requests 6      # ~5 min on 2 loaded cores
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))  # paradiff_testkit (docs/testing.md)

from paradiff_testkit.serve import ServerProcess, images_of  # noqa: E402
from results import figure, load, this_command, write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULT = REPO / "benchmarks" / "results" / "bench_replicas.json"
TITLE = "independent dp replicas (requests/min vs one replica) and the fair queue (p95 short wait)"
PROMPTS = ["a red circle on a blue background, top left", "a yellow square on a green background, bottom right"]


def start(folder: Path, model: list[str], *flags: str, fresh: bool = False) -> ServerProcess:
    folder.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(folder, *model, *flags, fresh=fresh)
    server.wait_ready(timeout_s=600)
    return server


def throughput(server: ServerProcess, clients: int, requests: int) -> float:
    """Requests per minute of `clients` clients, each sending `requests` one after the other."""
    def client(number: int) -> None:
        import httpx

        with httpx.Client(base_url=server.url, timeout=900) as http:
            for index in range(requests):
                images_of(http.post("/v1/images/generations",
                                    json={"prompt": PROMPTS[index % 2], "seed": number * 100 + index}))

    threads = [threading.Thread(target=client, args=(number,)) for number in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 60 * clients * requests / (time.monotonic() - started)


def server_cpu_seconds(server: ServerProcess) -> float:
    """CPU seconds (user + system) the server's processes have used so far: its frontend and every rank."""
    import psutil

    root = psutil.Process(server.process.pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def short_waits(server: ServerProcess, steps: int, shorts: int) -> list[float]:
    """Two clients send long requests back to back while a third sends `shorts` short ones, one every 0.2 s after
    the previous answer; the short ones' waits in the queue."""
    done = threading.Event()

    def long_client() -> None:
        import httpx

        with httpx.Client(base_url=server.url, timeout=900) as http:
            while not done.is_set():
                images_of(http.post("/v1/images/generations",
                                    json={"prompt": PROMPTS[0], "steps": 8 * steps, "size": "128x128"}))

    threads = [threading.Thread(target=long_client) for _ in range(2)]
    for thread in threads:
        thread.start()
    before = len(server.log())
    time.sleep(0.5)
    for index in range(shorts):
        images_of(server.generate(prompt=PROMPTS[1], steps=steps, seed=index))
        time.sleep(0.2)
    done.set()
    for thread in threads:
        thread.join()
    entries = [entry for entry in server.log()[before:] if entry["steps"] == steps and entry["status"] == 200]
    return [entry["started"] - entry["accepted"] for entry in entries]


def parent_of(pid: int) -> int:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def mesh_servers() -> set[tuple[int, Path]]:
    """The frontend's loopback port and the --out folder of each mesh in the local Ray cluster this process started,
    from its ranks' command lines (their raylet a child of this process: another Ray cluster on the machine has
    meshes too)."""
    import os

    found = set()
    for entry in Path("/proc").iterdir():
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ancestors, pid = [], int(entry.name) if entry.name.isdigit() else 0
        for _ in range(5):  # rank <- Mesh replica's worker (its frontend) <- raylet <- this process
            pid = parent_of(pid)
            ancestors.append(pid)
        if os.getpid() not in ancestors:
            continue
        if b"paradiff.cli" in words and b"--port" in words and any(b"paradiff-ray-" in word for word in words):
            found.add((int(words[words.index(b"--port") + 1]), Path(words[words.index(b"--out") + 1].decode())))
    return found


ECHO_APP = """import os

PAYLOAD = b"x" * int(os.environ["ECHO_BYTES"])


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": PAYLOAD})
"""


class Echo:
    """A bare Ray Serve deployment: reads the body, answers `size` bytes (Ray's own cost per request)."""

    def __init__(self, size: int) -> None:
        self.payload = b"x" * size

    async def __call__(self, request):
        from starlette.responses import Response

        await request.body()
        return Response(self.payload, media_type="application/json")


def echo_server(folder: Path, size: int) -> tuple[str, object]:
    """ECHO_APP on uvicorn in a process of its own (as Ray's echo replica is), on 127.0.0.1: its URL and process."""
    import os
    import subprocess

    import httpx

    from paradiff.distributed.spawn import free_port

    (folder / "echo_app.py").write_text(ECHO_APP)
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "uvicorn", "echo_app:app", "--app-dir", str(folder), "--host",
                                "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                               env=dict(os.environ, ECHO_BYTES=str(size)), stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        try:
            httpx.post(f"http://127.0.0.1:{port}/", content=b"{}")
            return f"http://127.0.0.1:{port}/", process
        except httpx.HTTPError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("the uvicorn echo server did not answer within 120 s") from None
            time.sleep(0.1)


def ray_overhead(requests: int, model: list[str], steps: int, folder: Path, ingress: str = "proxy") -> dict[str, float]:
    """Sequential requests, in turn through Ray's HTTP proxy (a local Ray cluster as `paradiff serve --ray` starts it,
    one mesh of one rank; route "none", the Mesh replica the ingress, and route prompt-hash, a Router replica in
    front of a second mesh), straight to the first mesh's own server port, to a plain `paradiff serve` (one replica,
    as a user starts it without Ray), and to a bare echo, through Ray's proxy and on uvicorn. Each paradiff way is
    split by its server's requests.jsonl into its time in the server (accepted -> finished) and the time outside it
    (the path: Ray's proxy and our replicas, or only the loopback socket). Medians per way, in seconds. `ingress`
    "haproxy": the cluster as `paradiff serve --ray --ray-ingress haproxy` starts it (HAProxy in front of the ingress
    replicas' own ports, in place of Ray's proxy), the same ways through it."""
    import httpx
    import ray
    from ray import serve

    from paradiff.distributed.spawn import free_port
    from paradiff.serve.ray import LOCAL_CLUSTER, NORMAL_PRIORITY, build_app, end_processes_of, haproxy_env

    port = free_port()
    environ = dict(os.environ)
    haproxy = tempfile.mkdtemp(prefix="paradiff-", dir="/tmp") if ingress == "haproxy" else None
    if haproxy:
        os.environ.update(haproxy_env(haproxy))  # read by the cluster's processes, which ray.init starts below
    # a new interpreter, as a user (and a Mesh replica) starts it: not forked from the tests' preloaded fork server
    plain = start(folder / "plain", model, "--steps", str(steps), fresh=True)
    size = len(plain.client.post("/v1/images/generations", json={"prompt": PROMPTS[0]}).content)
    echo_url, echo = echo_server(folder, size)
    for attempt in range(3):  # on loaded cores Ray's raylet can miss Ray's fixed 30 s to register (test_serve_ray)
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
                     log_to_driver=False, _system_config=LOCAL_CLUSTER)
            break
        except Exception as error:
            ray.shutdown()
            if "timed out during startup" not in str(error) or attempt == 2:
                echo.kill()
                plain.stop()
                raise
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app([*model, "--steps", str(steps)], ranks=1), name="paradiff", route_prefix="/")
        (mesh_port, mesh_out), = mesh_servers()
        serve.run(build_app([*model, "--steps", str(steps)], ranks=1, route="prompt-hash"), name="keyed",
                  route_prefix="/keyed")
        (_, keyed_out), = mesh_servers() - {(mesh_port, mesh_out)}
        serve.run(serve.deployment(Echo, name="echo", ray_actor_options={"num_cpus": 0,
                                                                         "runtime_env": NORMAL_PRIORITY}).bind(size),
                  name="echo", route_prefix="/echo")
        ways = {"ray": (f"http://127.0.0.1:{port}", mesh_out), "keyed": (f"http://127.0.0.1:{port}/keyed", keyed_out),
                "mesh": (f"http://127.0.0.1:{mesh_port}", mesh_out), "serve": (plain.url, plain.out),
                "echo_ray": (f"http://127.0.0.1:{port}/echo/", None), "echo_uvicorn": (echo_url, None)}
        sent: dict[tuple[str, int], float] = {}  # (way, seed) -> client latency
        with httpx.Client(timeout=600) as http:
            for index in range(requests + 1):
                for number, (way, (url, out)) in enumerate(ways.items()):
                    seed = len(ways) * index + number
                    started = time.monotonic()
                    if out is None:
                        answer = http.post(url, json={"prompt": PROMPTS[0], "seed": seed})
                        assert answer.status_code == 200 and len(answer.content) == size, answer
                    else:
                        images_of(http.post(url + "/v1/images/generations", json={"prompt": PROMPTS[0],
                                                                                  "seed": seed}))
                    if index:  # the first of each: warm-up
                        sent[way, seed] = time.monotonic() - started
        outs = {out for _, out in ways.values() if out is not None}
        entries: dict[Path, dict[int, dict]] = {}
        deadline = time.monotonic() + 60
        while True:  # requests.jsonl gets an entry per answered request: wait for the last ones
            entries = {out: {entry["seed"]: entry for entry in map(json.loads, (out / "requests.jsonl").read_text()
                                                                   .splitlines())} for out in outs}
            if all(ways[way][1] is None or seed in entries[ways[way][1]] for way, seed in sent) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        split: dict[str, tuple[list, list, list]] = {way: ([], [], []) for way in ways}  # latency, in, outside
        for (way, seed), latency in sent.items():
            out = ways[way][1]
            inside = 0.0 if out is None else entries[out][seed]["finished"] - entries[out][seed]["accepted"]
            for sink, value in zip(split[way], (latency, inside, latency - inside)):
                sink.append(value)
        return {"answer_bytes": size, **{f"{way}_{part}": statistics.median(values) for way, parts in split.items()
                                         for part, values in zip(("latency", "server", "outside"), parts)}}
    finally:
        for app in ("paradiff", "keyed", "echo"):  # as `paradiff serve --ray` stops (serve.shutdown waits 30 s more
            try:  # for Ray's HAProxy manager)
                serve.delete(app)
            except Exception:  # noqa: BLE001 - Serve did not start: the cluster's end below is the cleanup
                pass
        ray.shutdown()
        if haproxy:
            end_processes_of(haproxy)
            shutil.rmtree(haproxy, ignore_errors=True)
        os.environ.clear()
        os.environ.update(environ)
        echo.kill()
        echo.wait()
        plain.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8, help="requests per client in the throughput load")
    parser.add_argument("--shorts", type=int, default=8, help="short requests in the fifo / fair load")
    parser.add_argument("--model", choices=("demo", "flux2"), default="demo")
    parser.add_argument("--note", default="measured under load (7 agents on 2 cores)")
    parser.add_argument("--ray", action="store_true", help="also Ray Serve's overhead per request")
    parser.add_argument("--only", choices=("ray-overhead", "dp2"),
                        help="only this figure, for --model (the others kept from the result file); ray-overhead: one "
                             "run ~4 min")
    parser.add_argument("--only-ray", action="store_true", help="the same as --only ray-overhead")
    parser.add_argument("--ray-ingress", choices=("proxy", "haproxy", "both"), default="both",
                        help="the Ray figures through Ray's proxy, through HAProxy (--ray-ingress haproxy), or both")
    args = parser.parse_args()
    model: list[str] = []
    if args.model == "flux2":
        from bench_pipelines import LARGE_FLUX2, build_folder

        model = [str(build_folder("flux2", LARGE_FLUX2, Path(tempfile.mkdtemp()))), "--height", "128", "--width", "128",
                 "--steps", "3"]
    steps = 3 if args.model == "flux2" else 2
    if args.only_ray or args.only == "ray-overhead":
        earlier = load(RESULT)  # this model's Ray figures are replaced, the others kept
        kept = [item for item in earlier["figures"]
                if "Ray Serve" not in item["name"] or model_of(item["name"]) != args.model]
        write_result("bench_replicas", TITLE, kept + ray_figures(args, model, steps),
                     command=f"{earlier['command']}; {this_command()}")
        return 0
    rpm = {"single": [], "dp2": []}
    cpu = {"single": [], "dp2": []}  # the server's CPU seconds per request over the timed requests
    waits = {"fifo": [], "fair": []}
    with tempfile.TemporaryDirectory() as tmp:
        for number in range(args.rounds):
            for name, flags in (("single", []), ("dp2", ["--dp", "2"])):
                server = start(Path(tmp) / f"{name}{number}", model, *flags)
                try:
                    throughput(server, 4, 1)  # warm-up
                    before = server_cpu_seconds(server)
                    rpm[name].append(throughput(server, 4, args.requests))
                    cpu[name].append((server_cpu_seconds(server) - before) / (4 * args.requests))
                finally:
                    server.stop()
            if args.only == "dp2":
                print(f"round {number + 1}: rpm {rpm}, CPU s a request {cpu}", flush=True)
                continue
            for policy in ("fifo", "fair"):
                server = start(Path(tmp) / f"{policy}{number}", model, "--schedule", policy, "--max-steps",
                               str(8 * steps), "--max-side", "128", "--steps", str(steps))
                try:
                    throughput(server, 1, 2)  # warm-up: the fair queue learns its rate from answers
                    waits[policy] += short_waits(server, steps, args.shorts)
                finally:
                    server.stop()
            print(f"round {number + 1}: rpm {rpm}, short waits p95 "
                  f"{ {k: round(float(np.percentile(v, 95)), 2) for k, v in waits.items()} }", flush=True)
    ratio = statistics.median(rpm["dp2"]) / statistics.median(rpm["single"])
    # the server's frontend and threads beside a single replica's rank take part of the other core
    busy = {name: statistics.median(rpm[name]) * statistics.median(cpu[name]) / 60 for name in rpm}
    dp2 = figure(f"dp2 / one replica, requests per minute ({args.model}, no batch window)", round(ratio, 3), "x",
                 ">= 1.9", note=f"median of {args.rounds} round(s), 4 clients x {args.requests} requests; requests "
                               f"per minute single {statistics.median(rpm['single']):.2f}, dp2 "
                               f"{statistics.median(rpm['dp2']):.2f}; the server's CPU seconds per request single "
                               f"{statistics.median(cpu['single']):.2f}, dp2 {statistics.median(cpu['dp2']):.2f}, "
                               f"so cores busy single {busy['single']:.2f}, dp2 {busy['dp2']:.2f} of "
                               f"{os.cpu_count()} (requests per minute grow at most as the busy cores do: "
                               f"x{busy['dp2'] / busy['single']:.2f}); {args.note}")
    if args.only == "dp2":  # this model's dp2 figure is replaced, the others kept
        earlier = load(RESULT)
        kept = [item for item in earlier["figures"] if item["name"] != dp2["name"]]
        write_result("bench_replicas", TITLE, [dp2] + kept, command=f"{earlier['command']}; {this_command()}")
        return 0
    p95 = {policy: float(np.percentile(values, 95)) for policy, values in waits.items()}
    write_result("bench_replicas", TITLE, [
        dp2,
        figure("p95 wait of short requests under long ones, fifo", round(p95["fifo"], 3), "s",
               note=f"one replica, {len(waits['fifo'])} short requests; {args.note}"),
        figure("p95 wait of short requests under long ones, fair", round(p95["fair"], 3), "s", "< fifo",
               met=p95["fair"] < p95["fifo"], note=f"one replica, {len(waits['fair'])} short requests; {args.note}"),
    ] + (ray_figures(args, model, steps) if args.ray else []))
    return 0


def model_tag(model: str) -> str:
    """What the Ray figures' names end with for `model` (nothing for the demo, whose figures came first)."""
    return "" if model == "demo" else f" [{model}]"


def model_of(name: str) -> str:
    """The model a Ray figure was measured on, from its name (model_tag)."""
    return name[name.rindex("[") + 1:-1] if name.endswith("]") else "demo"


def ray_figures(args, model: list[str], steps: int) -> list[dict]:
    """Ray's figures with its proxy (the default ingress), and with `--ray-ingress haproxy` (one figure)."""
    figures = []
    for ingress in (("proxy", "haproxy") if args.ray_ingress == "both" else (args.ray_ingress,)):
        with tempfile.TemporaryDirectory() as tmp:
            m = ray_overhead(args.requests, model, steps, Path(tmp), ingress)
        figures += proxy_figures(args, m, steps) if ingress == "proxy" else haproxy_figures(args, m, steps)
    for item in figures:
        item["name"] += model_tag(args.model)
    return figures


def haproxy_figures(args, m: dict[str, float], steps: int) -> list[dict]:
    added = m["ray_outside"] - m["serve_outside"]
    return [figure("Ray Serve overhead per request, --ray-ingress haproxy", round(100 * added / m["serve_latency"], 2),
                   "%", "<= 5",
                   note=f"{1000 * m['ray_outside']:.0f} ms outside the server through HAProxy (Ray's HAProxy mode: "
                        f"the Mesh replica serves HTTP itself, HAProxy forwards to its port) against "
                        f"{1000 * m['serve_outside']:.0f} ms to a plain `paradiff serve` of latency "
                        f"{m['serve_latency']:.3f} s; with a routing key (Router replica in front) "
                        f"{1000 * m['keyed_outside']:.0f} ms; an echo through HAProxy "
                        f"{1000 * m['echo_ray_latency']:.1f} ms, on uvicorn {1000 * m['echo_uvicorn_latency']:.1f} ms; "
                        f"latency through HAProxy / a plain serve's {m['ray_latency'] / m['serve_latency']:.3f}x; "
                        f"medians of {args.requests} sequential requests each way, interleaved ({args.model}, {steps} "
                        f"steps, one replica of one rank); {args.note}")]


def proxy_figures(args, m: dict[str, float], steps: int) -> list[dict]:
    added = m["ray_outside"] - m["serve_outside"]
    rays = m["echo_ray_latency"] - m["echo_uvicorn_latency"]  # Ray's own: its proxy and one replica call
    what = (f"medians of {args.requests} sequential requests each way, interleaved ({args.model}, {steps} steps, one "
            f"replica of one rank)")
    overhead = 100 * added / m["serve_latency"]
    needed = added / 0.05  # the request at which the same added time is 5%: its latency, and the steps it takes
    per_step = m["serve_server"] / steps  # an upper bound of a step's time: the call's fixed part counted in
    at = ("" if overhead <= 5 else f"; 5% of a {needed:.2f} s request: about "
          f"{max(steps, round((needed - m['serve_outside']) / per_step))} steps of the {args.model} pipeline at "
          f"{1000 * per_step:.0f} ms a step or less")
    figures = [
        figure("Ray Serve overhead per request (time added / a plain serve's latency)",
               round(overhead, 2), "%", "<= 5",
               note=f"{1000 * m['ray_outside']:.0f} ms outside the server through Ray (proxy, Mesh replica as the "
                    f"ingress, running the frontend's application in-process) against "
                    f"{1000 * m['serve_outside']:.0f} ms to a plain `paradiff serve` of latency "
                    f"{m['serve_latency']:.3f} s; with a routing key (Router replica in front) "
                    f"{1000 * m['keyed_outside']:.0f} ms{at}; {what}; {args.note}"),
        figure("Ray Serve's own part (an echo through its proxy, less on uvicorn)",
               round(100 * rays / m["serve_latency"], 2), "%",
               note=f"{1000 * rays:.0f} ms of the {1000 * added:.0f} ms added: an echo deployment answering the "
                    f"{args.model} answer's {m['answer_bytes']} bytes took {1000 * m['echo_ray_latency']:.0f} ms "
                    f"through Ray's proxy, {1000 * m['echo_uvicorn_latency']:.0f} ms on uvicorn; ours (the Mesh replica "
                    f"running the request through the frontend's application, in its process) the rest, "
                    f"{1000 * (added - rays):.0f} ms (0 or less: within the noise); {what}; {args.note}"),
        figure("Ray Serve latency / a plain serve's", round(m["ray_latency"] / m["serve_latency"], 3), "x",
               note=f"latency {m['ray_latency']:.3f} s through Ray's proxy ({m['keyed_latency']:.3f} s with a routing "
                    f"key), {m['mesh_latency']:.3f} s straight to the mesh's port, {m['serve_latency']:.3f} s to a "
                    f"plain `paradiff serve`; in the server {m['ray_server']:.3f} / {m['mesh_server']:.3f} / "
                    f"{m['serve_server']:.3f} s (the server's own time swings on loaded cores); {what}; {args.note}"),
    ]
    return figures


if __name__ == "__main__":
    sys.exit(main())
