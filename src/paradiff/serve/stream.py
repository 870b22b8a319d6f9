"""Denoising progress from the ranks to the HTTP side: step events, x0 previews, and OpenAI's streamed images.

On each replica's output rank a StepPublisher (one of the replica's step listeners) puts, at every step end, the
step's event in the store (JSON, one key per replica, overwritten: the call's step, each running item's steps done
and in all, the previews made) and, at the steps a streamed request asked a preview for, the preview's PNG (one key
per preview, taken by rank 0). The other ranks do nothing extra. This event is the one record of progress: rank 0's
ProgressRouter reads it between its own steps and while it waits for a round, and hands it to the requests' jobs as
events (`Job.emit`), from which everything else reads: a video job's `progress` in the job store (serve/jobs.py), a
streamed request's previews in its SSE answer, each replica's steps per second in /metrics. Before a round is
answered the router reads what is left, so every preview of a request is sent before its final image.

`POST /v1/images/generations` (and `/v1/images/edits`) with `"stream": true` answers server-sent events as OpenAI's
client reads them (openai.types.ImageGenStreamEvent; an edit's are named `image_edit.*`): a `partial_image` event
(b64_json, partial_image_index) for each of `partial_images` previews (of the first image where `n` > 1), then a
`completed` event with the image the same request without `stream` gets, byte for byte (one event per image). An
error after the stream started is an event `{"error": {...}}` (the client raises it).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path
from typing import Any, Callable

from paradiff.io.outputs import png_bytes
from paradiff.runtime.console import say
from paradiff.serve.images import encode_output
from paradiff.serve.protocol import ENDPOINTS, RequestError
from paradiff.runtime.progress import StepEvent

# a replica's step event: its call's step of steps, each item's [steps done, steps in all] over its calls
PROGRESS = {"round": int, "ids": list, "step": int, "steps": int, "elapsed_s": float, "previews": dict,
            "items": dict}
PREVIEW_MODES = ("linear", "vae", "off")


def preview_steps(steps: int, count: int) -> list[int]:
    """At which steps (1 to `steps` done) a request of `count` previews gets them: spread over steps 2 to steps - 1
    (x0 needs two consecutive latents; at the last step x0 is the final image). Fewer where fewer steps are there,
    as OpenAI's API allows."""
    available = list(range(2, steps))
    if count >= len(available):
        return available
    return [available[round((i + 1) * (len(available) + 1) / (count + 1)) - 1] for i in range(count)]


def preview_maker(pipeline, mode: str, cache_dir: Path | None, staged: bool = False) -> tuple[Any, str]:
    """(this rank's PreviewMaker or None, a line saying what previews this server makes). The linear map is fitted
    at load on the output rank; where the VAE is split over ranks its decoder runs collectives, so every rank fits
    (the same random latents, the same calls, no cache read: no rank may skip a decode the others run)."""
    from paradiff.plans.previews import covered_pipelines, preview_layout
    from paradiff.runtime.previews import PreviewMaker, fit_linear_map, x0_unavailable
    from paradiff.vae import get_vae_runtime

    if mode == "off":
        return None, "no previews (--previews off)"
    layout = preview_layout(pipeline)
    if layout is None:
        return None, (f"no previews: the latents of {type(pipeline).__name__} are not declared for previews "
                      f"(plans/previews.py covers {', '.join(covered_pipelines())})")
    why = x0_unavailable(pipeline.scheduler)
    if why is not None:
        return None, f"no previews: {why}"
    split = get_vae_runtime(pipeline.vae) is not None
    if mode == "vae":
        if staged:
            return None, ("no previews: with --stages a VAE preview would swap the transformer out at every preview "
                          "(use --previews linear)")
        if split:
            return None, ("no previews: --previews vae decodes on the output rank alone, and this VAE is split over "
                          "ranks (add --no-parallel-vae, or use --previews linear)")
        maker = PreviewMaker(pipeline, layout, "vae") if pipeline.is_output_rank else None
        return maker, "x0 previews decoded by the VAE"
    if not (split or pipeline.is_output_rank):
        return None, "x0 previews by a fitted linear map"
    linear = fit_linear_map(pipeline, layout, None if split else cache_dir)
    maker = PreviewMaker(pipeline, layout, "linear", linear) if pipeline.is_output_rank else None
    return maker, f"x0 previews by a fitted linear map (RMS error {linear.fit_error:.3f} on a held-out latent)"


class StepPublisher:
    """A step listener of a replica's output rank: the step's event, and the previews asked for, into the store."""

    def __init__(self, channel, replica: int, previews) -> None:
        self.channel, self.replica, self.previews = channel, replica, previews
        self._counts: dict[int, int] = {}  # item id -> previews put this round
        self._round: int | None = None
        self._elapsed = 0.0

    def __call__(self, event: StepEvent) -> None:
        context = event.context
        if context["round"] != self._round:
            self._round, self._counts = context["round"], {}
        if event.step == 1:
            self._elapsed = 0.0
            if self.previews is not None:
                self.previews.reset()
        self._elapsed += event.seconds
        # a request of n images previews its first one: its first row in its first call (none in the calls that
        # run its other images, where one call takes fewer than n)
        before = context.get("progress", {})
        firsts = {}
        for row, item in enumerate(context["items"]):
            if before.get(item["id"], (0, 0))[0] == 0:
                firsts.setdefault(item["id"], (row, item))
        wanted = [(row, item) for row, item in firsts.values()
                  if event.step in preview_steps(event.steps, item["partial_images"])]
        if wanted and self.previews is not None and event.latents is not None and self.previews.can_render():
            try:
                pictures = self.previews.render(event.latents, context["height"], context["width"])
            except Exception as exc:  # noqa: BLE001 - a preview is never worth a request: this rank stops making them
                say(f"paradiff serve: previews stopped on rank {self.channel.rank}: {type(exc).__name__}: {exc}")
                self.previews, pictures, wanted = None, [], []
            for row, item in wanted:
                index = self._counts.get(item["id"], 0)
                self.channel.put_bytes(png_bytes(pictures[row]), "preview", item["id"], index)
                self._counts[item["id"]] = index + 1
        if self.previews is not None and event.latents is not None:
            self.previews.observe(event.latents)
        # each item's steps over all its calls (a request of more images than a call takes runs several)
        items = {}
        for item_id in context["ids"]:
            done, total = before.get(item_id, (0, event.steps))
            items[str(item_id)] = [min(total, done + event.step), total]
        self.channel.put({"round": context["round"], "ids": context["ids"], "step": event.step,
                          "steps": event.steps, "elapsed_s": self._elapsed,
                          "previews": {str(k): v for k, v in self._counts.items()}, "items": items},
                         "progress", self.replica)


class ProgressRouter:
    """Rank 0: each replica's progress and the previews, from the store to the frontend (`on_step(replica,
    progress)`, `on_preview(item id, index, png)`)."""

    def __init__(self, on_step: Callable, on_preview: Callable) -> None:
        self.on_step, self.on_preview = on_step, on_preview
        self._seen: dict[int, tuple] = {}  # replica -> (round, ids, step) last handed on
        self._taken: dict[int, int] = {}  # item id -> previews taken

    def poll(self, channel, replicas: int | list[int]) -> None:
        """`replicas`: how many (all in `channel`), or which ones (a replica's own channel holds its own)."""
        for replica in (range(replicas) if isinstance(replicas, int) else replicas):
            if not channel.has("progress", replica):
                continue
            progress = channel.get(PROGRESS, "progress", replica)
            for key, count in progress["previews"].items():
                item = int(key)
                for index in range(self._taken.get(item, 0), int(count)):
                    self.on_preview(item, index, channel.take_bytes("preview", item, index))
                self._taken[item] = max(self._taken.get(item, 0), int(count))
            mark = (progress["round"], tuple(progress["ids"]), progress["step"],
                    tuple(tuple(done) for done in progress["items"].values()))
            if self._seen.get(replica) != mark:
                self._seen[replica] = mark
                self.on_step(replica, progress)

    def finish_round(self, channel, replicas: int | list[int], items: list[int] | None = None) -> None:
        """The round's (or one replica's batch's) ranks are done: what is left is handed on, its progress keys go.
        `items`: the batch's item ids, when other replicas' batches still run (None: every item)."""
        replicas = list(range(replicas) if isinstance(replicas, int) else replicas)
        self.poll(channel, replicas)
        for replica in replicas:
            channel.delete("progress", replica)
            self._seen.pop(replica, None)
        for item in (list(self._taken) if items is None else items):
            self._taken.pop(item, None)


# -- the HTTP side ------------------------------------------------------------------------------------------------
def _event(payload: dict) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode() if "type" in payload \
        else f"data: {json.dumps(payload)}\n\n".encode()


def wants_stream(body: Any) -> bool:
    """Whether a generation's JSON body, or an edit's form pairs, ask for server-sent events (`stream` true)."""
    if isinstance(body, dict):
        return body.get("stream") is True
    return isinstance(body, list) and any(name == "stream" and isinstance(value, str) and value.lower() == "true"
                                          for name, value in body)


async def stream_images(frontend, body: Any, error_body: Callable, kind: str = "image"):
    """The answer to a streamed POST /v1/images/generations (`kind` "image") or /v1/images/edits ("edit": the form's
    pairs): a JSON error before anything runs, else SSE."""
    from fastapi.responses import StreamingResponse

    what = f"POST {ENDPOINTS[kind]}"
    if frontend.health not in ("ready", "degraded") or frontend.limits is None:
        return frontend.refusal(503, f"the server is {frontend.health}; retry when GET /health says ready", what)
    try:
        request = frontend.parse(body, kind)
        job = frontend.scheduler.submit(request)
    except RequestError as exc:
        retry = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
        return frontend.refusal(exc.status, str(exc), what, retry, param=exc.param, code=exc.code)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    job.add_listener(lambda event: loop.call_soon_threadsafe(queue.put_nowait, event))
    job.add_done_callback(lambda: loop.call_soon_threadsafe(queue.put_nowait, None))
    prefix = "image_edit" if kind == "edit" else "image_generation"  # OpenAI's event names
    common = {"background": "auto", "output_format": request.output_format, "quality": "auto",
              "size": f"{request.width}x{request.height}"}

    async def events():
        try:
            while True:
                left = job.deadline - time.monotonic()
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=max(left, 0.0))
                except asyncio.TimeoutError:
                    frontend.scheduler.time_out(job)
                    continue
                if event is None:
                    break
                if event["type"] == "partial_image":
                    yield _event({"type": f"{prefix}.partial_image", **common, "created_at": int(time.time()),
                                  "partial_image_index": event["index"],
                                  "b64_json": base64.b64encode(encode_output(
                                      event["data"], request.output_format, request.output_compression)).decode()})
            if job.status != 200:
                yield _event(error_body(job.status, str(job.result))[1])
                return
            usage = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
                     "output_tokens": 0, "total_tokens": 0}  # no tokens are counted here
            for index, file in enumerate(job.result["files"]):  # one per image: image i has seed + i
                yield _event({"type": f"{prefix}.completed", **common, "created_at": int(time.time()),
                              "b64_json": base64.b64encode(encode_output(file["data"], request.output_format,
                                                                         request.output_compression)).decode(),
                              "usage": usage,
                              "seed": request.seed + index})
        finally:  # the client went away (the response task is cancelled): its work stops at the next step
            if not job.done.is_set():
                frontend.scheduler.cancel(job, 499, "the client closed the stream before the answer")

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

