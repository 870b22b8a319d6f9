"""`paradiff serve` with adapters per request (serve/adapters.py), in vLLM's convention: --lora-modules at start,
/v1/load_lora_adapter and /v1/unload_lora_adapter at run time, each adapter its own model id."""

from __future__ import annotations

import base64
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from paradiff.demo import LORA_FILE
from paradiff_testkit.serve import ServerProcess, images_of

pytestmark = pytest.mark.slow

PROMPT = "a red circle on a blue background, top left"


def test_adapters_load_and_unload_at_run_time_while_requests_run(tmp_path):
    root = tmp_path / "loras"
    root.mkdir()
    shutil.copy(LORA_FILE, root / "swap2.safetensors")
    (tmp_path / "outside.safetensors").write_bytes(LORA_FILE.read_bytes())
    server = ServerProcess(tmp_path, "--steps", "2", "--max-batch", "4", "--batch-window", "0.5",
                           "--lora-modules", f"swap={LORA_FILE}", "--allow-runtime-lora", "--lora-root", str(root),
                           "--max-loras", "2")
    try:
        server.wait_ready()
        base = server.client.get("/v1/models").json()["data"][0]["id"]
        assert [m["id"] for m in server.client.get("/v1/models").json()["data"]] == [base, "swap"]
        load = server.client.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "swap2.safetensors"})
        assert load.status_code == 200, load.text
        outside = server.client.post("/v1/load_lora_adapter",
                                     json={"lora_name": "x", "lora_path": "../outside.safetensors"})
        assert outside.status_code == 403 and "outside --lora-root" in outside.json()["error"]["message"]
        assert "late" in [m["id"] for m in server.client.get("/v1/models").json()["data"]]

        models = [base, "swap", "late", "swap"]
        answered = answered_total(server.metrics())
        with ThreadPoolExecutor(len(models)) as pool:
            futures = [pool.submit(server.generate, prompt=PROMPT, seed=3, model=model) for model in models]
            # unloaded once every request is accepted (waiting, running or answered: not when the first one is, which
            # under load can be before the "late" one arrives, refused 404), while its request waits or runs: that
            # request is still answered (it carries its file)
            server.wait_for(lambda m: m.get("paradiff_queue_depth", 0) + m.get("paradiff_requests_running", 0)
                            + answered_total(m) - answered >= len(models))
            unload = server.client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
            answers = [images_of(future.result()) for future in futures]
        assert unload.status_code == 200, unload.text
        assert answers[1] == answers[3] and answers[1] != answers[0]  # the adapter changes the picture
        assert answers[2] == answers[1]  # the same file under another name: the same picture
        gone = server.generate(prompt=PROMPT, seed=3, model="late")
        assert gone.status_code == 404, gone.text
        # `model` selects the adapter on a streamed generation (the same bytes as unstreamed) and on an edit
        from openai import OpenAI

        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        events = list(client.images.generate(model="swap", prompt=PROMPT, stream=True, extra_body={"seed": 3}))
        assert base64.b64decode(events[-1].b64_json) == answers[1][0]
        edits = [client.images.edit(model=model, image=("in.png", answers[0][0], "image/png"), prompt=PROMPT,
                                    extra_body={"seed": 3}) for model in (base, "swap")]
        assert edits[0].data[0].b64_json != edits[1].data[0].b64_json
        streamed = list(client.images.edit(model="swap", image=("in.png", answers[0][0], "image/png"), prompt=PROMPT,
                                           stream=True, extra_body={"seed": 3}))
        assert [event.type for event in streamed] == ["image_edit.completed"]  # 2 steps: no preview to make
        assert streamed[0].b64_json == edits[1].data[0].b64_json
        # an adapter file changed or removed since it was named: that request's 409, the server goes on
        for name, change in (("mut", lambda path: path.write_bytes(path.read_bytes() + b" ")),
                             ("removed", lambda path: path.unlink())):
            shutil.copy(LORA_FILE, root / f"{name}.safetensors")
            assert server.client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path":
                                      f"{name}.safetensors"}).status_code == 200
            change(root / f"{name}.safetensors")
            refused = server.generate(prompt=PROMPT, seed=3, model=name)
            assert refused.status_code == 409 and name in refused.json()["error"]["message"], refused.text
        assert server.client.get("/health").json() == {"status": "ready"}
        # an adapter for modules this model lacks: refused when named, not at each request
        from safetensors.torch import save_file
        import torch

        save_file({"transformer.nonexistent.lora_A.weight": torch.zeros(4, 8),
                   "transformer.nonexistent.lora_B.weight": torch.zeros(8, 4)}, str(root / "foreign.safetensors"))
        foreign = server.client.post("/v1/load_lora_adapter", json={"lora_name": "foreign",
                                                                     "lora_path": "foreign.safetensors"})
        assert foreign.status_code == 400 and "nonexistent" in foreign.json()["error"]["message"], foreign.text
        again = server.client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert again.status_code == 404
        log = [entry for entry in server.log() if entry.get("id") is not None and entry["status"] == 200]
        # the four together, then the streamed "swap", the base and "swap" edits, the streamed "swap" edit
        assert sorted(entry["adapter"] or "" for entry in log) == ["", "", "late"] + ["swap"] * 5
        assert all(entry["batch"] for entry in log)
        assert server.text().count("ready") == 1  # loaded once: no reload for any adapter
    finally:
        assert server.stop() == 0, server.text()


def answered_total(samples: dict[str, float]) -> float:
    """Requests the server has answered (any status), from /metrics."""
    return sum(value for name, value in samples.items() if name.startswith("paradiff_requests_total{"))
