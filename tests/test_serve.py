"""`paradiff serve` as users run it: a real server (the command, its launcher and ranks) on 127.0.0.1, a real HTTP
client, bounded waits. Outputs are compared with `paradiff generate` run single-process."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from paradiff_testkit.browser import CHROMIUM, launch_chromium
from paradiff_testkit.serve import ServerProcess, images_of
from paradiff_testkit import command
from paradiff_testkit.beside import beside

pytestmark = pytest.mark.slow

PROMPTS = ["a red circle on a blue background, top left", "a yellow square on a green background, bottom right"]
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
READ_TIMEOUT_S = 4
EDIT_SEED = 7


pngs = images_of


def metric(server: ServerProcess, name: str, headers: dict | None = None) -> dict[str, float]:
    """The samples of one /metrics family: {labels text or "": value}."""
    found = {}
    for line in server.client.get("/metrics", headers=headers).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line[len(name):].rpartition(" ")
            found[labels] = float(value)
    return found


def wait_for_metric(server: ServerProcess, name: str, value: float, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(server, name).get("") != value:
        assert time.monotonic() < deadline, (name, metric(server, name), server.text()[-2000:])
        time.sleep(0.02)


def pixels(png: bytes) -> np.ndarray:
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)), dtype=np.int16)


def assert_same_picture(png: bytes, reference: bytes) -> None:
    """The picture of `reference` up to rounding: a split run sums in another order than one process (about 1e-7
    relative here), which can move a value across a rounding boundary of the 8-bit PNG, so a few values may differ
    by one level (on one machine tp2 x ulysses2 flipped 1 of 12288); anything else is a different picture."""
    got, expected = pixels(png), pixels(reference)
    assert got.shape == expected.shape
    difference = np.abs(got - expected)
    assert difference.max() <= 1 and (difference > 0).mean() <= 0.005, (difference.max(), (difference > 0).sum())


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[tuple[str, int, int], bytes]:
    """(prompt, seed, steps) -> PNG bytes: at 4 steps from `paradiff generate` run single-process (the answers must
    be these pictures); at 2 and 1 steps from diffusers' own pipeline in this process (for batched answers, compared
    within one level of 255)."""
    import torch
    from diffusers import DiffusionPipeline

    from PIL import Image

    from paradiff.cli.embedded import embedded_call_kwargs, embedded_default
    from paradiff.io.outputs import png_bytes

    out = tmp_path_factory.mktemp("generate")
    argv = ["-m", "paradiff.cli", "generate", "--steps", "4", "--seed", "5", "--out", str(out)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    pipeline = DiffusionPipeline.from_pretrained(str(embedded_default()))
    pipeline.set_progress_bar_config(disable=True)

    def two_steps() -> dict:
        return {(prompt, 5 + index, 2): png_bytes(pipeline(
            prompt=prompt, generator=torch.Generator("cpu").manual_seed(5 + index), height=64, width=64,
            num_inference_steps=2, output_type="np", **embedded_call_kwargs()).images[0])
            for index, prompt in enumerate(PROMPTS)}

    # the 2-step pictures are drawn here while the command draws the 4-step ones
    done, found = beside(two_steps, lambda: command.run(argv, timeout=300))
    assert done.returncode == 0, done.stderr[-3000:]
    found.update({(prompt, 5 + index, 4): (out / f"{index:04d}.png").read_bytes()
                  for index, prompt in enumerate(PROMPTS)})
    # edits (FLUX.2 takes reference images): PROMPTS[1] with the picture of PROMPTS[0] as one reference, and as two
    for count in (1, 2):
        references = [Image.open(io.BytesIO(found[(PROMPTS[0], 5, 4)])).convert("RGB")] * count
        image = pipeline(prompt=PROMPTS[1], image=references[0] if count == 1 else references, height=64, width=64,
                         generator=torch.Generator("cpu").manual_seed(EDIT_SEED), num_inference_steps=2,
                         output_type="np", **embedded_call_kwargs()).images[0]
        found[("edit", count)] = png_bytes(image)
    return found


# -- servers of their own (started and stopped before dp_server, which would idle beside them) ------------------


def test_dp2_long_requests_neither_fault_the_idle_replica_nor_run_past_their_answer(tmp_path):
    """--dp 2 with a collective --timeout of 5 s: a request of 5000 steps runs past 5 s while the other replica
    idles, without a fault; at its --request-timeout (504) it stops at the next step; so does one whose client hangs
    up (499); the next request starts at once. Then the replicas run independently: while replica 0 runs a long
    request, replica 1 answers five short ones; its sixth call raises a device's error on rank 1 (its only rank):
    that request gets a 500, replica 1 alone loads again (/health degraded, then ready) while replica 0 goes on;
    SIGTERM drains."""
    server = ServerProcess(tmp_path, "--dp", "2", "--steps", "1", "--max-steps", "5000", "--timeout", "5",
                           "--request-timeout", "9", env={"PARADIFF_INJECT_FAULT": "1:device@6"},
                           module="paradiff_testkit.faults")
    try:
        server.wait_ready()
        with ThreadPoolExecutor(2) as pool:
            submitted = time.monotonic()  # its --request-timeout counts from later: the loop ends before the 504
            long = pool.submit(server.generate, prompt=PROMPTS[0], steps=5000)
            wait_for_metric(server, "paradiff_requests_running", 1)
            while time.monotonic() - submitted < 6.5:  # the idle replica has waited past --timeout 5
                assert server.client.get("/health").json() == {"status": "ready"}, server.text()[-2000:]
                assert metric(server, "paradiff_requests_running") == {"": 1}
                time.sleep(0.1)
            answer = long.result(timeout=120)
        assert answer.status_code == 504, answer.text
        wait_for_metric(server, "paradiff_requests_cancelled_total", 1)
        assert 0 < metric(server, "paradiff_cancelled_steps_total")[""] < 5000
        assert pngs(server.generate(prompt=PROMPTS[0], steps=1))

        hung_up = hang_up_once_running(server, {"prompt": PROMPTS[1], "steps": 5000})
        wait_for_metric(server, "paradiff_requests_cancelled_total", 2)
        started = time.monotonic()
        assert pngs(server.generate(prompt=PROMPTS[0], steps=1))
        print(f"\nhang-up -> cancelled {started - hung_up:.2f} s; "
              f"next 1-step request {time.monotonic() - started:.2f} s")
        wait_for_log(server, 4)
        assert [entry["status"] for entry in server.log()] == [504, 200, 499, 200]
        assert "fault" not in server.text() and metric(server, "paradiff_up") == {"": 1}

        long_client = hold_request(server, {"prompt": PROMPTS[1], "steps": 5000})  # replica 0: both were free
        try:
            wait_for_metric(server, "paradiff_requests_running", 1)
            for seed in range(5):  # one after the other, each answered while the long one runs
                assert pngs(server.generate(prompt=PROMPTS[0], steps=1, seed=seed))
            assert metric(server, "paradiff_replica_requests_running") == {'{replica="0"}': 1, '{replica="1"}': 0}
            wait_for_log(server, 9)
            assert [entry.get("replica") for entry in server.log()[4:]] == [1] * 5  # the long one: no line yet
            failed = server.generate(prompt=PROMPTS[0], steps=1)  # replica 1's sixth call: a device's error
            assert failed.status_code == 500 and "injected device fault on rank 1" in failed.text
            # its state changed before the answer; its load takes seconds: replica 0 still runs the long one
            assert server.client.get("/health").json() == {"status": "degraded"}
            assert metric(server, "paradiff_replica_up") == {'{replica="0"}': 1, '{replica="1"}': 0}
        finally:
            long_client.close()  # the long one is cancelled
        assert pngs(server.generate(prompt=PROMPTS[0], steps=1))  # served, degraded or not
        server.wait_ready()
        assert "replica 1 ready again, after a fault" in server.text()
        assert pngs(server.generate(prompt=PROMPTS[0], steps=1))
        assert server.stop() == 0, server.text()
        statuses = [entry["status"] for entry in server.log()]
        assert statuses[:10] == [504, 200, 499, 200] + [200] * 5 + [500] and sorted(statuses[10:]) == [200, 200, 499]
    finally:
        server.stop()


def test_a_fault_on_one_rank_fails_that_request_and_the_next_one_succeeds_then_sigterm_drains(tmp_path, generated):
    """tp2 x ulysses2. First every rank raises the same error in the first request's second step (the request's own
    fault: a 500, no reload); then rank 1 alone raises in the next request's second step (a rank's fault: a reload).
    Recovered, it answers openai's images.edit as single-process diffusers draws it."""
    server = ServerProcess(tmp_path, "--tp", "2", "--ulysses", "2", "--steps", "4",
                    env={"PARADIFF_INJECT_FAULT": "all:alike,1:raise@4"}, module="paradiff_testkit.faults")
    try:
        server.wait_ready()
        own = server.generate(prompt=PROMPTS[0], seed=5)
        # a ValueError on every rank: the request's inputs, its 400 (the pipeline's own check_inputs raise those)
        assert own.status_code == 400 and "injected request fault" in own.json()["error"]["message"], own.text
        assert server.client.get("/health").json() == {"status": "ready"}  # no reload: the ranks agreed
        assert "fault:" not in server.text() and "ready again" not in server.text()
        failed = server.generate(prompt=PROMPTS[0], seed=5)
        assert failed.status_code == 500, failed.text
        assert "rank 1: RuntimeError: injected fault on rank 1" in failed.json()["error"]["message"]
        server.wait_ready()  # the ranks joined a new process group and loaded the pipeline again
        recovered, = pngs(server.generate(prompt=PROMPTS[0], seed=5))
        assert_same_picture(recovered, generated[(PROMPTS[0], 5, 4)])
        edited = edit_of(openai_client(server), generated, 1)
        assert_same_picture(decoded(edited.data[0]), generated[("edit", 1)])
        # streamed at tp2 x ulysses2, after the reload (previews fitted again): two previews, then the same bytes
        from openai import OpenAI

        events = list(OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0).images.generate(
            prompt=PROMPTS[0], stream=True, partial_images=2, extra_body={"seed": 5}))
        assert [event.type for event in events].count("image_generation.partial_image") == 2
        assert base64.b64decode(events[-1].b64_json) == recovered
        # n = 2 where a call takes one image (--max-batch 1): still the first image's 2 previews, then both images
        events = list(OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0).images.generate(
            prompt=PROMPTS[0], stream=True, partial_images=2, n=2, extra_body={"seed": 5}))
        assert [event.type for event in events] == ["image_generation.partial_image"] * 2 + [
            "image_generation.completed"] * 2
        assert [event.partial_image_index for event in events[:2]] == [0, 1]
        assert base64.b64decode(events[2].b64_json) == recovered
        # SIGTERM with requests in flight: they are answered, the next is refused, the server exits 0
        with ThreadPoolExecutor(3) as pool:
            answered = server.metrics()['paradiff_requests_total{status="200"}']
            pending = [pool.submit(server.generate, prompt=PROMPTS[1], seed=6) for _ in range(3)]
            # all three reached the server (queued, running or answered) before SIGTERM: a request that arrives after
            # it is refused, rightly
            server.wait_for(lambda m: m["paradiff_queue_depth"] + m["paradiff_requests_running"]
                            + m['paradiff_requests_total{status="200"}'] - answered == 3)
            server.process.send_signal(signal.SIGTERM)
            answers = [future.result(timeout=120) for future in pending]
        drained = [pngs(answer) for answer in answers]
        assert drained[0] == drained[1] == drained[2] and len(drained[0]) == 1  # byte for byte: one server
        assert_same_picture(drained[0][0], generated[(PROMPTS[1], 6, 4)])
        assert server.process.wait(timeout=60) == 0, server.text()
        assert "SIGTERM: finishing the requests in flight" in server.text()
        statuses = [entry["status"] for entry in server.log()]
        # the request's own fault and the rank's, the recovered request, the edit, the two streams, the three drained
        assert statuses == [400, 500, 200, 200, 200, 200, 200, 200, 200]
    finally:
        server.stop()


def test_a_killed_worker_fails_the_server_and_answers_every_client(tmp_path):
    """Rank 1 dies (os._exit) in the middle of a request; another request waits behind it."""
    gate = tmp_path / "fault-gate"
    server = ServerProcess(tmp_path, "--tp", "2", "--steps", "4", module="paradiff_testkit.faults",
                           env={"PARADIFF_INJECT_FAULT": "1:exit", "PARADIFF_FAULT_GATE": str(gate)})
    try:
        server.wait_ready()
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(server.generate, prompt=PROMPTS[0], seed=5)
            server.wait_for(lambda m: m["paradiff_requests_running"] == 1)
            second = pool.submit(server.generate, prompt=PROMPTS[1], seed=6)
            # the second waits behind the first (held at its fault by the gate): now rank 1 dies
            server.wait_for(lambda m: m["paradiff_requests_running"] == 1 and m["paradiff_queue_depth"] == 1)
            started = time.monotonic()
            gate.write_text("")
            answers = [first.result(timeout=60), second.result(timeout=60)]
        assert [answer.status_code for answer in answers] == [500, 503]
        assert all("rank(s) [1] stopped answering" in answer.text for answer in answers), [a.text for a in answers]
        code = server.process.wait(timeout=120)
        assert code != 0
        # the death was seen by rank 0's process check, not at a collective's timeout (--timeout: 600 s): a bound, not
        # a guess of how long it takes (it was 20 s; under the load lane rank 0's own loop alone took over 5 s)
        assert time.monotonic() - started < 120
        assert "rank 1 exited with code 9 first" in server.text()
    finally:
        server.stop()


# -- img2img and inpaint edits: other pipeline classes of one FLUX.1 folder (serve --pipeline CLASS) -------------------
# strengths whose step counts at 4 steps differ from the default 0.6's (4 and 2 steps, not 3): a strength the server
# dropped gives another picture
CONDITIONED = {"FluxImg2ImgPipeline": dict(strength=0.9), "FluxInpaintPipeline": dict(strength=0.3, mask=True)}


def conditioning_pictures() -> tuple[bytes, bytes]:
    """A 32x32 noise picture and a mask repainting its left half (white: repaint, black: keep)."""
    from PIL import Image

    rng = np.random.default_rng(3)
    mask = np.zeros((32, 32), dtype=np.uint8)
    mask[:, :16] = 255
    files = []
    for array in (rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), mask):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="PNG")
        files.append(buffer.getvalue())
    return files[0], files[1]


@pytest.mark.parametrize("pipeline_class", sorted(CONDITIONED))
def test_openais_client_edits_img2img_and_inpaint_at_tp2_as_single_process_diffusers_does(
        tmp_path_factory, pipeline_class):
    """images.edit on the tiny FLUX.1 folder served as FluxImg2ImgPipeline (image + strength) and as
    FluxInpaintPipeline (image + mask + strength) at tp2: the image diffusers' class draws in this process with the
    same inputs and seed."""
    import diffusers
    import openai
    import torch
    from PIL import Image

    from paradiff.io.outputs import png_bytes
    from paradiff_testkit.pipelines import save_pipeline

    fields = CONDITIONED[pipeline_class]
    root = tmp_path_factory.mktemp(pipeline_class)
    folder = save_pipeline("flux", tmp_path_factory.getbasetemp() / "serve-flux")
    image, mask = conditioning_pictures()
    server = ServerProcess(root, str(folder), "--pipeline", pipeline_class, "--tp", "2", "--steps", "4",
                           "--height", "32", "--width", "32")
    try:
        server.wait_ready()
        client = openai_client(server)
        answer = client.images.edit(image=("image.png", image, "image/png"), prompt=PROMPTS[0], size="32x32",
                                    mask=("mask.png", mask, "image/png") if fields.get("mask") else openai.NOT_GIVEN,
                                    extra_body={"seed": EDIT_SEED, "strength": fields["strength"]})
    finally:
        assert server.stop() == 0, server.text()
    pipeline = getattr(diffusers, pipeline_class).from_pretrained(str(folder))
    pipeline.set_progress_bar_config(disable=True)
    inputs = dict(image=Image.open(io.BytesIO(image)).convert("RGB"), strength=fields["strength"])
    if fields.get("mask"):
        inputs["mask_image"] = Image.open(io.BytesIO(mask)).convert("L")
    expected = pipeline(prompt=PROMPTS[0], height=32, width=32, num_inference_steps=4, output_type="np",
                        generator=torch.Generator("cpu").manual_seed(EDIT_SEED), **inputs).images[0]
    assert answer.data[0].seed == EDIT_SEED
    assert_same_picture(decoded(answer.data[0]), png_bytes(expected))


@pytest.fixture(scope="module")
def dp_server_started(tmp_path_factory):
    """Two data-parallel replicas of two TP ranks each, batching up to 2 images, with an API key: started, not yet
    ready (`dp_server` waits for it)."""
    server = ServerProcess(tmp_path_factory.mktemp("dp2tp2"), "--dp", "2", "--tp", "2", "--max-batch", "2",
                    "--steps", "4", "--api-key", KEY, "--max-n", "2", "--max-steps", "10", "--batch-window", "0.2",
                    "--read-timeout", str(READ_TIMEOUT_S))
    try:
        yield server
    finally:
        code = server.stop()
        assert code == 0, server.text()


@pytest.fixture(scope="module")
def dp_server(dp_server_started, generated):
    """The server ready (its ranks load while `generated` draws the pictures its answers are compared with, when no
    test before drew them)."""
    dp_server_started.wait_ready()
    return dp_server_started


def test_dp2_tp2_answers_equal_generate_and_repeat_byte_for_byte(dp_server, generated):
    for index, prompt in enumerate(PROMPTS):
        first, = pngs(dp_server.generate(AUTH, prompt=prompt, seed=5 + index))
        assert_same_picture(first, generated[(prompt, 5 + index, 4)])
        assert pngs(dp_server.generate(AUTH, prompt=prompt, seed=5 + index)) == [first]  # reproducible
    # a request of n=2 draws seeds 5 and 6 (as generate's prompts 0 and 1), batched into one call of the replica
    both = pngs(dp_server.generate(AUTH, prompt=PROMPTS[1], seed=5, n=2, steps=2))
    assert len(both) == 2
    assert both[1] != both[0]
    reference = [pixels(generated[(PROMPTS[0], 5, 2)]), pixels(generated[(PROMPTS[1], 6, 2)])]
    assert np.abs(pixels(both[1]) - reference[1]).max() <= 1  # prompt 1 with seed 6, in a batch of two


def test_a_stream_sends_its_previews_then_the_image_the_same_request_gets_unstreamed(dp_server):
    """OpenAI's own client, streaming at tp2 (each replica of dp_server): partial_images previews (x0 at steps 2
    and 3 of 4, 64x64 PNGs), then the completed image, byte for byte the non-streamed answer of the same seed;
    /metrics has each replica's steps per second."""
    import io

    from openai import OpenAI
    from PIL import Image

    client = OpenAI(base_url=dp_server.url + "/v1", api_key=KEY, max_retries=0)
    events = list(client.images.generate(prompt=PROMPTS[1], stream=True, partial_images=2, extra_body={"seed": 9}))
    assert [event.type for event in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [event.partial_image_index for event in events[:2]] == [0, 1]
    previews = [base64.b64decode(event.b64_json) for event in events[:2]]
    assert all(Image.open(io.BytesIO(png)).size == (64, 64) for png in previews) and previews[0] != previews[1]
    final = base64.b64decode(events[-1].b64_json)
    assert events[-1].size == "64x64" and events[-1].usage.total_tokens == 0
    assert pngs(dp_server.generate(AUTH, prompt=PROMPTS[1], seed=9)) == [final]
    rates = metric(dp_server, "paradiff_replica_steps_per_second", AUTH)
    assert rates and all(value > 0 for value in rates.values()), rates
    steps = metric(dp_server, "paradiff_replica_steps_total", AUTH)
    assert sum(steps.values()) >= 8, steps  # the two requests' 4 steps each, at least
    import openai

    with pytest.raises(openai.BadRequestError, match="partial_images 4 is out of bounds"):
        client.images.generate(prompt=PROMPTS[1], stream=True, partial_images=4)


def test_two_replicas_run_two_requests_at_once_and_waiting_requests_are_batched(dp_server, generated):
    before = {entry["id"] for entry in dp_server.log()}
    bodies = [dict(prompt=PROMPTS[index % 2], seed=5 + index % 2, steps=2) for index in range(4)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda body: dp_server.generate(AUTH, **body), bodies))
    for body, answer in zip(bodies, answers):
        image, = pngs(answer)
        expected = pixels(generated[(body["prompt"], body["seed"], 2)])
        assert np.abs(pixels(image) - expected).max() <= 1  # its own prompt and seed, batched or not
    entries = [entry for entry in dp_server.log() if entry["id"] not in before]
    assert len(entries) == 4 and {entry["status"] for entry in entries} == {200}
    by_replica = {replica: [e for e in entries if e["replica"] == replica] for replica in (0, 1)}
    assert by_replica[0] and by_replica[1], entries
    a, b = by_replica[0][0], by_replica[1][0]
    assert a["started"] < b["finished"] and b["started"] < a["finished"], (a, b)  # their spans overlap
    calls = {(e["replica"], e["started"]) for e in entries}
    assert len(calls) < len(entries), entries  # at least two requests shared one pipeline call


def test_bad_requests_between_good_ones_get_4xx_and_the_server_goes_on(dp_server, generated):
    before, = pngs(dp_server.generate(AUTH, prompt=PROMPTS[0], seed=5))
    assert_same_picture(before, generated[(PROMPTS[0], 5, 4)])
    bad = [({"prompt": PROMPTS[0], "size": "50x64"}, 400, "multiples of 16"),
           ({"prompt": PROMPTS[0], "n": 3}, 400, "n 3 is out of bounds: expected 1 to 2"),
           ({"prompt": PROMPTS[0], "steps": 11}, 400, "steps 11 is out of bounds"),
           ({"prompt": PROMPTS[0], "colour": "red"}, 400, "unknown field(s) ['colour']"),
           ({"prompt": "x" * 2001}, 400, "at most 2000"),
           ({"prompt": PROMPTS[0], "model": "flux"}, 404, "is not served here"),
           # valid JSON, but no tokenizer reads it
           ({"prompt": "\ud800", "steps": 1}, 400, "prompt: not valid Unicode text")]
    for body, status, words in bad:  # JSON text as a client sends it (ASCII escapes: "\\ud800" is valid JSON)
        answer = dp_server.client.post("/v1/images/generations", content=json.dumps(body),
                                       headers={**AUTH, "Content-Type": "application/json"})
        assert answer.status_code == status and words in answer.json()["error"]["message"], answer.text
    video = dp_server.client.post("/v1/videos", json={"prompt": "x"}, headers=AUTH)
    assert video.status_code == 400 and "use /v1/images/generations" in video.text
    not_json = dp_server.client.post("/v1/images/generations", content=b"{prompt", headers=JSON)
    assert not_json.status_code == 400 and "not JSON" in not_json.text
    huge = dp_server.client.post("/v1/images/generations", content=b"x" * (2 << 20), headers=AUTH)
    assert huge.status_code == 413 and "--max-body-bytes" in huge.text
    assert pngs(dp_server.generate(AUTH, prompt=PROMPTS[0], seed=5)) == [before]
    assert "fault" not in dp_server.text()  # none of them reached a rank: no reload


def test_the_api_key_guards_every_endpoint_but_health(dp_server):
    assert dp_server.generate(prompt=PROMPTS[0]).status_code == 401
    wrong = dp_server.generate({"Authorization": "Bearer nope"}, prompt=PROMPTS[0])
    assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
    for path in ("/metrics", "/v1/models", "/openapi.json"):
        assert dp_server.client.get(path).status_code == 401
        assert dp_server.client.get(path, headers=AUTH).status_code == 200
    assert dp_server.client.get("/health").json() == {"status": "ready"}
    assert dp_server.client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "paradiff-demo"
    schema = dp_server.client.get("/openapi.json", headers=AUTH).json()
    assert set(schema["paths"]) == {"/v1/images/generations", "/v1/images/edits", "/health", "/metrics",
                                    "/v1/models", "/v1/models/{model_id}"}  # no videos here; FLUX.2 takes images


def raw_request(server, head: str, body: bytes = b"") -> socket.socket:
    """A connection that has sent `head` (request line and headers, as given) and `body`, and nothing more."""
    connection = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    connection.sendall(head.encode() + body)
    return connection


def post_head(server, length: int) -> str:
    return (f"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {KEY}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n")


def refusals(server, before: int) -> list[tuple[int, str]]:
    return [(entry["status"], entry["request"]) for entry in server.log()[before:] if entry["id"] is None]


def test_foreign_origins_and_hosts_and_non_json_bodies_are_refused(dp_server):
    """A web page's "simple" request (text/plain, another site's Origin) and a DNS-rebound Host are refused before
    anything is read; each refusal is JSON, counted in /metrics and one line of requests.jsonl."""
    before = len(dp_server.log())
    body = json.dumps({"prompt": PROMPTS[0], "steps": 1})
    cases = [({**JSON, "Origin": "http://evil.example"}, 403, "Origin 'http://evil.example' is not allowed"),
             ({**AUTH, "Content-Type": "text/plain"}, 415, "takes 'application/json'"),
             ({**AUTH}, 415, "Content-Type 'missing'"),
             ({**JSON, "Host": f"evil.example:{dp_server.port}"}, 403, "is not served"),
             ({**JSON, "Host": "localhost:1"}, 403, "--allow-host")]
    for headers, status, words in cases:
        answer = dp_server.client.post("/v1/images/generations", content=body, headers=headers)
        assert answer.status_code == status and words in answer.json()["error"]["message"], answer.text
    rebound = dp_server.client.get("/health", headers={"Host": "evil.example"})
    assert rebound.status_code == 403 and rebound.headers["content-type"] == "application/json"
    # a page of the server itself (/docs) names the server's own origin
    same_origin = {**JSON, "Host": f"localhost:{dp_server.port}", "Origin": f"http://localhost:{dp_server.port}"}
    assert pngs(dp_server.client.post("/v1/images/generations", content=body, headers=same_origin))
    assert refusals(dp_server, before) == [(403, "POST /v1/images/generations"), (415, "POST /v1/images/generations"),
                                           (415, "POST /v1/images/generations"), (403, "POST /v1/images/generations"),
                                           (403, "POST /v1/images/generations"), (403, "GET /health")]


def test_every_error_is_json_counted_and_logged_and_no_traceback_reaches_the_console(dp_server):
    """50,000 levels of nested JSON, no such path, another method, a client gone before its body: JSON answers
    (OpenAI's error shape), counted by status in /metrics, a line each in requests.jsonl, and no traceback."""
    before = len(dp_server.log())
    counted = _status_counts(dp_server)
    deep = dp_server.client.post("/v1/images/generations", content=b"[" * 50_000 + b"]" * 50_000, headers=JSON)
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]
    assert set(deep.json()["error"]) == {"message", "type", "param", "code"}
    missing = dp_server.client.get("/v1/nothing", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    method = dp_server.client.delete("/v1/images/generations", headers=AUTH)
    assert method.status_code == 405 and method.headers["allow"] == "POST" and "does not take DELETE" in method.text
    gone = raw_request(dp_server, post_head(dp_server, 100), b'{"prompt": "a re')
    gone.close()  # mid-body
    deadline = time.monotonic() + 60
    while len(dp_server.log()) < before + 4:
        assert time.monotonic() < deadline, dp_server.log()[before:]
        time.sleep(0.05)
    assert refusals(dp_server, before) == [(400, "POST /v1/images/generations"), (404, "GET /v1/nothing"),
                                           (405, "DELETE /v1/images/generations"), (499, "POST /v1/images/generations")]
    now = _status_counts(dp_server)
    assert {status: now[status] - counted.get(status, 0) for status in (400, 404, 405, 499)} == {
        400: 1, 404: 1, 405: 1, 499: 1}
    console = dp_server.text()
    assert "Traceback" not in console and "Exception in ASGI application" not in console, console[-3000:]


def _status_counts(server) -> dict[int, int]:
    counts = {}
    for line in server.client.get("/metrics", headers=AUTH).text.splitlines():
        if line.startswith("paradiff_requests_total{"):
            counts[int(line.split('"')[1])] = int(line.split()[-1])
    return counts


def test_slow_clients_are_cut_off_after_the_read_timeout(dp_server):
    """Ten connections that never finish their headers are closed, and a body that stops short gets 408, within
    --read-timeout (4 s here) plus a margin, while the server goes on answering."""
    started = time.monotonic()
    slow = [raw_request(dp_server, "POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\n") for _ in range(10)]
    stalled = raw_request(dp_server, post_head(dp_server, 100), b'{"prompt": ')
    assert pngs(dp_server.generate(AUTH, prompt=PROMPTS[0], steps=1))  # others are served meanwhile
    for connection in slow:
        assert connection.recv(1024) == b""  # closed by the server (the socket's own timeout is 60 s)
        connection.close()
    answer = b""
    while b"}}" not in answer:
        chunk = stalled.recv(4096)
        assert chunk, answer
        answer += chunk
    stalled.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"--read-timeout 4 s" in answer, answer
    assert time.monotonic() - started < READ_TIMEOUT_S + 30


def test_the_schema_holds_against_a_fuzzer(dp_server, tmp_path):
    """schemathesis, every check, against the live server: what the schema allows is answered 200, anything else a
    documented 4xx; /metrics is declared as text; /v1/videos is not advertised by an image pipeline."""
    schema = dp_server.client.get("/openapi.json", headers=AUTH).json()
    assert "/v1/videos" not in schema["paths"]
    assert list(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert pngs(dp_server.generate(AUTH, prompt=PROMPTS[0], n=1.0, steps=1.0))  # integral JSON numbers
    # an edit's image must be at least 16 pixels a side, which JSON Schema cannot say: the fuzzer's 1x1 PNG is rightly
    # a 400 there (test_serve_protocol.py), so its schema-valid data may get 400 (not 5xx), and mostly does: the one
    # warning allowed (schemathesis 4.32 does not take a warnings setting per operation)
    (tmp_path / "schemathesis.toml").write_text('[[operations]]\ninclude-path = "/v1/images/edits"\n'
                                                'checks.positive_data_acceptance.expected-statuses = ["2XX", 400]\n')
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
         "run", f"{dp_server.url}/openapi.json", "--header", f"Authorization: Bearer {KEY}", "--checks", "all",
         "--phases", "examples,fuzzing", "--max-examples", "2", "--generation-deterministic", "--no-color",
         "--request-timeout", "60"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    # every operation fuzzed (2 examples each, besides the schema's own: 5 took twice the CPU and found no more)
    operations = sum(len(methods) for methods in schema["paths"].values())
    assert f"Tested: {operations}\n" in done.stdout, done.stdout[-3000:]
    edits_mostly_400 = ("mostly rejected generated data" in done.stdout and "- POST /v1/images/edits" in done.stdout
                        and "1 warning in" in done.stdout)
    assert "No issues found" in done.stdout or edits_mostly_400, done.stdout[-3000:]


def listening_addresses(root: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state held by process `root` or a descendant, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree, grown = {root}, True
    while grown:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree, grown = tree | children, bool(children)
    inodes = set()
    for pid in tree:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        inodes |= {link[len("socket:["):-1] for link in links if link.startswith("socket:[")}
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                # /proc writes each 32-bit word in host (little-endian) order
                packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append((socket.inet_ntop(family, packed), int(port, 16)))
    return found


def test_no_process_of_the_server_listens_beyond_loopback(dp_server):
    """Without --host, nothing the server started (launcher, ranks, their store and process groups) listens on an
    address another machine can reach (what `ss -ltnp` shows, read from /proc)."""
    found = listening_addresses(dp_server.process.pid)
    assert ("127.0.0.1", dp_server.port) in found
    assert all(address in ("127.0.0.1", "::1") for address, _ in found), found


def test_four_clients_of_ten_requests_are_all_answered_once(dp_server):
    """Also: the store holds as many keys and every rank about as much memory after the 40 requests as before (after
    a warm-up of 8 such requests: the allocator's first rounds)."""
    with ThreadPoolExecutor(4) as pool:
        assert all(answer.status_code == 200 for answer in pool.map(
            lambda index: dp_server.generate(AUTH, prompt=PROMPTS[index % 2], seed=index, steps=1), range(8)))
    before = {entry["id"] for entry in dp_server.log()}
    keys, rss = metric(dp_server, "paradiff_store_keys", AUTH), metric(dp_server, "paradiff_rank_rss_bytes", AUTH)
    latencies: list[float] = []
    answers: dict[tuple[int, int], bytes] = {}
    lock = threading.Lock()

    def client(number: int) -> None:
        with httpx.Client(base_url=dp_server.url, timeout=120, headers=AUTH) as http:
            for index in range(10):
                started = time.monotonic()
                response = http.post("/v1/images/generations",
                                     json={"prompt": PROMPTS[index % 2], "seed": index, "steps": 1})
                image, = pngs(response)
                with lock:
                    latencies.append(time.monotonic() - started)
                    answers[(number, index)] = image

    threads = [threading.Thread(target=client, args=(number,)) for number in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    assert len(answers) == 40
    for index in range(10):  # the four clients asked the same (prompt, seed): the same picture, whatever the batch
        first = pixels(answers[(0, index)])
        assert all(np.abs(pixels(answers[(number, index)]) - first).max() <= 1 for number in range(1, 4))
    assert answers[(0, 0)] != answers[(0, 2)]
    entries = [entry for entry in dp_server.log() if entry["id"] not in before]
    assert len(entries) == 40 and len({entry["id"] for entry in entries}) == 40
    assert {entry["status"] for entry in entries} == {200}
    p50, p95 = statistics.median(latencies), float(np.percentile(latencies, 95))
    print(f"\n40 requests from 4 clients: p50 {p50:.2f} s, p95 {p95:.2f} s")
    metrics = dp_server.client.get("/metrics", headers=AUTH).text
    assert 'paradiff_request_latency_seconds_count' in metrics and 'paradiff_rank_peak_memory_bytes{rank="3"}' in metrics
    assert metric(dp_server, "paradiff_store_keys", AUTH) == keys  # every result read once and deleted
    grown = {rank: value - rss[rank] for rank, value in metric(dp_server, "paradiff_rank_rss_bytes", AUTH).items()}
    print("RSS growth over 40 requests (MB):", {rank: round(value / 2**20, 1) for rank, value in grown.items()})
    assert len(grown) == 4 and max(grown.values()) < 8 * 2**20, grown


def hang_up_once_running(server: ServerProcess, body: dict, queued: int = 0) -> float:
    """Send `body` as a client that hangs up once the server says a request runs (and `queued` wait behind it); the
    moment it hung up."""
    import socket

    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(f"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        wait_for_metric(server, "paradiff_requests_running", 1)
        wait_for_metric(server, "paradiff_queue_depth", queued)
        return time.monotonic()


def wait_for_log(server: ServerProcess, count: int, where=lambda entry: True) -> list[dict]:
    """The answer can reach the client before its line reaches requests.jsonl: wait (bounded) for `count` lines
    (those `where` accepts); they are returned."""
    deadline = time.monotonic() + 30
    while len(lines := [entry for entry in server.log() if where(entry)]) < count:
        assert time.monotonic() < deadline, server.log()[-5:]
        time.sleep(0.02)
    return lines


def hold_request(server: ServerProcess, body: dict) -> socket.socket:
    """Send `body` from a client that waits for its answer on the socket returned (closing it hangs up)."""
    data = json.dumps(body).encode()
    client = socket.create_connection(("127.0.0.1", server.port))
    client.sendall(f"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return client


# -- OpenAI's own client (the `openai` package) against the servers above ---------------------------------------------
def openai_client(server: ServerProcess, key: str = "none"):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def decoded(item) -> bytes:
    return base64.b64decode(item.b64_json)


def edit_of(client, generated: dict, count: int, **fields):
    """PROMPTS[1] with `count` copies of the picture of PROMPTS[0] (seed 5, 4 steps) as the edit's images (the
    openai client sends one as `image`, several as `image[]`)."""
    upload = ("ref.png", generated[(PROMPTS[0], 5, 4)], "image/png")
    return client.images.edit(image=upload if count == 1 else [upload] * count, prompt=PROMPTS[1], size="64x64",
                              extra_body={"seed": EDIT_SEED, "steps": 2, **fields.pop("extra_body", {})}, **fields)




def test_openais_client_generates_with_every_standard_field_and_every_image_has_its_seed(dp_server, generated):
    """images.generate with OpenAI's standard fields (accepted; output_format and output_compression honoured);
    without a seed each call draws its own, returned with the image, which that seed draws again byte for byte."""
    from PIL import Image

    client = openai_client(dp_server, KEY)
    standard = dict(quality="high", style="vivid", background="opaque", moderation="low", user="u",
                    safety_identifier="s", size="auto", model="paradiff-demo")
    png = client.images.generate(prompt=PROMPTS[0], output_format="png", extra_body={"seed": 5}, **standard)
    assert_same_picture(decoded(png.data[0]), generated[(PROMPTS[0], 5, 4)])
    assert (png.data[0].seed, png.output_format, png.size) == (5, "png", "64x64")
    first, second = (client.images.generate(prompt=PROMPTS[0], extra_body={"steps": 1}) for _ in range(2))
    assert first.data[0].seed != second.data[0].seed and decoded(first.data[0]) != decoded(second.data[0])
    again = client.images.generate(prompt=PROMPTS[0], extra_body={"steps": 1, "seed": first.data[0].seed})
    assert decoded(again.data[0]) == decoded(first.data[0])
    for output_format, magic, drawn in (("jpeg", "JPEG", first), ("webp", "WEBP", second)):
        answer = client.images.generate(prompt=PROMPTS[0], output_format=output_format, output_compression=90,
                                        extra_body={"steps": 1, "seed": drawn.data[0].seed}, **standard)
        with Image.open(io.BytesIO(decoded(answer.data[0]))) as image:
            assert image.format == magic and image.size == (64, 64)
            lossy = np.asarray(image.convert("RGB"), dtype=np.int16)
        assert np.abs(lossy - pixels(decoded(drawn.data[0]))).mean() < 6  # the same picture, lossy
    sent = time.time()
    two = client.images.generate(prompt=PROMPTS[0], n=2, extra_body={"steps": 1})
    assert two.data[1].seed == two.data[0].seed + 1  # image i: seed + i
    logged = wait_for_log(dp_server, 1, where=lambda entry: entry["id"] is not None and entry["images"] == 2
                          and entry["accepted"] >= sent)[-1]
    assert logged["seed"] == two.data[0].seed  # requests.jsonl has the drawn seed too


def test_openais_client_lists_and_retrieves_the_model_and_reads_every_error(dp_server):
    import openai

    client = openai_client(dp_server, KEY)
    listed, = client.models.list().data
    model = client.models.retrieve("paradiff-demo")
    assert listed.id == model.id == "paradiff-demo" and listed.created == model.created
    assert time.time() - 3600 < model.created <= time.time()  # the load time, not 0
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("flux")
    assert (missing.value.code, missing.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.BadRequestError) as bad:
        client.images.generate(prompt=PROMPTS[0], size="50x64")
    assert (bad.value.code, bad.value.param) == ("invalid_request", "size") and "multiples of 16" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.images.generate(prompt=PROMPTS[0], output_format="gif")
    assert bad.value.param == "output_format" and "'png', 'jpeg', 'webp'" in bad.value.message
    with pytest.raises(openai.NotFoundError) as nowhere:
        client.post("/nothing", body={}, cast_to=object)
    assert nowhere.value.code == "not_found"
    with pytest.raises(openai.APIStatusError) as method:
        client.delete("/images/generations", cast_to=object)
    assert (method.value.status_code, method.value.code) == (405, "method_not_allowed")
    with pytest.raises(openai.BadRequestError) as variations:
        client.images.create_variation(image=("ref.png", b"x", "image/png"))
    assert variations.value.code == "unsupported_endpoint" and "/v1/images/edits" in variations.value.message
    with pytest.raises(openai.AuthenticationError) as unauthorised:
        openai_client(dp_server, "wrong").models.list()
    assert unauthorised.value.code == "invalid_api_key"


def test_openais_client_edits_with_reference_images_as_single_process_diffusers_does(dp_server, generated):
    """images.edit on the FLUX.2 demo (its call takes reference images) at dp2 x tp2: one image, and two (image[]);
    bad uploads are refused by name before they reach a rank."""
    import openai

    client = openai_client(dp_server, KEY)
    one = edit_of(client, generated, 1)
    assert one.data[0].seed == EDIT_SEED
    assert_same_picture(decoded(one.data[0]), generated[("edit", 1)])
    assert_same_picture(decoded(edit_of(client, generated, 2).data[0]), generated[("edit", 2)])
    refusals = [(dict(mask=("mask.png", generated[(PROMPTS[0], 5, 4)], "image/png")), "mask", "takes no mask_image"),
                (dict(extra_body={"strength": 0.5}), "strength", "takes no strength")]
    for fields, param, words in refusals:
        with pytest.raises(openai.BadRequestError) as bad:
            edit_of(client, generated, 1, **fields)
        assert bad.value.param == param and words in bad.value.message, bad.value.message
    for upload, words in ((b"not an image", "not a readable image"), (png_of(300, 300), "at most 65536")):
        with pytest.raises(openai.BadRequestError) as bad:
            client.images.edit(image=("x.png", upload, "image/png"), prompt=PROMPTS[1])
        assert bad.value.param == "image" and words in bad.value.message, bad.value.message


def png_of(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


# -- the web page on an image server (tests/test_serve_jobs.py has its video path) -------------------------------------


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no chromium here (Debian: apt-get install chromium)")
def test_the_web_page_asks_the_key_then_shows_the_image_with_its_parameters_in_a_real_browser(dp_server, generated):
    """Debian's chromium, headless, driven by playwright, on the dp2 x tp2 image server with an API key: the page asks
    for the key; a prompt typed and Generate clicked show the progress bar up to 100 %, then an <img> in the gallery
    (the picture `paradiff generate` draws for that prompt and seed) captioned with its parameters."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 640})
            page.goto(dp_server.url + "/")
            page.get_by_label("API key").fill(KEY)
            page.get_by_label("API key").press("Tab")  # its change event: the page keeps the key and asks again
            page.get_by_text("paradiff-demo: images").wait_for(timeout=30_000)
            assert page.locator("#size option").all_inner_texts()[0] == "64x64"
            assert page.get_by_label("Steps").input_value() == "4"
            page.get_by_label("Prompt").fill(PROMPTS[0])
            page.get_by_label("Seed").fill("5")
            page.get_by_role("button", name="Generate").click()
            page.get_by_role("progressbar").wait_for(state="visible", timeout=30_000)
            page.wait_for_function("document.querySelector('[role=progressbar]').getAttribute('aria-valuenow')"
                                   " === '100'", timeout=120_000)
            image = page.locator("#gallery figure img").first
            image.wait_for(state="visible", timeout=30_000)
            assert page.evaluate("(image) => image.complete && image.naturalWidth", image.element_handle()) == 64
            source = image.get_attribute("src")
            assert source.startswith("data:image/png;base64,")
            assert_same_picture(base64.b64decode(source.split(",", 1)[1]), generated[(PROMPTS[0], 5, 4)])
            text = page.locator("#gallery figcaption").first.inner_text()
            assert text.startswith(PROMPTS[0]) and all(part in text for part in ("size 64x64", "steps 4", "seed 5"))
            assert page.locator("#status").inner_text() == "done" and not page.locator("#keybox").is_visible()
        finally:
            browser.close()
