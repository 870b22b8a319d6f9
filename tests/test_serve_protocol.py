"""`paradiff serve`'s request checks and scheduler, in this process (the servers themselves: test_serve.py)."""

from __future__ import annotations

import threading
import time

import pytest

from paradiff.serve.metrics import Metrics
from paradiff.serve.protocol import Limits, RequestError, parse_image_request
from paradiff.serve.safety import RequestGuard, public_message
from paradiff.serve.scheduler import Scheduler

LIMITS = Limits(max_n=4, max_steps=20, max_prompt_chars=100, max_side=256, default_size=(64, 64), default_steps=8,
                accepts=frozenset({"prompt", "guidance_scale", "num_inference_steps"}))


def test_a_good_request_gets_the_defaults_and_its_seeds():
    request = parse_image_request({"prompt": "a red circle", "n": 3, "seed": 7, "size": "128x64"}, LIMITS)
    assert (request.width, request.height, request.steps, request.n) == (128, 64, 8, 3)
    assert request.seeds() == [7, 8, 9]
    assert parse_image_request({"prompt": "x"}, LIMITS).seed is None  # the frontend draws one (app.with_seed)
    streamed = parse_image_request({"prompt": "x", "stream": True, "partial_images": 2}, LIMITS)
    assert (streamed.stream, streamed.partial_images) == (True, 2)
    assert parse_image_request({"prompt": "x", "partial_images": 2}, LIMITS).partial_images == 0  # no stream: none


@pytest.mark.parametrize("body, status, words", [
    ({"prompt": "x", "bogus": 1}, 400, "unknown field(s) ['bogus']"),
    ({"prompt": ""}, 400, "prompt: expected a non-empty string"),
    ({"prompt": "x" * 101}, 400, "101 characters long; at most 100"),
    ({"prompt": "x", "size": "50x64"}, 400, "multiples of 16"),
    ({"prompt": "x", "size": "512x512"}, 400, "to 256"),
    ({"prompt": "x", "size": 64}, 400, "WIDTHxHEIGHT"),
    ({"prompt": "x", "n": 5}, 400, "n 5 is out of bounds: expected 1 to 4"),
    ({"prompt": "x", "n": True}, 400, "n: expected an integer"),
    ({"prompt": "x", "steps": 21}, 400, "steps 21 is out of bounds: expected 1 to 20"),
    ({"prompt": "x", "seed": -1}, 400, "seed: expected an integer from 0"),
    ({"prompt": "x", "guidance": "high"}, 400, "guidance: expected a number"),
    ({"prompt": "x", "negative_prompt": "blurry"}, 400, "takes no negative_prompt"),
    ({"prompt": "x", "response_format": "url"}, 400, "only 'b64_json'"),
    ({"prompt": "x", "model": "other"}, 404, "model 'other' is not served here"),
    ({"prompt": "x", "quality": "ultra"}, 400, "quality 'ultra': expected one of ['auto', 'standard', 'hd'"),
    ({"prompt": "x", "style": 3}, 400, "style 3: expected one of ['vivid', 'natural']"),
    ({"prompt": "x", "output_format": "gif"}, 400, "output_format 'gif': expected one of ['png', 'jpeg', 'webp']"),
    ({"prompt": "x", "output_compression": 101}, 400, "output_compression 101 is out of bounds: expected 0 to 100"),
    ({"prompt": "x", "seed": 2**63 - 1, "n": 2}, 400, "image 1 would use seed 9223372036854775808"),
    ({"prompt": "x", "strength": 0.5}, 400, "unknown field(s) ['strength']"),  # edits only
    ({"prompt": "x", "stream": "yes"}, 400, "stream: expected true or false"),
    ({"prompt": "x", "stream": True, "partial_images": 4}, 400, "partial_images 4 is out of bounds: expected 0 to 3"),
    (["x"], 400, "must be a JSON object, got list"),
    ({"prompt": "x", "output_format": ""}, 400, "output_format '': expected one of"),
    ({"prompt": "x", "output_format": 0}, 400, "output_format 0: expected one of"),
    ({"prompt": "x", "size": " 64x64"}, 400, "size ' 64x64': expected 'WIDTHxHEIGHT'"),
    ({"prompt": "x", "size": "+64x64"}, 400, "size '+64x64'"),
    ({"prompt": "x", "size": "6_4x64"}, 400, "size '6_4x64'"),
    ({"prompt": "x", "size": "\u0666\u0664x64"}, 400, "expected 'WIDTHxHEIGHT'"),  # Arabic-Indic digits
    ({"prompt": "x", "steps": 1e308}, 400, "... is out of bounds: expected 1 to 20"),  # not 309 digits
    ({"prompt": "x", "safety_identifier": 1}, 400, "safety_identifier 1: expected a string"),
])
def test_bad_requests_name_the_field_and_what_is_valid(body, status, words):
    with pytest.raises(RequestError) as caught:
        parse_image_request(body, LIMITS)
    assert caught.value.status == status
    assert words in str(caught.value)


def test_null_is_a_fields_default_and_long_values_are_not_echoed_whole():
    """OpenAI's client sends null for a field left to its default; a message quotes at most 60 characters of a value."""
    request = parse_image_request({"prompt": "x", "n": None, "steps": None, "response_format": None,
                                   "output_format": None, "size": None, "seed": None, "stream": None}, LIMITS)
    assert (request.n, request.steps, request.output_format, (request.width, request.height)) == (1, 8, "png",
                                                                                                    (64, 64))
    with pytest.raises(RequestError) as caught:
        parse_image_request({"prompt": "x", "model": "m" * 5000}, LIMITS)
    assert caught.value.status == 404 and len(str(caught.value)) < 200, str(caught.value)


def test_openai_video_seconds_are_read_as_openai_sends_them_and_bounded():
    """`seconds` a string ("4", as OpenAI's API types it) or a number; NaN, infinities, and more frames than the
    server makes are the request's 400 naming `seconds`, never a 500."""
    from paradiff.serve.jobs import video_seconds

    assert video_seconds("4") == 4.0 and video_seconds(2.5) == 2.5
    for bad in (float("nan"), float("inf"), "NaN", "Infinity", 0, -1, "four", True, None, [4]):
        with pytest.raises(RequestError) as caught:
            video_seconds(bad)
        assert (caught.value.status, caught.value.param) == (400, "seconds"), bad


def test_openais_standard_fields_are_accepted_and_a_missing_seed_is_drawn_on_rank_0():
    from paradiff.serve.app import with_seed

    body = {"prompt": "x", "quality": "hd", "style": "natural", "background": "transparent", "moderation": "low",
            "user": "u", "safety_identifier": "s", "size": "auto", "output_format": "webp", "output_compression": 70}
    request = parse_image_request(body, LIMITS)
    assert (request.width, request.height, request.output_format, request.output_compression) == (64, 64, "webp", 70)
    assert request.seed is None
    drawn = {with_seed(request).seed for _ in range(4)}
    assert len(drawn) == 4 and all(0 <= seed < 2**32 for seed in drawn)
    assert with_seed(parse_image_request({"prompt": "x", "seed": 3}, LIMITS)).seed == 3


def test_an_edit_form_is_read_and_its_uploads_are_bounded():
    """The openai client's multipart fields (numbers as text, one `image` or several `image[]`, loras[NAME]) read
    back; an upload that is no image, too many pixels, or a mask of another size is refused by name."""
    import io

    from PIL import Image

    from paradiff.serve.images import parse_edit_request

    def png(width: int, height: int) -> bytes:
        buffer = io.BytesIO()
        Image.new("RGB", (width, height)).save(buffer, format="PNG")
        return buffer.getvalue()

    edits = Limits(max_side=64, default_size=(64, 64), inputs=frozenset({"image", "mask", "strength"}),
                   adapters=(("lora0", 1.0),), pipeline="FluxInpaintPipeline")
    request = parse_edit_request([("prompt", "x"), ("image[]", png(32, 32)), ("image[]", png(16, 16)),
                                  ("n", "2"), ("seed", "5"), ("strength", "0.6"), ("loras[lora0]", "0.5"),
                                  ("size", "64x64"), ("quality", "")], edits)
    assert (request.n, request.seed, request.strength, request.loras, len(request.images)) == (
        2, 5, 0.6, (("lora0", 0.5),), 2)
    refused = [([("prompt", "x")], "image", "expected one image file"),
               ([("prompt", "x"), ("image", b"GIF89a junk")], "image", "not a readable image"),
               ([("prompt", "x"), ("image", png(200, 100))], "image", "20000 pixels; at most 16384"),
               ([("prompt", "x"), ("image", png(1, 1))], "image", "1x1; each side at least 16 pixels"),
               ([("prompt", "x"), ("image", png(32, 32)), ("mask", png(16, 16))], "mask", "as large as the"),
               ([("prompt", "x"), ("image", png(32, 32)), ("n", "two")], "n", "n: expected an integer"),
               ([("prompt", "x"), ("image", "text")], "image", "expected an image file")]
    for fields, param, words in refused:
        with pytest.raises(RequestError) as caught:
            parse_edit_request(fields, edits)
        assert (caught.value.status, caught.value.param) == (400, param) and words in str(caught.value), caught.value
        assert " object at 0x" not in str(caught.value), caught.value  # no Python object's repr
    # a phone's pictures: a JPEG stored sideways with its EXIF orientation (6: turn 90 degrees), checked as it is
    # shown (32 x 16: the mask of 32 x 16 fits it), and an MPO (a JPEG with more pictures after the first)
    exif = Image.Exif()
    exif[0x0112] = 6
    sideways, mpo = io.BytesIO(), io.BytesIO()
    Image.new("RGB", (16, 32), "red").save(sideways, format="JPEG", exif=exif)
    Image.new("RGB", (32, 16)).save(mpo, format="MPO", save_all=True, append_images=[Image.new("RGB", (32, 16))])
    request = parse_edit_request([("prompt", "x"), ("image", sideways.getvalue()), ("mask", png(32, 16))], edits)
    from paradiff.io.images import read_image

    assert read_image(request.images[0]).size == (32, 16)
    request = parse_edit_request([("prompt", "x"), ("image", mpo.getvalue()), ("stream", "true"),
                                  ("partial_images", "2")], edits)
    assert (len(request.images), request.stream, request.partial_images) == (1, True, 2)
    with pytest.raises(RequestError, match=r"takes no image; it serves POST /v1/images/generations") as caught:
        parse_edit_request([("prompt", "x"), ("image", png(32, 32))], LIMITS)
    assert caught.value.param == "image"


def test_the_wrong_endpoint_for_the_pipeline_is_refused():
    with pytest.raises(RequestError, match="makes images; use /v1/images/generations"):
        parse_image_request({"prompt": "x"}, LIMITS, kind="video")
    video = Limits(kind="video", accepts=frozenset({"num_frames"}), default_frames=9)
    request = parse_image_request({"prompt": "x", "frames": 5, "fps": 8}, video, kind="video")
    assert (request.frames, request.fps, request.kind) == (5, 8, "video")
    with pytest.raises(RequestError, match="makes videos; use /v1/videos"):
        parse_image_request({"prompt": "x"}, video)


def request(**fields):
    return parse_image_request({"prompt": "p", "seed": 0, **fields}, LIMITS)


def test_each_replica_takes_a_request_before_any_batch_grows():
    scheduler = Scheduler(max_batch=2)
    jobs = [scheduler.submit(request(seed=i)) for i in range(3)]
    round_ = scheduler.next_round(replicas=2, wait_s=0)
    assert [[item["id"] for item in batch] for batch in round_["batches"]] == [[jobs[0].id, jobs[2].id], [jobs[1].id]]
    assert [job.replica for job in jobs] == [0, 1, 0]


def test_only_compatible_requests_share_a_batch_and_the_batch_holds_max_batch_images():
    scheduler = Scheduler(max_batch=3)
    a = scheduler.submit(request(n=2))
    scheduler.submit(request(steps=4))       # other steps: not with a
    scheduler.submit(request(size="128x64"))  # other size: not with a
    d = scheduler.submit(request(n=2))        # 2 + 2 > 3 images
    e = scheduler.submit(request())
    first = scheduler.next_round(replicas=1, wait_s=0)["batches"][0]
    assert [item["id"] for item in first] == [a.id, e.id]
    assert first[0]["seeds"] == [0, 1]
    for item in first:
        scheduler.complete(item["id"], 200, {"files": []})
    assert [item["id"] for item in scheduler.next_round(1, 0)["batches"][0]] == [2]
    scheduler.complete(2, 200, {"files": []})
    assert [item["id"] for item in scheduler.next_round(1, 0)["batches"][0]] == [3]
    scheduler.complete(3, 200, {"files": []})
    assert [item["id"] for item in scheduler.next_round(1, 0)["batches"][0]] == [d.id]


def test_a_full_queue_a_deadline_and_a_drain():
    finished = []
    scheduler = Scheduler(max_queue=2, request_timeout_s=0.05, on_finish=finished.append)
    old = scheduler.submit(request())
    scheduler.submit(request())
    with pytest.raises(RequestError, match="queue is full") as caught:
        scheduler.submit(request())
    assert caught.value.status == 503
    time.sleep(0.1)
    assert scheduler.next_round(1, 0) == {"kind": "idle"}  # both expired in the queue, never run
    assert old.status == 504 and "--request-timeout of 0.05 s" in old.result
    assert len(finished) == 2
    scheduler.drain()
    with pytest.raises(RequestError, match="shutting down"):
        scheduler.submit(request())
    assert scheduler.next_round(1, 0) == {"kind": "stop"}


def test_a_request_is_answered_once_and_close_answers_everyone():
    finished = []
    scheduler = Scheduler(on_finish=finished.append)
    running = scheduler.submit(request())
    scheduler.next_round(1, 0)
    waiting = scheduler.submit(request())
    scheduler.time_out(running)  # the HTTP side gave up at the deadline
    scheduler.complete(running.id, 200, {"files": []})  # the late result is dropped
    assert running.status == 504
    scheduler.close("rank 1 died")
    assert waiting.status == 503 and "rank 1 died" in waiting.result
    assert [job.id for job in finished] == [running.id, waiting.id]
    with pytest.raises(RequestError, match="not serving: rank 1 died"):
        scheduler.submit(request())


def test_a_round_waits_for_a_request_without_polling():
    scheduler = Scheduler()
    threading.Timer(0.05, lambda: scheduler.submit(request())).start()
    started = time.monotonic()
    assert scheduler.next_round(1, wait_s=120)["kind"] == "work"
    assert time.monotonic() - started < 60  # woken by the request, long before its wait ran out (even under load)


def test_metrics_render_counters_and_a_cumulative_histogram():
    metrics = Metrics()
    metrics.request_done(200, 0.3, images=2, steps=16)
    metrics.request_done(200, 7.0, images=1, steps=8)
    metrics.request_done(400)
    metrics.memory({0: 10, 1: 20})
    text = metrics.render(queued=3, running=1, health="ready")
    for line in ['paradiff_requests_total{status="200"} 2', 'paradiff_requests_total{status="400"} 1',
                 "paradiff_queue_depth 3", "paradiff_images_total 3", "paradiff_steps_total 24",
                 'paradiff_request_latency_seconds_bucket{le="0.25"} 0',
                 'paradiff_request_latency_seconds_bucket{le="0.5"} 1',
                 'paradiff_request_latency_seconds_bucket{le="+Inf"} 2', "paradiff_request_latency_seconds_count 2",
                 'paradiff_rank_peak_memory_bytes{rank="1"} 20', "paradiff_up 1"]:
        assert line in text.splitlines()


def test_an_idle_round_waits_its_window_for_requests_sent_together():
    # a window far longer than the second request can take to come, even on a loaded host: the round ends as soon as
    # the two replicas have one image each (max_batch 1), so the test waits for that, not for a guessed delay
    scheduler = Scheduler(max_batch=1, window_s=120)
    first = scheduler.submit(request())
    threading.Timer(0.05, lambda: scheduler.submit(request(seed=1))).start()
    started = time.monotonic()
    round_ = scheduler.next_round(replicas=2, wait_s=0)
    assert time.monotonic() - started < 60  # ended by the second request, not by the window
    assert [len(batch) for batch in round_["batches"]] == [1, 1]  # the second joined: one per replica
    assert round_["batches"][0][0]["id"] == first.id
    full = Scheduler(max_batch=1, window_s=30)
    full.submit(request())
    started = time.monotonic()
    assert full.next_round(replicas=1, wait_s=0)["kind"] == "work"  # already as many images as fit: no wait
    assert time.monotonic() - started < 1


def test_a_request_picks_among_the_servers_adapters():
    limits = Limits(adapters=(("lora0", 1.0), ("lora1", 0.5)))
    assert parse_image_request({"prompt": "x"}, limits).loras == (("lora0", 1.0), ("lora1", 0.5))
    assert parse_image_request({"prompt": "x", "loras": {}}, limits).loras == ()
    assert parse_image_request({"prompt": "x", "loras": {"lora1": 2}}, limits).loras == (("lora1", 2.0),)
    with pytest.raises(RequestError, match=r"no adapter\(s\) \['style'\] on this server; adapters here: \['lora0'"):
        parse_image_request({"prompt": "x", "loras": {"style": 1}}, limits)
    with pytest.raises(RequestError, match="scale of 'lora0' must be a number"):
        parse_image_request({"prompt": "x", "loras": {"lora0": "high"}}, limits)
    scheduler = Scheduler(max_batch=4)
    scheduler.submit(parse_image_request({"prompt": "x", "seed": 0, "loras": {}}, limits))
    scheduler.submit(parse_image_request({"prompt": "x", "seed": 0}, limits))
    assert [len(batch) for batch in scheduler.next_round(1, 0)["batches"]] == [1]  # other adapters: no shared call


def test_integral_json_numbers_are_integers():
    request = parse_image_request({"prompt": "x", "n": 2.0, "steps": 3.0, "seed": 7.0}, LIMITS)
    assert (request.n, request.steps, request.seed) == (2, 3, 7) and isinstance(request.n, int)
    with pytest.raises(RequestError, match="n: expected an integer"):
        parse_image_request({"prompt": "x", "n": 1.5}, LIMITS)
    with pytest.raises(RequestError, match="user: expected a string"):
        parse_image_request({"prompt": "x", "user": 5}, LIMITS)


def test_the_header_guard_refuses_foreign_hosts_origins_and_bodies():
    guard = RequestGuard("127.0.0.1", 8000, ["proxy.internal"], ["https://app.example.com"])
    good = {"host": "127.0.0.1:8000", "content-type": "application/json; charset=utf-8"}
    for headers in (good, {**good, "host": "localhost:8000"}, {**good, "host": "[::1]:8000"},
                    {**good, "host": "proxy.internal"}, {**good, "origin": "https://app.example.com"},
                    {**good, "origin": "http://127.0.0.1:8000"}):
        guard.check_sender(headers)
        guard.check_body("POST", "/v1/images/generations", headers)
    for headers, status, words in [({**good, "host": "evil.example:8000"}, 403, "Host 'evil.example:8000'"),
                                   ({**good, "host": "127.0.0.1:9999"}, 403, "not served"),
                                   ({**good, "origin": "http://evil.example"}, 403, "--allow-origin"),
                                   ({**good, "origin": "null"}, 403, "Origin 'null'"),
                                   ({**good, "content-type": "text/plain"}, 415, "'text/plain'"),
                                   ({"host": "127.0.0.1:8000"}, 415, "'missing'")]:
        with pytest.raises(RequestError, match=words) as caught:
            guard.check_sender(headers)
            guard.check_body("POST", "/v1/images/generations", headers)
        assert caught.value.status == status
    guard.check_body("GET", "/health", {"host": "127.0.0.1:8000"})  # no body: no Content-Type needed
    anywhere = RequestGuard("0.0.0.0", 8000, None, None)  # not on loopback: no Host check (the Origin one stays)
    anywhere.check_sender({"host": "gpu-box.example:8000"})
    with pytest.raises(RequestError, match="not allowed"):
        anywhere.check_sender({"host": "gpu-box.example:8000", "origin": "http://evil.example"})


def test_a_client_gets_one_line_of_an_internal_error_without_paths():
    cause = ("rank 1: FileNotFoundError: [Errno 2] No such file or directory: '/home/me/models/flux/vae/x.bin'\n"
             '  File "/usr/lib/python3.11/site-packages/diffusers/x.py", line 3')
    assert public_message(cause) == "rank 1: FileNotFoundError: [Errno 2] No such file or directory: '.../x.bin'"
    assert public_message("rank 1: RuntimeError: injected fault on rank 1") == \
        "rank 1: RuntimeError: injected fault on rank 1"
    assert len(public_message("x" * 5000)) == 300


def test_the_limits_default_to_twice_what_the_server_was_started_for():
    from paradiff.cli.args import build_parser, check_args
    from paradiff.cli.serve import settings_of
    from paradiff.serve.app import server_max_frames, server_max_side, server_max_steps

    def serve_args(*argv: str):
        args = build_parser().parse_args(["serve", *argv])
        check_args(args)
        return settings_of(args)

    demo = serve_args()
    assert (server_max_side(demo), server_max_steps(demo), demo.max_n) == (128, 2 * demo.steps, 4)
    video = settings_of(build_parser().parse_args(["serve", "--frames", "9", "--width", "104", "--height", "64"]))
    assert (server_max_side(video), server_max_frames(video)) == (208, 18)
    given = serve_args("--max-side", "1024", "--max-steps", "50")
    assert (server_max_side(given), server_max_steps(given)) == (1024, 50)
    assert "1024x1024" not in "".join(f"{side}x{side}" for side in range(16, server_max_side(demo) + 1, 16))


def test_an_error_no_endpoint_answers_is_a_counted_json_500_and_one_console_line(tmp_path, capsys):
    import asyncio
    import json

    import httpx

    from paradiff.cli.args import build_parser
    from paradiff.cli.serve import settings_of
    from paradiff.serve.app import Frontend, HttpGuard, build_app

    args = build_parser().parse_args(["serve", "--out", str(tmp_path)])
    frontend = Frontend(settings_of(args))
    app = build_app(frontend)

    @app.get("/v1/broken")
    async def broken():
        raise RuntimeError("internal detail at /home/me/secret.py")

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=HttpGuard(app, frontend))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            return await client.get("/v1/broken")

    answer = asyncio.run(ask())
    frontend.stop()
    assert answer.status_code == 500 and answer.headers["content-type"] == "application/json"
    assert "secret" not in answer.text and answer.json()["error"]["type"] == "server_error"
    assert 'paradiff_requests_total{status="500"} 1' in frontend.render_metrics()
    logged = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert [(entry["status"], entry["request"]) for entry in logged] == [(500, "GET /v1/broken")]
    console = capsys.readouterr().err
    assert console.strip().splitlines() == [
        "paradiff serve: internal error on GET /v1/broken: RuntimeError: internal detail at /home/me/secret.py"]


def test_an_allowed_origin_gets_cors_answers_and_its_preflight_needs_no_key(tmp_path):
    import asyncio

    import httpx

    from paradiff.cli.args import build_parser
    from paradiff.cli.serve import settings_of
    from paradiff.serve.app import Frontend, HttpGuard, build_app

    args = build_parser().parse_args(["serve", "--out", str(tmp_path), "--api-key", "k", "--allow-origin",
                                      "https://app.example.com", "--allow-host", "proxy.internal"])
    frontend = Frontend(settings_of(args))
    allowed = {"Origin": "https://app.example.com"}

    async def ask() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=HttpGuard(build_app(frontend), frontend))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            preflight = {**allowed, "Access-Control-Request-Method": "POST",
                         "Access-Control-Request-Headers": "authorization, content-type"}
            return [await client.options("/v1/images/generations", headers=preflight),
                    await client.get("/v1/models", headers={**allowed, "Authorization": "Bearer k"}),
                    await client.get("/v1/models", headers={"Origin": "https://other.example",
                                                            "Authorization": "Bearer k"}),
                    await client.get("/health", headers={"Host": "proxy.internal"}),
                    await client.options("/v1/images/generations", headers={"Origin": "https://other.example",
                                                                            "Access-Control-Request-Method": "POST"})]

    preflight, models, foreign, proxied, foreign_preflight = asyncio.run(ask())
    frontend.stop()
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example.com"
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "https://app.example.com"
    assert foreign.status_code == 403 and "access-control-allow-origin" not in foreign.headers
    assert proxied.status_code == 503 and proxied.json() == {"status": "loading"}  # served; nothing loaded here
    assert foreign_preflight.status_code == 403


@pytest.mark.parametrize("argv, words", [
    (["--allow-origin", "app.example.com"], "--allow-origin 'app.example.com': expected a page origin"),
    (["--allow-origin", "https://app.example.com/page"], "SCHEME://HOST[:PORT] with no path"),
    (["--read-timeout", "0"], "--read-timeout 0.0: expected seconds above 0"),
    (["--steps", "9", "--max-steps", "8"], "--steps 9 is above --max-steps 8"),
    (["--width", "256", "--max-side", "128"], "above --max-side 128"),
])
def test_the_server_flags_are_checked_before_anything_starts(argv, words):
    from paradiff.cli.args import CliError, build_parser
    from paradiff.cli.serve import check_serve_args

    with pytest.raises(CliError, match=words.replace("[", r"\[").replace("(", r"\(")):
        check_serve_args(build_parser().parse_args(["serve", *argv]))


def test_the_channel_reads_results_once_and_refuses_what_is_not_its_json(tmp_path):
    """Results cross the store as raw bytes plus checked JSON and are deleted when read; a planted pickle is refused
    without being unpickled."""
    import pickle

    import torch.distributed as dist

    from paradiff.distributed.store import StoreValueError
    from paradiff.serve.ranks import Channel

    store = dist.HashStore()
    channel = Channel(store, 0, 1)
    empty = store.num_keys()
    for item_id in range(20):
        channel.put_result(item_id, [{"mime": "image/png", "data": b"\x89PNG" + bytes([item_id])}],
                           {"replica": 0, "started": 1.0, "finished": 2.0})
        result = channel.take_result(item_id)
        assert result["files"] == [{"mime": "image/png", "frames": None, "data": b"\x89PNG" + bytes([item_id])}]
    assert store.num_keys() == empty and channel.take_result(3) is None

    class Planted:
        def __reduce__(self):
            return (open, (str(tmp_path / "planted"), "w"))

    store.set(channel.key("result", 7), pickle.dumps(Planted()))
    with pytest.raises(StoreValueError, match="not JSON"):
        channel.take_result(7)
    store.set(channel.key("summary"), '{"rank": "0"}')
    with pytest.raises(StoreValueError, match="expected an object with fields"):
        channel.get({"rank": int, "seconds": float}, "summary")
    assert not (tmp_path / "planted").exists()
    assert channel.settle("request", "verdict") == "request" and channel.settle("fault", "verdict") == "request"


def test_a_request_whose_client_left_is_answered_and_its_work_is_marked_for_cancellation():
    scheduler = Scheduler(max_queue=4, max_batch=1)
    waiting, running = scheduler.submit(request()), scheduler.submit(request())
    assert scheduler.next_round(1)["batches"] == [[waiting.work_item()]]
    scheduler.cancel(running, 499, "the client closed the connection")  # still queued: it leaves the queue
    assert running.status == 499 and scheduler.depth() == (0, 1) and scheduler.answered_running() == []
    scheduler.time_out(waiting)  # running: answered 504, its work no longer wanted
    assert waiting.status == 504 and scheduler.answered_running() == [waiting.id]
    scheduler.complete(waiting.id, 200, "late")
    assert waiting.status == 504 and scheduler.answered_running() == []


def test_the_api_key_comes_from_a_file_so_it_is_not_on_the_command_line(tmp_path):
    from paradiff.cli.args import CliError, build_parser
    from paradiff.cli.serve import check_serve_args

    SIZE = ["--steps", "4", "--width", "64", "--height", "64"]  # what check_args fills in before
    (tmp_path / "key").write_text("s3cret\n")
    args = build_parser().parse_args(["serve", *SIZE, "--api-key-file", str(tmp_path / "key")])
    check_serve_args(args)
    assert args.api_key == "s3cret"
    (tmp_path / "empty").write_text("\n")
    for argv, words in ((["--api-key-file", str(tmp_path / "empty")], "first line is empty"),
                        (["--api-key-file", str(tmp_path / "missing")], "cannot read it"),
                        (["--api-key", "k", "--api-key-file", str(tmp_path / "key")], "give one of them")):
        with pytest.raises(CliError, match=words):
            check_serve_args(build_parser().parse_args(["serve", *SIZE, *argv]))


def simulated_waits(policy: str) -> tuple[dict[str, list[float]], list[int]]:
    """One replica on a fake clock: a burst of three long requests every 450 s (131 s each) and a short one
    (0.8 s) every 10 s, for 1800 s. Returns each kind's waits (accepted -> started) and the order the long ones
    started in."""
    clock = [0.0]
    limits = Limits(max_n=1, max_steps=20, max_side=256, default_size=(64, 64), default_steps=2,
                    accepts=LIMITS.accepts)
    scheduler = Scheduler(max_queue=1000, request_timeout_s=1e9, policy=policy, clock=lambda: clock[0])
    rate = 1e-4  # seconds per unit of cost: a long one 256*256*20 units
    arrivals = sorted([(t, "long") for burst in range(0, 1800, 450) for t in (burst,) * 3]
                      + [(t + 5.0, "short") for t in range(0, 1800, 10)])
    kinds, waits, long_order = {}, {"long": [], "short": []}, []
    busy_until, running = None, None
    while arrivals or running or scheduler.depth()[0]:
        while arrivals and arrivals[0][0] <= clock[0]:
            _, kind = arrivals.pop(0)
            body = ({"prompt": kind, "size": "256x256", "steps": 20, "seed": 0} if kind == "long"
                    else {"prompt": kind, "seed": 0})
            job = scheduler.submit(parse_image_request(body, limits))
            kinds[job.id] = kind
        if running is not None and clock[0] >= busy_until:
            scheduler.complete(running.id, 200, {"files": []}, seconds=running.cost * rate)
            running = None
        if running is None:
            round_ = scheduler.next_round([0], wait_s=0)
            if round_["kind"] == "work":
                item, = round_["batches"][0]
                running = scheduler._running[item["id"]]
                waits[kinds[running.id]].append(clock[0] - running.accepted)
                if kinds[running.id] == "long":
                    long_order.append(running.id)
                busy_until = clock[0] + running.cost * rate
        events = ([busy_until] if running else []) + ([arrivals[0][0]] if arrivals else [])
        if events:
            clock[0] = min(events)
    return waits, long_order


def test_the_fair_queue_bounds_short_waits_under_a_stream_of_long_requests():
    """p95 wait of short requests: under "fair" at most one long request's run (the one running when it came);
    under "fifo" behind whole bursts. Long requests still run, in their order of arrival."""
    import numpy as np

    long_run = 256 * 256 * 20 * 1e-4
    fair, fair_order = simulated_waits("fair")
    fifo, fifo_order = simulated_waits("fifo")
    assert len(fair["short"]) == len(fifo["short"]) == 180 and len(fair["long"]) == 12
    fair_p95, fifo_p95 = (float(np.percentile(w["short"], 95)) for w in (fair, fifo))
    assert fair_p95 <= long_run + 5, fair_p95
    assert fifo_p95 > 2 * long_run, fifo_p95
    assert fair_order == sorted(fair_order) and fifo_order == sorted(fifo_order)


def test_expected_wait_refuses_past_max_wait_with_retry_after_and_metrics_show_the_queue():
    clock = [0.0]
    scheduler = Scheduler(max_batch=1, policy="fifo", max_wait_s=10, clock=lambda: clock[0])
    scheduler.replicas = 2
    first = scheduler.submit(request(size="128x128", steps=10))  # 163840 units
    assert scheduler.expected_wait() is None  # no rate learnt yet: nobody is refused
    scheduler.next_round([0], wait_s=0)
    clock[0] = 4.0
    scheduler.complete(first.id, 200, {"files": []}, seconds=4.0)
    assert scheduler.seconds_per_cost == pytest.approx(4.0 / 163840)
    for _ in range(4):  # 4 x 4 s queued over 2 replicas: 8 s
        scheduler.submit(request(size="128x128", steps=10))
    assert scheduler.expected_wait() == pytest.approx(8.0)
    assert scheduler.queued_cost() == (4 * 163840.0, 0.0)
    for _ in range(2):  # 8 s, then 10 s expected: not over
        scheduler.submit(request(size="128x128", steps=10))
    with pytest.raises(RequestError, match="expected wait is 12.0 s, over the server's --max-wait of 10 s") as caught:
        scheduler.submit(request(size="128x128", steps=10))
    assert caught.value.status == 503 and caught.value.retry_after == 2
    metrics = Metrics()
    text = metrics.render(6, 0, "ready", queued_cost=5 * 163840.0, expected_wait=10.0,
                          replicas={0: "ready", 1: "loading"}, replica_running={0: 0, 1: 0})
    for line in ["paradiff_queue_cost 819200", "paradiff_expected_wait_seconds 10",
                 'paradiff_replica_up{replica="0"} 1', 'paradiff_replica_up{replica="1"} 0']:
        assert line in text.splitlines(), text


def test_free_replicas_take_work_alone():
    """A replica that is free takes work at once, whatever the others run (independent replicas)."""
    scheduler = Scheduler(max_batch=1)
    jobs = [scheduler.submit(request(seed=i)) for i in range(3)]
    first = scheduler.next_round([1], wait_s=0)
    assert [[item["id"] for item in batch] for batch in first["batches"]] == [[jobs[0].id]]
    assert jobs[0].replica == 1
    second = scheduler.next_round([0, 2], wait_s=0)
    assert [[item["id"] for item in batch] for batch in second["batches"]] == [[jobs[1].id], [jobs[2].id]]
    assert [job.replica for job in jobs] == [1, 0, 2]


def test_ray_meshes_get_the_servers_flags_without_the_ray_and_address_ones():
    from paradiff.cli.serve import mesh_argv

    argv = ["--debug", "serve", "model", "--ray", "--tp", "2", "--ray-replicas", "1:3", "--host", "0.0.0.0",
            "--port=9000", "--ray-route", "adapter", "--out", "o", "--steps", "4", "--ray-address=head:6379",
            "--ray-ingress", "haproxy", "--jobs-db", "j.db"]
    assert mesh_argv(argv) == ["model", "--tp", "2", "--steps", "4"]


def test_haproxy_ingress_is_refused_on_a_cluster_paradiff_did_not_start(capsys, monkeypatch):
    """Ray reads its HAProxy mode from its processes' environment as they start: only the local cluster `paradiff
    serve --ray` starts can have it; with --ray-address or RAY_ADDRESS the flag is refused by name before Ray
    starts (no cluster here)."""
    pytest.importorskip("ray")
    from paradiff.cli import main
    from paradiff.serve.ray import check_ingress

    assert main(["serve", "--ray", "--ray-ingress", "haproxy", "--ray-address", "head:6379"]) == 2
    said = capsys.readouterr().err
    assert "--ray-ingress haproxy with the Ray cluster at 'head:6379'" in said and "RAY_SERVE_ENABLE_HA_PROXY=1" in said
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    with pytest.raises(ValueError, match="the Ray cluster at 'auto'"):
        check_ingress("haproxy", None)
    check_ingress("proxy", None)  # Ray's proxy: any cluster
    with pytest.raises(ValueError, match=r"--ray-ingress 'nginx': expected one of \['proxy', 'haproxy'\]"):
        check_ingress("nginx", None)


def test_over_max_wait_is_a_503_with_retry_after_and_a_reloading_replica_is_degraded(tmp_path):
    """In process, no rank: the HTTP answers of the queue's refusal and of /health per replica."""
    import asyncio

    import httpx

    from paradiff.cli.args import build_parser
    from paradiff.cli.serve import settings_of
    from paradiff.serve.app import Frontend, HttpGuard, build_app

    args = build_parser().parse_args(["serve", "--out", str(tmp_path), "--max-wait", "1", "--dp", "2",
                                                "--steps", "8"])
    frontend = Frontend(settings_of(args))
    frontend.replica_states = {0: "loading", 1: "loading"}
    info = {"kind": "image", "accepts": ["prompt", "num_inference_steps"], "replicas": 2, "adapters": []}
    frontend.replica_state(0, "ready")
    frontend.replica_ready(0, info, [{"rank": 0, "memory": 1}], 0)
    assert frontend.health == "loading"  # until every replica has loaded once
    frontend.replica_state(1, "ready")
    frontend.replica_ready(1, info, [{"rank": 1, "memory": 1}], 0)
    app = HttpGuard(build_app(frontend), frontend)
    frontend.scheduler.seconds_per_cost = 1e-3  # 64 x 64 x 8 steps: 33 s a request
    frontend.scheduler.submit(request())

    async def ask(method: str, path: str, **kwargs) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000") as c:
            return await c.request(method, path, **kwargs)

    answer = asyncio.run(ask("POST", "/v1/images/generations", json={"prompt": "x"}))
    assert answer.status_code == 503 and answer.headers["retry-after"] == "16", answer.text  # 16.4 s over 1 s
    assert "over the server's --max-wait of 1 s" in answer.json()["error"]["message"]
    assert asyncio.run(ask("GET", "/health")).json() == {"status": "ready"}
    frontend.replica_state(1, "loading")  # a fault: replica 1 loads again
    degraded = asyncio.run(ask("GET", "/health"))
    assert degraded.status_code == 200 and degraded.json() == {"status": "degraded"}
    assert 'paradiff_replica_up{replica="1"} 0' in frontend.render_metrics()
    frontend.stop()


def test_every_error_is_in_openais_shape_with_a_string_code_and_the_field_at_fault(tmp_path):
    """Errors of the request checks, the header checks (safety.py), the key, and FastAPI's own 404 / 405: OpenAI's
    {"error": {"message", "type", "param", "code"}}, `code` a string, `param` the field at fault."""
    import asyncio

    import httpx

    from paradiff.cli.args import build_parser
    from paradiff.cli.serve import settings_of
    from paradiff.serve.app import Frontend, HttpGuard, build_app

    args = build_parser().parse_args(["serve", "--out", str(tmp_path), "--api-key", "k"])
    frontend = Frontend(settings_of(args))
    frontend.limits = LIMITS
    frontend.replica_state(0, "ready")  # health is computed: every replica loaded once and serving
    frontend._loaded.add(0)
    key = {"Authorization": "Bearer k"}

    async def ask() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=HttpGuard(build_app(frontend), frontend))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            post = "/v1/images/generations"
            return [await client.post(post, json={"prompt": "x", "size": "50x64"}, headers=key),
                    await client.post(post, json={"prompt": "x", "colour": 1}, headers=key),
                    await client.post(post, json={"prompt": "x", "model": "other"}, headers=key),
                    await client.get("/v1/nothing", headers=key),
                    await client.delete(post, headers=key),
                    await client.post(post, json={"prompt": "x"}),
                    await client.post(post, content=b"{}", headers={**key, "Content-Type": "text/plain"}),
                    await client.get("/v1/models", headers={**key, "Origin": "https://other.example"})]

    answers = asyncio.run(ask())
    frontend.stop()
    shapes = [(answer.status_code, answer.json()["error"]["param"], answer.json()["error"]["code"],
               answer.json()["error"]["type"]) for answer in answers]
    assert shapes == [(400, "size", "invalid_request", "invalid_request_error"),
                      (400, "colour", "unknown_parameter", "invalid_request_error"),
                      (404, "model", "model_not_found", "not_found_error"),
                      (404, None, "not_found", "not_found_error"),
                      (405, None, "method_not_allowed", "invalid_request_error"),
                      (401, None, "invalid_api_key", "authentication_error"),
                      (415, None, "unsupported_media_type", "invalid_request_error"),
                      (403, None, "forbidden", "permission_error")]
    assert all(set(answer.json()["error"]) == {"message", "type", "param", "code"} for answer in answers)


def test_a_library_user_serves_from_typed_settings_without_a_parser(tmp_path):
    """ServeSettings built directly, no argparse: each bad value refused when built, naming the setting and what is
    valid; the limits a server was not given derived from it; a Frontend started from it listens on 127.0.0.1 and
    answers with those settings."""
    import httpx

    from paradiff.api.load_spec import LoadSpec
    from paradiff.distributed.spawn import free_port
    from paradiff.errors import ServeSettingsError
    from paradiff.serve.app import Frontend
    from paradiff.serve.settings import ServeSettings

    spec = LoadSpec("models/wan")
    for bad, words in (({"batch_window": 11}, "batch_window 11: expected seconds from 0 to 10"),
                       ({"steps": 9, "max_steps": 8}, "steps 9 is above max_steps 8"),
                       ({"schedule": "lifo"}, "schedule 'lifo': expected one of fair, fifo"),
                       ({"port": 0}, "port 0: expected a TCP port from 1 to 65535"),
                       ({"lora_modules": ["style"]}, "lora_modules style: expected NAME=PATH"),
                       ({"allow_origin": ["app.example.com"]}, "allow_origin 'app.example.com': expected a page "
                                                               "origin")):
        with pytest.raises(ServeSettingsError) as caught:
            ServeSettings(spec, **bad)
        assert str(caught.value).startswith(words) and caught.value.field == next(iter(bad))
    extra = ServeSettings(spec, guidance_scale=3.5, extra_call_kwargs={"max_sequence_length": 20})
    assert extra.call_kwargs() == {"height": 64, "width": 64, "num_inference_steps": 4, "output_type": "np",
                                   "guidance_scale": 3.5, "max_sequence_length": 20}
    for attempt in range(5):  # a free port may be taken by another process before the server binds it
        settings = ServeSettings(spec, port=free_port(), out=str(tmp_path), api_key="k", width=96, steps=6, max_n=2)
        try:
            frontend = Frontend(settings).start()
            break
        except RuntimeError:
            assert attempt < 4
    assert (settings.served_name, settings.limit_side, settings.limit_steps, settings.limit_frames) == \
        ("wan", 192, 12, 257)
    try:
        frontend.replica_state(0, "ready")
        frontend.replica_ready(0, {"kind": "image", "accepts": ["prompt", "num_inference_steps"], "replicas": 1,
                                   "adapters": []}, [{"rank": 0, "memory": 1}], 0)
        with httpx.Client(base_url=f"http://127.0.0.1:{settings.port}", timeout=30) as client:
            health, refused = client.get("/health"), client.get("/v1/info")
            info = client.get("/v1/info", headers={"Authorization": "Bearer k"})
    finally:
        frontend.stop()
    assert health.json() == {"status": "ready"} and refused.status_code == 401
    pipeline = info.json()["pipeline"]
    assert (pipeline["model"], pipeline["size"], pipeline["steps"], pipeline["max_steps"], pipeline["max_side"],
            pipeline["max_n"]) == ("wan", "96x64", 6, 12, 192, 2)


class FaultFrontend:
    """What the dispatcher tells the HTTP side about a replica's fault, recorded."""

    def __init__(self) -> None:
        self.replica_states, self.closing, self.faults, self.jobs_looks = {}, False, [], 0

    def feed_jobs(self):
        self.jobs_looks += 1

    def replica_state(self, index, state):
        self.replica_states[index] = state

    def replica_ready(self, index, info, ranks, generation):
        pass

    def replica_fault(self, index, replicas, cause, decision, channel=None, items=None):
        self.faults.append((cause, decision))

    def fail_batch(self, items, channel, cause):
        pass

    def fail(self, cause):
        self.closing = True


@pytest.mark.parametrize("rank_0_alive_at", [12.0, None])
def test_a_dead_rank_is_named_alone_while_rank_0s_own_loop_is_slow_to_say_it_is_alive(rank_0_alive_at):
    """tp2 on one machine, rank 1's process gone. Rank 0's loop runs in the dispatcher's own process: after a fault
    it is waited for like any rank on this machine (while its process runs, up to the collective timeout), not
    ALIVE_WAIT_S only: saying it is alive later than that (a loaded machine), it is not named among the dead. Saying
    it never, it is, once the collective timeout has passed. On a fake clock: 3 s a reading."""
    import os
    import socket
    import subprocess

    import torch.distributed as dist

    from paradiff.serve.dispatch import Dispatcher
    from paradiff.serve.ranks import ALIVE_WAIT_S

    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid runs nothing
    store, frontend, now = dist.HashStore(), FaultFrontend(), [0.0]
    dispatcher = Dispatcher(store, frontend, replicas=1, size=2, timeout_s=15.0, clock=lambda: tick())
    replica = dispatcher.replicas[0]

    def tick() -> float:
        now[0] += 3.0
        if rank_0_alive_at is not None and now[0] >= rank_0_alive_at:
            replica.channel.put(True, "alive", 0)  # rank 0's loop left its failed collective
        return now[0]

    # the fault's wait starts at the first reading (3 s): ALIVE_WAIT_S is past at the third (9 s), rank 0 alive later
    assert rank_0_alive_at is None or rank_0_alive_at > 3.0 + ALIVE_WAIT_S + 3.0
    host = socket.gethostname()
    replica.channel.put({"info": {}, "ranks": [{"rank": 0, "pid": os.getpid(), "host": host},
                                               {"rank": 1, "pid": dead.pid, "host": host}]}, "ready")
    dispatcher._look_at(replica)  # loading -> ready
    assert frontend.replica_states == {0: "ready"} and frontend.faults == []
    dispatcher._look_at(replica)  # rank 1's process is seen gone: the fault
    (cause, decision), = frontend.faults
    named = "[1]" if rank_0_alive_at is not None else "[0, 1]"
    assert cause == f"rank(s) {named} stopped answering (the process died or was killed)" and decision == "stop"
    assert now[0] >= (rank_0_alive_at or 3.0 + 15.0)  # rank 0 waited for: until it said alive, or the timeout
    assert frontend.replica_states == {0: "failed"} and dispatcher.failed


class IdleFrontend(FaultFrontend):
    """No request comes: the scheduler's wait is recorded (and not waited out); the dispatcher stops after 20."""

    def __init__(self) -> None:
        super().__init__()
        self.waits, self.scheduler = [], self
        self.stopped = threading.Event()

    def to_cancel(self):
        return []

    def next_round(self, replicas, wait_s):
        self.waits.append(wait_s)
        if len(self.waits) == 20:
            self.stopped.set()
        return {"kind": "idle"}


class CountingStore:
    """A store that counts its check() calls: what an idle server's loops cost."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.store, self.checks = dist.HashStore(), 0

    def check(self, keys):
        self.checks += 1
        return self.store.check(keys)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_an_idle_dispatcher_waits_for_requests_instead_of_polling_the_store():
    """dp2, both replicas free: each round waits on the scheduler (a request wakes it at once) for 50 ms, not 5 ms,
    and reads each replica's fault key once: 40 store reads a second per replica, not 200 (12 % of a core idle); the
    video jobs left unclaimed in the store are looked for once a second, not every round."""
    import os
    import socket

    from paradiff.serve.dispatch import DISPATCH_IDLE_WAIT_S, JOBS_LOOK_S, Dispatcher

    store, frontend = CountingStore(), IdleFrontend()
    dispatcher = Dispatcher(store, frontend, replicas=2, size=1, timeout_s=15.0)
    host = socket.gethostname()
    for replica in dispatcher.replicas:
        replica.channel.put({"info": {}, "ranks": [{"rank": replica.first_rank, "pid": os.getpid(), "host": host}]},
                            "ready")
        dispatcher._look_at(replica)  # loading -> ready
    assert frontend.replica_states == {0: "ready", 1: "ready"}
    before, started = store.checks, time.monotonic()
    dispatcher.start()
    assert frontend.stopped.wait(timeout=60), frontend.waits
    dispatcher.stop()
    took = time.monotonic() - started
    assert 1 <= frontend.jobs_looks <= 1 + took / JOBS_LOOK_S, (frontend.jobs_looks, took)  # unclaimed video jobs
    rounds = len(frontend.waits)
    assert frontend.waits[:20] == [DISPATCH_IDLE_WAIT_S] * 20 and DISPATCH_IDLE_WAIT_S >= 0.05
    assert store.checks - before <= 2 * rounds + 2, (store.checks - before, rounds)  # a fault key per replica a round


def test_an_idle_replicas_first_rank_polls_for_work_at_most_every_20_ms():
    """An idle round (IDLE_WAIT_S, no work coming) looks at the store about 14 times, backing off from 1 ms to 20 ms,
    not 22 (10 ms): the idle server's largest cost. A bound, so a loaded machine (longer sleeps) passes too."""
    from paradiff.serve.ranks import IDLE_WAIT_S, POLL_S, Channel

    store = CountingStore()
    channel = Channel(store, 0, 2, scope="r0")
    assert not channel.wait_for("work", 1, deadline=time.monotonic() + IDLE_WAIT_S)
    assert POLL_S == (0.001, 0.02) and store.checks <= 16, store.checks


def test_rank_0_counts_a_group_sigterm_and_the_launchers_drain_signal_as_one(monkeypatch, capsys):
    """A SIGTERM to the process group reaches rank 0 itself and, through the launcher, as the drain signal, in either
    order (Python runs pending handlers by signal number: SIGUSR1 before SIGTERM): one drain; a second SIGTERM, or
    the launcher's stop signal, stops at once."""
    import signal
    from types import SimpleNamespace

    from paradiff.distributed.spawn import DRAIN_SIGNAL, STOP_SIGNAL
    from paradiff.serve import ranks

    numbers = (signal.SIGTERM, signal.SIGINT, DRAIN_SIGNAL, STOP_SIGNAL)
    saved = {number: signal.getsignal(number) for number in numbers}

    class Stopped(Exception):
        pass

    def stop(code):
        raise Stopped(code)

    monkeypatch.setattr(ranks.os, "_exit", stop)
    try:
        for first, second in ((DRAIN_SIGNAL, signal.SIGTERM), (signal.SIGTERM, DRAIN_SIGNAL)):
            drains = []
            frontend = SimpleNamespace(scheduler=SimpleNamespace(draining=False))
            frontend.drain = lambda: (drains.append(1), setattr(frontend.scheduler, "draining", True))
            ranks._handle_signals(frontend)
            signal.raise_signal(first)
            signal.raise_signal(second)
            assert drains == [1]
            with pytest.raises(Stopped):
                signal.raise_signal(signal.SIGTERM)
        ranks._handle_signals(SimpleNamespace(scheduler=SimpleNamespace(draining=False), drain=lambda: None))
        with pytest.raises(Stopped):
            signal.raise_signal(STOP_SIGNAL)
    finally:
        for number, handler in saved.items():
            signal.signal(number, handler)
    assert capsys.readouterr().err.count("taking no new ones") == 2  # one line a drain


def test_the_adapter_registry_refuses_bad_names_paths_and_headers_by_field(tmp_path):
    """What a client may send to /v1/load_lora_adapter and /v1/unload_lora_adapter: every bad value a 4xx naming
    lora_path or lora_name, never an OS error's 500; a `model` naming an adapter selects it in a JSON body and in an
    edit's form."""
    import json
    import shutil
    import struct

    from paradiff.demo import LORA_FILE
    from paradiff.serve.adapters import AdapterRegistry

    root = tmp_path / "loras"
    root.mkdir()
    shutil.copy(LORA_FILE, root / "good.safetensors")
    (root / "loop1.safetensors").symlink_to(root / "loop2.safetensors")
    (root / "loop2.safetensors").symlink_to(root / "loop1.safetensors")
    for name, header in (("empty-shape", {"a.lora_A.weight": {"dtype": "F32", "shape": [], "data_offsets": [0, 0]}}),
                         ("number", {"a.lora_A.weight": 5}), ("list", [1, 2])):
        data = json.dumps(header).encode()
        (root / f"{name}.safetensors").write_bytes(struct.pack("<Q", len(data)) + data)
    registry = AdapterRegistry("base", None, str(root), True, 64)
    assert registry.add("good", "good.safetensors")["sha256"]
    cases = [("x", "a\0b.safetensors", 400, "lora_path"), ("x", "a" * 5000, 400, "lora_path"),
             ("x", "a" * 300 + ".safetensors", 400, "lora_path"), ("x", "loop1.safetensors", 400, "lora_path"),
             ("x", "~nosuchuser123/x.safetensors", 404, "lora_path"), ("x", "/etc/passwd", 403, "lora_path"),
             ("x", "empty-shape.safetensors", 400, "lora_path"), ("x", "number.safetensors", 400, "lora_path"),
             ("x", "list.safetensors", 400, "lora_path"), ("x", 7, 400, "lora_path"),
             ("", "good.safetensors", 400, "lora_name"), ([], "good.safetensors", 400, "lora_name"),
             ("base", "good.safetensors", 400, "lora_name"), ("good", "good.safetensors", 400, "lora_name")]
    for name, path, status, param in cases:
        with pytest.raises(RequestError) as caught:
            registry.add(name, path)
        assert (caught.value.status, caught.value.param) == (status, param), (name, path[:40], caught.value)
        assert len(str(caught.value)) < 400, str(caught.value)
    for name in ([], {}, None, "absent"):
        with pytest.raises(RequestError) as caught:
            registry.remove(name)
        assert caught.value.param == "lora_name" and caught.value.status in (400, 404), name
    body, adapter = registry.resolve_model({"prompt": "x", "model": "good"})
    assert body["model"] == "base" and adapter["name"] == "good"
    form, adapter = registry.resolve_model([("prompt", "x"), ("model", "good"), ("image", b"...")])
    assert form == [("prompt", "x"), ("model", "base"), ("image", b"...")] and adapter["name"] == "good"
    assert registry.resolve_model([("prompt", "x")]) == ([("prompt", "x")], None)
