"""The loop every rank of `paradiff serve` runs, and how the ranks recover from a fault together.

Each round, rank 0 takes the next batch of every data-parallel replica from the scheduler and broadcasts the round
over the control group; every rank runs its replica's batch; the replica's output rank puts the encoded outputs in
the store; an all-gather of small summaries ends the round. Ranks decide nothing alone: what runs, and whether the
server goes on after a fault, is rank 0's decision, read from the broadcast or the store.

A fault (an exception on any rank, or a rank that died) ends the round on every rank: each writes its error to the
store and aborts its process groups, so peers blocked in a collective with it fail at once; each then says it is
alive. When all are, rank 0 answers the round's requests (those whose outputs reached the store succeed; the others
get a 500 naming the cause) and decides "recover": the ranks join a new process group (the next generation of
store keys) and load the pipeline again, and the server goes on. When a rank is missing after ALIVE_WAIT_S, the
decision is "stop": every waiting request is answered 503, /health says failed and the ranks exit non-zero.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import pickle
import signal
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from paradiff.cli.outputs import mp4_bytes, outputs_of, png_bytes
from paradiff.cli.report import say
from paradiff.cli.worker import (Loaded, accepted_kwargs, call_kwargs, call_parameters, load_from_args,
                                 peak_memory_bytes, quiet_other_ranks)
from paradiff.distributed.comm import abort_process_groups, all_gather_object, broadcast_object
from paradiff.distributed.failures import is_comm_error

PREFIX = "paradiff/serve"
# after a fault, how long rank 0 waits for every rank to say it is alive: a rank that has not by then is taken for dead
# (each learns of the fault at its next collective; a chain of aborts on an overloaded machine took more than 2 s)
ALIVE_WAIT_S = 5.0
IDLE_WAIT_S = 0.2  # an idle round every this often: it is also how a rank that died is noticed while idle


class Channel:
    """The store shared by every rank, with keys of the current generation (one per process group)."""

    def __init__(self, store: dist.Store, rank: int, world: int) -> None:
        self.store, self.rank, self.world, self.generation = store, rank, world, 0

    def key(self, *parts: Any) -> str:
        return "/".join([PREFIX, f"gen{self.generation}", *map(str, parts)])

    def put(self, value: Any, *parts: Any) -> None:
        self.store.set(self.key(*parts), pickle.dumps(value))

    def get(self, *parts: Any) -> Any:
        return pickle.loads(self.store.get(self.key(*parts)))

    def has(self, *parts: Any) -> bool:
        return self.store.check([self.key(*parts)])


def open_store(rank: int, world: int, timeout_s: float) -> dist.Store:
    """The job's TCP store: rank 0 hosts it under paradiff's launcher; under torchrun the agent does."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=rank == 0 and not agent, timeout=datetime.timedelta(seconds=timeout_s))


def join_group(channel: Channel, backend: str, timeout_s: float) -> dist.ProcessGroup | None:
    """Initialise this generation's default process group; the control group (CPU, gloo) beside it."""
    store = dist.PrefixStore(channel.key("pg"), channel.store)
    dist.init_process_group(backend, store=store, rank=channel.rank, world_size=channel.world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return None if backend == "gloo" else dist.new_group(backend="gloo")


class Replica:
    """This rank's share of the serving: its replica's pipeline and how a batch of work items becomes calls."""

    def __init__(self, loaded: Loaded, args: argparse.Namespace, max_batch: int) -> None:
        from paradiff.api.data_parallel import data_coordinates

        self.pipeline = loaded.pipeline
        self.pipeline.set_progress_bar_config(disable=True)  # one log line per request instead
        self.monitors = loaded.monitors
        self.args = args
        self.max_batch = max_batch
        self.replica, self.replicas = data_coordinates(self.pipeline)
        self.parameters = set(call_parameters(self.pipeline))
        self.adapters = tuple((lora["adapter_name"], lora["scale"]) for lora in loaded.loras)
        self._active: tuple | None = self.adapters  # load_from_args mixed them at their start scales

    def describe(self) -> dict:
        return {"kind": "video" if "num_frames" in self.parameters else "image",
                "accepts": frozenset(self.parameters), "replicas": self.replicas, "adapters": self.adapters}

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
        kwargs = call_kwargs(self.args)
        kwargs.update(height=item["height"], width=item["width"], num_inference_steps=item["steps"])
        for field, parameter in (("guidance", "guidance_scale"), ("true_cfg_scale", "true_cfg_scale"),
                                 ("negative_prompt", "negative_prompt"), ("frames", "num_frames")):
            if item.get(field) is not None:
                kwargs[parameter] = item[field]
        return accepted_kwargs(kwargs, self.pipeline)

    def run(self, items: list[dict], channel: Channel) -> dict:
        """Run `items` (one replica's batch: same size, steps, guidance); the output rank stores each item's result.
        Returns this rank's summary of the round."""
        started = time.perf_counter()
        images = [(item, seed) for item in items for seed in item["seeds"]]
        outputs: list[Any] = []
        stamps = time.time()
        for start in range(0, len(images), self.max_batch):
            chunk = images[start:start + self.max_batch]
            kwargs = self.call_kwargs(chunk[0][0])
            self.use_adapters(tuple(chunk[0][0].get("loras", ())))
            if len(chunk) == 1:  # as `paradiff generate` calls it: byte-identical outputs
                (item, seed), = chunk
                result = self.pipeline(prompt=item["prompt"], seed=seed, **kwargs)
            else:
                result = self.pipeline(prompt=[item["prompt"] for item, _ in chunk],
                                       generator=[torch.Generator("cpu").manual_seed(seed) for _, seed in chunk],
                                       **kwargs)
            for monitor in self.monitors.values():
                monitor.clear()
            if self.pipeline.is_output_rank:
                outputs += [_encode(output, item) for (item, _), output in zip(chunk, outputs_of(result))]
        finished = time.time()
        if self.pipeline.is_output_rank and items:
            position = 0
            for item in items:
                count = len(item["seeds"])
                channel.put({"files": outputs[position:position + count], "replica": self.replica,
                             "started": stamps, "finished": finished}, "result", item["id"])
                position += count
        return {"rank": channel.rank, "seconds": time.perf_counter() - started if items else 0.0,
                "images": len(images), "steps": sum(item["steps"] * len(item["seeds"]) for item in items)}


def _encode(output, item: dict) -> dict:
    if output.kind == "video":
        return {"mime": "video/mp4", "data": mp4_bytes(output.array, item["fps"]), "frames": len(output.array)}
    if output.kind != "image":
        raise RuntimeError(f"the pipeline returned {output.kind}; paradiff serve sends images and videos")
    return {"mime": "image/png", "data": png_bytes(output.array)}


def serve_rank(args: argparse.Namespace, device: torch.device, frontend_factory: Callable | None,
               on_pipeline_loaded: Callable | None = None) -> int:
    """One rank of the server until it stops; returns the exit code (0 after a drain, 1 after a fatal fault).
    `frontend_factory()` (rank 0 only) starts the HTTP side (app.Frontend)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    quiet_other_ranks(rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    channel = Channel(open_store(rank, world, args.timeout), rank, world)
    frontend = frontend_factory() if rank == 0 else None
    _handle_signals(frontend)
    hook = on_pipeline_loaded
    try:
        while True:
            control = join_group(channel, backend, args.timeout)
            replica = None
            fault = None
            try:
                loaded = load_from_args(args, device)
                if hook is not None:
                    hook(loaded.pipeline, rank)
                    hook = None  # a fault injected for a test happens once, not again after recovery
                replica = Replica(loaded, args, args.max_batch)
                del loaded
                summary = all_gather_object({"rank": rank, "memory": peak_memory_bytes(device)}, control)
                if frontend is not None:
                    frontend.ready(replica.describe(), summary, channel.generation)
                _rounds(channel, replica, frontend, control, device)
                dist.destroy_process_group()
                return 0
            except Exception as exc:  # noqa: BLE001 - every fault ends in one agreed decision
                if channel.generation == 0 and replica is None and not is_comm_error(exc):
                    raise  # the first load failed: the launcher's usual one-line failure
                fault = _record_error(channel, exc, loading=replica is None)
            # Outside the except clause, so no traceback keeps the pipeline alive: gloo closes a group's connections
            # (which is what ends the peers' blocked collectives) only when its last reference is gone.
            replica = control = None
            abort_process_groups()
            gc.collect()
            decision = _after_fault(channel, fault, frontend)
            if decision == "stop":
                return 1
            channel.generation += 1
    finally:
        if frontend is not None:
            frontend.stop()


def _rounds(channel: Channel, replica: Replica, frontend, control, device: torch.device) -> None:
    while True:
        decision = frontend.next_round(replica.replicas, IDLE_WAIT_S) if frontend is not None else None
        decision = broadcast_object(decision, src=0, group=control)
        if decision["kind"] == "stop":
            return
        if decision["kind"] == "idle":
            continue
        summary = replica.run(decision["batches"][replica.replica], channel)
        summary["memory"] = peak_memory_bytes(device)
        summaries = all_gather_object(summary, control)
        if frontend is not None:
            frontend.finish_round(decision, channel, summaries)


def _record_error(channel: Channel, exc: BaseException, loading: bool) -> bool:
    """Put this rank's error in the store for rank 0; False when the store is gone (rank 0 died)."""
    lines = str(exc).splitlines()
    try:
        channel.put({"error": f"{type(exc).__name__}: {lines[0] if lines else ''}",
                     "comm": is_comm_error(exc) or type(exc).__name__ == "DistributedError",
                     "loading": loading}, "error", channel.rank)
    except Exception:  # noqa: BLE001
        return False
    return True


def _after_fault(channel: Channel, recorded: bool, frontend) -> str:
    """Every rank, its groups aborted: say it is alive; rank 0 decides "recover" or "stop" and answers the
    round's requests; the others wait for the decision."""
    if not recorded:
        return "stop"
    try:
        channel.put(True, "alive", channel.rank)
        if frontend is None:
            channel.store.wait([channel.key("decision")], datetime.timedelta(seconds=60))
            return channel.get("decision")
    except Exception:  # noqa: BLE001 - the store is gone: rank 0 died, nobody is left to decide
        return "stop"
    deadline = time.monotonic() + ALIVE_WAIT_S
    while time.monotonic() < deadline and not all(channel.has("alive", r) for r in range(channel.world)):
        time.sleep(0.02)
    alive = [r for r in range(channel.world) if channel.has("alive", r)]
    errors = {r: channel.get("error", r) for r in range(channel.world) if channel.has("error", r)}
    root = [f"rank {r}: {e['error']}" for r, e in sorted(errors.items()) if not e["comm"]]
    dead = sorted(set(range(channel.world)) - set(alive))
    if dead:
        root.append(f"rank(s) {dead} stopped answering (the process died or was killed)")
    cause = "; ".join(root) or "; ".join(f"rank {r}: {e['error']}" for r, e in sorted(errors.items()))
    reloading = any(e["loading"] for e in errors.values())  # the pipeline failed to load again: do not loop
    decision = "stop" if dead or reloading or frontend.closing else "recover"
    frontend.fault(channel, cause, decision)
    channel.put(decision, "decision")
    return decision


def _handle_signals(frontend) -> None:
    """SIGTERM / SIGINT: rank 0 drains (a second one stops at once); the other ranks wait for rank 0's decision."""
    if frontend is None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return

    def on_signal(number, _frame):
        if frontend.scheduler.draining:
            say("paradiff serve: second signal; stopping without finishing the requests in flight")
            os._exit(1)
        say(f"paradiff serve: {signal.Signals(number).name}: finishing the requests in flight, taking no new ones")
        frontend.drain()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
