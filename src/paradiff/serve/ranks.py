"""The loop every rank of `paradiff serve` runs, and how a replica's ranks recover from a fault together.

Each data-parallel replica is a mesh of its own, in a process group of its own, with its own keys in the store
(Channel's scope). Its first rank takes the replica's next batch from the store (put there by rank 0's dispatcher,
dispatch.py, as soon as the replica is free), checks what each request carries (the pipeline's tokenizers read its
prompts) and broadcasts it over the replica's group as JSON, or "idle" every IDLE_WAIT_S (so no rank waits in a
collective long enough for its timeout); every rank runs it; the output rank puts the encoded outputs in the store
(raw bytes, one key per file, read and deleted by rank 0) and every rank its summary (JSON). No replica waits for
another. Ranks decide nothing alone: what runs, whether a request is cancelled, and what a fault leads to is the
dispatcher's decision, read from the store or the broadcast; every value read from the store is JSON checked against
its schema, or raw bytes.

Cancellation: a request answered before its batch ended (a 504, a client that hung up) is cancelled. The dispatcher
puts a key for it in the store; at every denoising step the replica's first rank reads those keys and broadcasts the
flag to its replica, so all of them stop at the same step boundary.

Progress: at every denoising step the replica's output rank publishes one step event (stream.py's StepPublisher:
one JSON key per replica, "progress/<replica>", with each running item's steps done and in all, and the previews
made). It is the only record of progress: rank 0 reads it while the replica runs and hands it to the requests as
events, from which a video job's `progress` (serve/jobs.py), a streamed request's previews and /metrics' rates come.

A request's own fault: when a pipeline call raises on every rank of its replica alike (the same error, not a
collective's or a device's), the ranks agree on it through the store (the replica's first rank decides,
compare-and-set, so they all read one verdict) and its requests get a 500 while the replica goes on without a reload.

A fault (an exception on any rank, or a rank that died) ends the batch on every rank of its replica: each writes its
error to the store and aborts its process group, so peers blocked in a collective with it fail at once; each then
says it is alive and waits for the dispatcher's decision: "recover" (the replica's ranks join a new process group,
the next generation of its keys, and load the pipeline again, while the other replicas serve) or "stop" (a rank is
gone, or the load failed again: the ranks exit non-zero).
"""

from __future__ import annotations

import base64
import datetime
import gc
import itertools
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from paradiff.api.load_spec import Loaded, LoadSpec, load
from paradiff.api.pipeline_call import accepted_kwargs, call_parameters, image_kwargs
from paradiff.io.outputs import mp4_bytes, outputs_of, png_bytes
from paradiff.distributed.comm import abort_process_groups, all_gather_json, broadcast_flag, broadcast_json
from paradiff.distributed.failures import is_comm_error
from paradiff.distributed.spawn import DRAIN_SIGNAL, STOP_SIGNAL
from paradiff.distributed.store import checked, get_json, open_store, put_json, store_client
from paradiff.errors import DistributedError, native_message
from paradiff.runtime.console import quiet_other_ranks, say
from paradiff.runtime.memory import peak_memory_bytes
from paradiff.runtime.progress import StepClock, StepEvent
from paradiff.serve.stream import StepPublisher, preview_maker
from paradiff.serve.adapters import adapter_chunks
from paradiff.serve.protocol import RequestError
from paradiff.serve.settings import ServeSettings

PREFIX = "paradiff/serve"
# after a fault, how long rank 0 waits for a rank on another machine to say it is alive, before it takes it for dead
# (each learns of the fault at its next collective; a chain of aborts on an overloaded machine took more than 2 s). A
# rank on rank 0's machine, rank 0 itself included (its loop is the dispatcher's process's main thread), is waited for
# while its process runs, up to the collective timeout: it is dead only once its process is seen gone (a wait of 5 s
# took a live rank for dead at a load average of 40, and rank 0's own loop for dead under the load lane).
ALIVE_WAIT_S = 5.0
IDLE_WAIT_S = 0.2  # an idle round every this often: it is also how a rank that died is noticed while idle
# how long the ranks of a replica whose pipeline call raised wait for each other to say they raised alike (a request's
# own fault); past it, the error is a rank's fault. A fault on one rank costs this much more before the recovery.
AGREE_WAIT_S = 2.0
DECISION_WAIT_S = 600.0  # how long a failed replica's ranks wait for the dispatcher's decision
# store polls: the first wait, and the longest (doubling in between). An idle replica's first rank polls for work all
# the time: at 10 ms its 2 looks a poll cost an idle server more CPU than its dispatcher; 20 ms adds at most 10 ms to
# the start of a batch that comes to an idle replica (a busy one starts its next poll at 1 ms again)
POLL_S = (0.001, 0.02)
# Under Ray Serve (serve/ray.py) a mesh's frontend and dispatcher run in the Ray replica's process, which hosts the
# store and starts the ranks with FRONTEND_ELSEWHERE set: rank 0 then runs no frontend and puts its settings (parsed
# from the flags, as JSON) under SETTINGS_KEY for it.
FRONTEND_ELSEWHERE = "PARADIFF_SERVE_FRONTEND_ELSEWHERE"
SETTINGS_KEY = f"{PREFIX}/settings"

SUMMARY = {"rank": int, "replica": int, "step_s": list, "seconds": float, "images": int, "steps": int, "memory": int,
           "rss": int, "failed": dict, "cancelled": dict, "agreements": list, "refused": dict}
WORK = {"kind": str, "items": list}
READY = {"info": dict, "ranks": list}
RESULT = {"files": list, "replica": int, "started": float, "finished": float, "batch": str}
FILE = {"mime": str, "frames": (int, None)}
ERROR = {"error": str, "comm": bool, "loading": bool}


class Cancelled(Exception):
    """Raised at a step boundary on every rank of a replica whose requests rank 0 cancelled."""

    def __init__(self, step: int) -> None:
        super().__init__(f"cancelled at step {step}")
        self.step = step


class Channel:
    """The store shared by every rank, with keys of the current generation (one per process group). Values are JSON
    (checked against a schema on read) or raw bytes."""

    def __init__(self, store: dist.Store, rank: int, world: int, scope: str = "", generation: int = 0) -> None:
        # rank and world: within the scope (a replica's own ranks, "r1"); "" the whole server
        self.store, self.rank, self.world, self.scope, self.generation = store, rank, world, scope, generation

    def key(self, *parts: Any) -> str:
        return "/".join([PREFIX, *([self.scope] if self.scope else []), f"gen{self.generation}", *map(str, parts)])

    def put(self, value: Any, *parts: Any) -> None:
        put_json(self.store, self.key(*parts), value)

    def get(self, schema: Any, *parts: Any) -> Any:
        return get_json(self.store, self.key(*parts), schema)

    def take(self, schema: Any, *parts: Any) -> Any:
        """get, then delete: a slot is read once."""
        value = self.get(schema, *parts)
        self.delete(*parts)
        return value

    def put_bytes(self, data: bytes, *parts: Any) -> None:
        self.store.set(self.key(*parts), data)

    def take_bytes(self, *parts: Any) -> bytes:
        data = self.store.get(self.key(*parts))
        self.delete(*parts)
        return data

    def has(self, *parts: Any) -> bool:
        return self.store.check([self.key(*parts)])

    def delete(self, *parts: Any) -> None:
        self.store.delete_key(self.key(*parts))

    def settle(self, proposal: str, *parts: Any) -> str:
        """The value of a one-time decision: `proposal` if nobody set it first (compare-and-set), else theirs."""
        value = self.store.compare_set(self.key(*parts), "", json.dumps(proposal))
        return checked(json.loads(value), str, self.key(*parts))

    def keys(self) -> int:
        """How many keys the store holds (all generations, process groups included): flat over time while serving."""
        return int(self.store.num_keys())

    def wait_for(self, *parts: Any, deadline: float | None = None, between: Callable | None = None) -> bool:
        """Poll until the key exists (True) or `deadline` (time.monotonic()) passes (False); `between()` runs
        between polls. A store that is gone (rank 0 died) raises."""
        pause = POLL_S[0]
        while not self.has(*parts):
            if deadline is not None and time.monotonic() > deadline:
                return False
            if between is not None:
                between()
            time.sleep(pause)
            pause = min(POLL_S[1], pause * 2)
        return True

    def put_result(self, item_id: int, files: list[dict], meta: dict) -> None:
        """The output rank: each file's bytes under its own key, then the JSON that says they are all there."""
        for index, file in enumerate(files):
            self.put_bytes(file["data"], "result", item_id, index)
        self.put({"batch": "", **meta, "files": [{"mime": f["mime"], "frames": f.get("frames")} for f in files]},
                 "result", item_id)

    def take_result(self, item_id: int) -> dict | None:
        """Rank 0: the item's result, its keys deleted (None when the item has none)."""
        if not self.has("result", item_id):
            return None
        result = self.take(RESULT, "result", item_id)
        result["files"] = [{**checked(file, FILE, self.key("result", item_id)),
                            "data": self.take_bytes("result", item_id, index)}
                           for index, file in enumerate(result["files"])]
        return result

    def forget_generation(self, generation: int) -> None:
        """Rank 0, once every rank runs a later generation: the fault keys of `generation` go."""
        old = Channel(self.store, self.rank, self.world, self.scope, generation)
        for parts in [("decision",), ("fault",), *((kind, r) for kind in ("error", "alive") for r in range(self.world))]:
            old.delete(*parts)


def join_group(channel: Channel, backend: str, timeout_s: float) -> dist.ProcessGroup | None:
    """Initialise this generation's default process group; the control group (CPU, gloo) beside it."""
    store = dist.PrefixStore(channel.key("pg"), channel.store)
    dist.init_process_group(backend, store=store, rank=channel.rank, world_size=channel.world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return None if backend == "gloo" else dist.new_group(backend="gloo")


class Replica:
    """This rank's share of the serving: its replica's pipeline and how a batch of work items becomes calls."""

    def __init__(self, loaded: Loaded, settings: ServeSettings, replica: int = 0, replicas: int = 1) -> None:
        self.pipeline = loaded.pipeline
        self.pipeline.set_progress_bar_config(disable=True)  # one log line per request instead
        self.monitors = loaded.monitors
        self.settings = settings
        self.max_batch = settings.max_batch
        self.replica, self.replicas = replica, replicas
        self.parameters = set(call_parameters(self.pipeline))
        self.pipeline_name = loaded.spec.pipeline_class_name()
        self.adapters = tuple((lora["adapter_name"], lora["scale"]) for lora in loaded.loras)
        self._active: tuple | None = self.adapters  # the load mixed them at their start scales
        self.members: list[int] = list(range(dist.get_world_size()))  # this replica's ranks: its own world
        self.group = None  # the gloo group they agree in (None: the default group, gloo on CPU)
        self.on_step: Callable[[], None] | None = None  # called at every step end (None: rank 0's dispatcher polls)
        # the output rank: called at every step end (serve/stream.py's StepPublisher: progress and previews)
        self.step_listeners: list[Callable[[StepEvent], None]] = []
        self.previews = "no previews"  # what previews this server makes (serve_rank sets it)
        self._clock = StepClock()
        self.adapter_cache = None  # per-request adapters (serve/adapters.py), with --lora-modules / runtime loads
        if settings.lora_modules or settings.allow_runtime_lora:
            from paradiff.serve.adapters import AdapterCache

            self.adapter_cache = AdapterCache(self.pipeline.transformer, settings.max_loras, settings.max_lora_rank)

    def describe(self) -> dict:
        """What rank 0's frontend needs of the pipeline (JSON: it crosses the store)."""
        from paradiff.api.lora_slots import adapter_bank
        from paradiff.plans.pipelines import call_keyword

        # what an edit may carry: the conditioning inputs the call takes (under the pipeline's own keywords)
        inputs = {name for name, keyword in (("image", "image"), ("mask", "mask_image"), ("strength", "strength"))
                  if call_keyword(self.pipeline_name, keyword) in self.parameters}
        return {"kind": "video" if "num_frames" in self.parameters else "image",
                "accepts": sorted(self.parameters), "replicas": self.replicas,
                "adapters": [list(adapter) for adapter in self.adapters], "inputs": sorted(inputs),
                "pipeline": self.pipeline_name or type(self.pipeline).__name__, "previews": self.previews,
                # the transformer's modules with adapter slots: an adapter aiming elsewhere is refused when named
                "adapter_modules": sorted(adapter_bank(self.pipeline.transformer).layers)
                if self.adapter_cache is not None else []}

    def check(self, item: dict) -> str | None:
        """The replica's first rank, before a batch is broadcast: why the pipeline could not take `item` (None when it
        can). Every tokenizer of the pipeline reads the item's texts, so a text no tokenizer can read is the
        request's error (400) and never runs."""
        texts = [item["prompt"]] + ([item["negative_prompt"]] if item.get("negative_prompt") else [])
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                return f"the prompt is not valid Unicode text ({exc.reason} at character {exc.start})"
        for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
            tokenizer = getattr(self.pipeline, name, None)
            if tokenizer is None or not callable(tokenizer):
                continue
            try:
                tokenizer(texts, truncation=True, max_length=min(int(getattr(tokenizer, "model_max_length", 512)),
                                                                 1 << 20))
            except Exception as exc:  # noqa: BLE001 - the tokenizer's refusal is the request's error
                line = (str(exc).splitlines() or [""])[0][:200]
                return f"the pipeline's {name} cannot read the prompt ({type(exc).__name__}: {line})"
        return None

    def use_adapters(self, loras: tuple) -> None:
        """The request's adapters and scales (every rank of the replica gets the same, from the broadcast round)."""
        loras = tuple((name, float(scale)) for name, scale in loras)
        if loras == self._active or not self.adapters:
            return
        if loras:
            self.pipeline.enable_lora()
            self.pipeline.set_adapters([name for name, _ in loras], [scale for _, scale in loras])
        else:
            self.pipeline.disable_lora()
        self._active = loras

    def call_kwargs(self, item: dict) -> dict:
        kwargs = self.settings.call_kwargs()
        kwargs.update(height=item["height"], width=item["width"], num_inference_steps=item["steps"])
        for field, parameter in (("guidance", "guidance_scale"), ("true_cfg_scale", "true_cfg_scale"),
                                 ("negative_prompt", "negative_prompt"), ("frames", "num_frames")):
            if item.get(field) is not None:
                kwargs[parameter] = item[field]
        if item.get("images"):
            kwargs.update(self.edit_inputs(item))
        return accepted_kwargs(kwargs, self.pipeline)

    def edit_inputs(self, item: dict) -> dict:
        """An edit's images (and mask, strength) as the call takes them, decoded from the round's bytes as `paradiff
        generate` reads its --image / --mask files."""
        from paradiff.io.images import read_image

        images = [read_image(base64.b64decode(data)) for data in item["images"]]
        mask = read_image(base64.b64decode(item["mask"]), "L") if item.get("mask") is not None else None
        return image_kwargs(images, mask, item.get("strength"), self.pipeline_name)

    def run(self, items: list[dict], channel: Channel, number: int) -> dict:
        """Run `items` (one replica's batch: same size, steps, guidance), its batch `number`; the output rank stores
        each item's result. Returns this rank's summary of the batch (failed: item id -> error, for a request's own fault;
        cancelled: item id -> the steps its call ran)."""
        started = time.perf_counter()
        images = [(item, seed) for item in items for seed in item["seeds"]]
        files: dict[int, list[dict]] = {item["id"]: [] for item in items}
        failed: dict[int, str] = {}
        cancelled: dict[int, int] = {}
        agreements: list[int] = []
        stamps = time.time()
        steps = 0
        self._clock = StepClock()
        per_call = 1 if any(item.get("images") for item in items) else self.max_batch  # an edit: one image a call
        chunks = adapter_chunks(images, per_call, self.settings.max_loras)
        calls = {item["id"]: 0 for item in items}  # how many calls each item's images take, and have taken
        for chunk in chunks:
            for item_id in {item["id"] for item, _ in chunk}:
                calls[item_id] += 1
        progress = {item_id: [0, count * items[0]["steps"]] for item_id, count in calls.items()} if items else {}
        batches: dict[int, str] = {}
        for chunk_index, chunk in enumerate(chunks):
            ids = sorted({item["id"] for item, _ in chunk})
            kwargs = self.call_kwargs(chunk[0][0])
            if "callback_on_step_end" in self.parameters:
                # what the step events say of each item: steps done before this call, and in all its calls
                context = {"round": number, "ids": ids, "steps": chunk[0][0]["steps"], "height": kwargs.get("height"),
                           "width": kwargs.get("width"),
                           "items": [{"id": item["id"], "partial_images": item.get("partial_images", 0)}
                                     for item, _ in chunk],
                           "progress": {item_id: list(progress[item_id]) for item_id in ids}}
                kwargs["callback_on_step_end"] = self._step_end(ids, channel, context)
                self._clock.begin()
            self.use_adapters(tuple(chunk[0][0].get("loras", ())))
            try:
                if self.adapter_cache is not None:  # between calls: a load never stalls a running one
                    self.adapter_cache.prepare([item.get("adapter") for item, _ in chunk], self.pipeline,
                                               self.members)
                if len(chunk) == 1:  # as `paradiff generate` calls it: byte-identical outputs
                    (item, seed), = chunk
                    result = self.pipeline(prompt=item["prompt"], seed=seed, **kwargs)
                else:
                    result = self.pipeline(prompt=[item["prompt"] for item, _ in chunk],
                                           generator=[torch.Generator("cpu").manual_seed(seed) for _, seed in chunk],
                                           **kwargs)
                steps += chunk[0][0]["steps"] * len(chunk)
            except Cancelled as stop:
                cancelled.update(dict.fromkeys(ids, stop.step))
                steps += stop.step * len(chunk)
                continue
            except Exception as exc:  # noqa: BLE001 - the request's own fault when every rank of the replica agrees
                if is_comm_error(exc) or isinstance(exc, DistributedError) or _device_fault(exc):
                    raise
                agreements.append(chunk_index)
                if self._agree_on_request_fault(exc, channel, number, chunk_index) != "request":
                    raise
                failed.update(dict.fromkeys(ids, request_fault(exc)))
                continue
            finally:
                for monitor in self.monitors.values():
                    monitor.clear()
                for item_id in ids:
                    progress[item_id][0] = min(progress[item_id][1], progress[item_id][0] + chunk[0][0]["steps"])
            if self.pipeline.is_output_rank:
                for (item, _), output in zip(chunk, outputs_of(result)):
                    files[item["id"]] += _encode(output, item)
                    batches.setdefault(item["id"], f"{self.replica}.{channel.generation}.{number}.{chunk_index}")
        finished = time.time()
        if self.pipeline.is_output_rank:
            for item in items:
                if item["id"] not in failed and item["id"] not in cancelled:
                    channel.put_result(item["id"], files[item["id"]], {"replica": self.replica, "started": stamps,
                                                                      "finished": finished,
                                                                      "batch": batches.get(item["id"], "")})
        step_s = self._clock.times if self.pipeline.is_output_rank else []
        return {"rank": channel.rank, "replica": self.replica, "step_s": step_s,
                "seconds": time.perf_counter() - started if items else 0.0,
                "images": len(images), "steps": steps, "failed": {str(k): v for k, v in failed.items()},
                "cancelled": {str(k): v for k, v in cancelled.items()}, "agreements": agreements}

    def _step_end(self, ids: list[int], channel: Channel, context: dict) -> Callable:
        """diffusers' callback_on_step_end: the output rank's step listeners get the step's event (nothing else
        runs them: they take no decision and run no collective; its StepPublisher puts the event in the store, the one
        record of progress rank 0 reads); the replica's first rank reads whether rank 0 cancelled any of `ids`,
        which it broadcasts to the replica; every rank raises Cancelled at the same step."""
        lead = self.members[0]

        def step_end(pipeline, step, _timestep, callback_kwargs):
            if self.step_listeners and self.pipeline.is_output_rank:
                event = StepEvent(step + 1, int(getattr(pipeline, "num_timesteps", 0) or context["steps"]),
                                  self._clock.tick(), callback_kwargs.get("latents"), context)
                for listener in self.step_listeners:
                    listener(event)
            if self.on_step is not None:
                self.on_step()
            flag = channel.rank == lead and any(channel.has("cancel", i) for i in ids)
            if len(self.members) > 1:
                flag = broadcast_flag(flag, src=lead, group=self.group)
            if flag:
                raise Cancelled(step + 1)
            return {}

        return step_end

    def _agree_on_request_fault(self, exc: BaseException, channel: Channel, number: int, chunk: int) -> str:
        """"request" when every rank of this replica raised the same error in this call (the request's own fault),
        "fault" otherwise (a rank's fault; also when a peer does not say so within AGREE_WAIT_S: it may be blocked in a
        collective). The replica's first rank proposes; one compare-and-set makes every rank read the same verdict."""
        message = f"{type(exc).__name__}: {exc}"[:2000]
        channel.put(message, "round", number, "fail", chunk, channel.rank)
        verdict = ("round", number, "verdict", self.replica, chunk)
        deadline = time.monotonic() + AGREE_WAIT_S
        if channel.rank != self.members[0]:
            if channel.wait_for(*verdict, deadline=deadline + 0.5):
                return channel.get(str, *verdict)
            return channel.settle("fault", *verdict)
        everyone = all(channel.wait_for("round", number, "fail", chunk, r, deadline=deadline) for r in self.members)
        alike = everyone and all(channel.get(str, "round", number, "fail", chunk, r) == message for r in self.members)
        return channel.settle("request" if alike else "fault", *verdict)


def request_fault(exc: BaseException) -> dict:
    """What the client of a request is told of its own fault (every rank of its replica raised the same error): a
    RequestError's status and message; 400 for a ValueError, a check of this request's inputs (the pipeline's
    `check_inputs`, an adapter that does not fit the model); 500 for anything else. One line, at most 300 characters."""
    line = native_message(exc, 300)
    if isinstance(exc, RequestError):
        return {"status": exc.status, "error": line}
    if isinstance(exc, ValueError):
        return {"status": 400, "error": f"the pipeline refused the request: {type(exc).__name__}: {line}"}
    return {"status": 500, "error": f"the request failed in the pipeline: {type(exc).__name__}: {line}"}


DEVICE_FAULT_MARKERS = ("cuda error", "device-side assert", "illegal memory access", "cublas", "cudnn", "hip error",
                        "ecc error", "xpu error")


def _device_fault(exc: BaseException) -> bool:
    """An error of the device itself (sticky on CUDA: every later call fails too): a rank's fault, reloaded, even when
    every rank of the replica hit it (a replica of one rank always agrees with itself)."""
    return any(marker in str(exc).lower() for marker in DEVICE_FAULT_MARKERS)


def _encode(output, item: dict) -> list[dict]:
    """An output's files: a PNG image; or an MP4 video and its first frame as PNG (the job's thumbnail, exactly the
    frame `paradiff generate` writes)."""
    if output.kind == "video":
        return [{"mime": "video/mp4", "data": mp4_bytes(output.array, item["fps"]), "frames": len(output.array)},
                {"mime": "image/png", "data": png_bytes(output.array[0])}]
    if output.kind != "image":
        raise RuntimeError(f"the pipeline returned {output.kind}; paradiff serve sends images and videos")
    return [{"mime": "image/png", "data": png_bytes(output.array)}]


def rss_bytes() -> int:
    """This process's resident memory now (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def serve_rank(settings: ServeSettings, device: torch.device, frontend_factory: Callable | None,
               on_pipeline_loaded: Callable | None = None, dispatcher_factory: Callable | None = None) -> int:
    """One rank of the server until it stops; returns the exit code (0 after a drain, 1 after a fatal fault). Each
    replica loads `settings.spec` (api/load_spec.py) on its own mesh; the rest of `settings` is the server's own.
    `frontend_factory()` (rank 0 only) starts the HTTP side (app.Frontend); rank 0 also runs
    `dispatcher_factory(store, frontend, replicas, size, timeout_s)` (dispatch.Dispatcher, passed in by the serve
    command: dispatch.py reads this module's channel), in a thread beside its own replica's loop. With no
    `frontend_factory` both run in the process that hosts the store (Ray's Mesh replica): rank 0 puts `settings`
    there for it (SETTINGS_KEY)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    quiet_other_ranks(rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    spec = settings.spec
    store = open_store(rank, world, settings.timeout)
    replicas = spec.parallel.data_degree
    size = world // replicas  # ranks per replica: replica r is ranks r * size ... (r + 1) * size - 1
    index, local = divmod(rank, size)
    channel = Channel(store, local, size, scope=f"r{index}")
    frontend = frontend_factory() if rank == 0 and frontend_factory is not None else None
    if rank == 0 and frontend is None:
        put_json(store, SETTINGS_KEY, settings.as_json())
    _handle_signals(frontend)
    timeout = settings.timeout
    dispatcher = (dispatcher_factory(store_client(timeout), frontend, replicas, size, timeout).start()
                  if frontend is not None else None)
    own: LoadSpec = spec.one_replica()  # each replica is a mesh of its own, in a process group of its own
    hook = on_pipeline_loaded
    try:
        while True:
            control = join_group(channel, backend, settings.timeout)
            replica = None
            fault = None
            try:
                loaded = load(own, device)
                if hook is not None:
                    hook(loaded.pipeline, rank)
                    hook = None  # a fault injected for a test happens once, not again after recovery
                replica = Replica(loaded, settings, index, replicas)
                replica.group = control
                del loaded
                maker, replica.previews = preview_maker(replica.pipeline, settings.previews,
                                                        Path(settings.out) / "previews",
                                                        staged=spec.stages)
                if replica.pipeline.is_output_rank:
                    replica.step_listeners.append(StepPublisher(channel, replica.replica, maker))
                summary = all_gather_json({"rank": rank, "memory": peak_memory_bytes(device), "rss": rss_bytes(),
                                           "replica": replica.replica, "pid": os.getpid(),
                                           "host": socket.gethostname()}, control)
                if local == 0:
                    channel.put({"info": replica.describe(), "ranks": summary}, "ready")
                _serve_replica(channel, replica, control, device)
                dist.destroy_process_group()
                if dispatcher is not None:
                    dispatcher.join()
                return 0 if dispatcher is None or not dispatcher.failed else 1
            except Exception as exc:  # noqa: BLE001 - every fault ends in one agreed decision
                if channel.generation == 0 and replica is None and not is_comm_error(exc):
                    raise  # the first load failed: the launcher's usual one-line failure
                fault = _record_error(channel, exc, loading=replica is None)
            # Outside the except clause, so no traceback keeps the pipeline alive: gloo closes a group's connections
            # (which is what ends the peers' blocked collectives) only when its last reference is gone.
            replica = control = None
            abort_process_groups()
            gc.collect()
            if _await_decision(channel, fault) == "stop":
                if dispatcher is not None:
                    dispatcher.join()
                return 1
            channel.generation += 1
    finally:
        if dispatcher is not None:
            dispatcher.stop()
        if frontend is not None:
            frontend.stop()


def _serve_replica(channel: Channel, replica: Replica, control, device: torch.device) -> None:
    """This replica's loop: its first rank takes the next batch rank 0's dispatcher put in the store for it (or says
    "idle" every IDLE_WAIT_S, so the other ranks never wait past a collective's timeout), checks its requests and
    broadcasts it to the replica; every rank runs it and puts its summary in the store, where the dispatcher reads
    it. No other replica is waited for."""
    lead = channel.rank == 0
    number = 0
    while True:
        work = _next_work(channel, replica, number + 1) if lead else None
        if len(replica.members) > 1:
            work = broadcast_json(work, src=0, group=control)
        if work["kind"] == "stop":
            if lead:
                channel.put(True, "stopped")
            return
        if work["kind"] == "idle":
            continue
        number += 1
        summary = replica.run(work["items"], channel, number)
        summary.update(memory=peak_memory_bytes(device), rss=rss_bytes(), refused=work["refused"] if lead else {})
        channel.put(summary, "batch", number, "summary", channel.rank)


def _next_work(channel: Channel, replica: Replica, number: int) -> dict:
    """The first rank: batch `number` from the store ({"kind": "work", "items", "refused"}), "stop", or "idle" when
    none came within IDLE_WAIT_S. Items the pipeline cannot take (Replica.check) are refused here, never run."""
    deadline = time.monotonic() + IDLE_WAIT_S
    if not channel.wait_for("work", number, deadline=deadline, between=lambda: _raise_on_fault(channel)):
        return {"kind": "idle"}
    work = channel.take(WORK, "work", number)
    if work["kind"] != "work":
        return {"kind": "stop"}
    refused = {}
    for item in work["items"]:
        problem = replica.check(item)
        if problem is not None:
            refused[str(item["id"])] = problem
    return {"kind": "work", "items": [item for item in work["items"] if str(item["id"]) not in refused],
            "refused": refused}


def process_alive(pid: int) -> bool:
    """Whether process `pid` (a rank on this machine) still runs: not gone, not a zombie."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except ProcessLookupError:
        return False
    except (OSError, IndexError):
        return True  # no /proc here: the signal check said it exists


def _raise_on_fault(channel: Channel) -> None:
    """A rank waiting in the store (not in a collective, where an abort would reach it) learns of a peer's fault."""
    if channel.has("fault"):
        raise DistributedError("a peer rank failed while this rank waited for the round to end")


def _record_error(channel: Channel, exc: BaseException, loading: bool) -> bool:
    """Put this rank's error in the store for rank 0; False when the store is gone (rank 0 died)."""
    lines = str(exc).splitlines()
    try:
        channel.put({"error": f"{type(exc).__name__}: {lines[0] if lines else ''}",
                     "comm": is_comm_error(exc) or type(exc).__name__ == "DistributedError",
                     "loading": loading}, "error", channel.rank)
        channel.put(True, "fault")  # for the ranks that wait in the store: no abort reaches them
    except Exception:  # noqa: BLE001
        return False
    return True


def _await_decision(channel: Channel, recorded: bool) -> str:
    """Every rank of a replica that failed, its groups aborted: say it is alive, then wait for rank 0's dispatcher
    to decide "recover" (this replica alone joins a new process group and loads again) or "stop"."""
    if not recorded:
        return "stop"
    try:
        channel.put(True, "alive", channel.rank)
        # polled: on rank 0 a blocking wait would hold the store's connection, which the dispatcher's thread uses
        if not channel.wait_for("decision", deadline=time.monotonic() + DECISION_WAIT_S):
            return "stop"
        return channel.get(str, "decision")
    except Exception:  # noqa: BLE001 - the store is gone: rank 0 died, nobody is left to decide
        return "stop"


def _handle_signals(frontend) -> None:
    """SIGTERM / SIGINT: rank 0 drains (a second one stops at once); the other ranks wait for rank 0's decision. The
    launcher's DRAIN_SIGNAL drains too, without counting (a SIGTERM to the process group reaches rank 0 both
    directly and through the launcher: one request to drain); its STOP_SIGNAL (the launcher asked again) stops."""
    if frontend is None:
        for number in (signal.SIGTERM, signal.SIGINT, DRAIN_SIGNAL, STOP_SIGNAL):  # SIGUSR1 / 2 would end it
            signal.signal(number, signal.SIG_IGN)
        return
    # counters, not flags: next() is one step no other signal's handler can split (a handler runs between
    # bytecodes, and both signals of a group SIGTERM may arrive together)
    asked, drains = itertools.count(), itertools.count()

    def stop() -> None:
        say("paradiff serve: second signal; stopping without finishing the requests in flight")
        os._exit(1)

    def drain(name: str) -> None:
        if next(drains) == 0 and not frontend.scheduler.draining:
            say(f"paradiff serve: {name}: finishing the requests in flight, taking no new ones")
            frontend.drain()

    def on_signal(number, _frame):
        if next(asked) > 0:
            stop()
        drain(signal.Signals(number).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(DRAIN_SIGNAL, lambda _number, _frame: drain("SIGTERM"))
    signal.signal(STOP_SIGNAL, lambda _number, _frame: stop())
