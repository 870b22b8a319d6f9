"""A `paradiff serve` command in a process of its own (paradiff_testkit/command.py), for the server tests and the serve benchmark: started on a free port,
waited for (bounded), asked, stopped with SIGTERM."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from paradiff.distributed.spawn import free_port
from paradiff_testkit import command


class ServerProcess:
    """`python -m MODULE serve ARGS --port P --out FOLDER/serve`; the console goes to FOLDER/console.txt. Forked
    from the tests' preloaded server (paradiff_testkit/command.py) unless `fresh` (a new interpreter, as a user starts it)."""

    def __init__(self, folder: Path, *args: str, env: dict | None = None, module: str = "paradiff.cli",
                 fresh: bool = False) -> None:
        import httpx

        self.port = free_port()
        self.out = Path(folder) / "serve"
        self.console = Path(folder) / "console.txt"
        self.url = f"http://127.0.0.1:{self.port}"
        self.console.write_bytes(b"")
        self.process = command.start(["-m", module, "serve", "--port", str(self.port), "--out", str(self.out), *args],
                                     env=dict(os.environ, **(env or {})), output=self.console, fresh=fresh)
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def wait_ready(self, timeout_s: float = 240) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited ({self.process.returncode}): {self.text()}")
            try:
                if self.client.get("/health").json()["status"] == "ready":
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"not ready within {timeout_s:.0f} s: {self.text()}")

    def metrics(self) -> dict[str, float]:
        """/metrics' samples by name, labels included: `paradiff_queue_depth`, `paradiff_requests_total{status="200"}`."""
        samples = {}
        for line in self.client.get("/metrics").text.splitlines():
            name, _, value = line.rpartition(" ")
            if name and not line.startswith("#"):
                samples[name] = float(value)
        return samples

    def wait_for(self, condition, timeout_s: float = 60) -> dict[str, float]:
        """Poll /metrics (bounded) until `condition(samples)` holds: a test acts on a state of the server it has seen,
        not on a guess of how long the server takes to get there."""
        deadline = time.monotonic() + timeout_s
        while True:
            samples = self.metrics()
            if condition(samples):
                return samples
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the server never reached the state awaited within {timeout_s:.0f} s (last "
                                     f"metrics: {samples}): {self.text()}")
            time.sleep(0.02)

    def generate(self, headers: dict | None = None, **body):
        return self.client.post("/v1/images/generations", json=body, headers=headers)

    def text(self) -> str:
        return self.console.read_text(errors="replace")

    def log(self) -> list[dict]:
        """requests.jsonl: one entry per answered request."""
        path = self.out / "requests.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM (drain, then exit); killed if it is not gone after `timeout_s`. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"the server did not stop within {timeout_s:.0f} s of SIGTERM: {self.text()}")
        finally:
            self.client.close()


def images_of(response) -> list[bytes]:
    """The decoded files of a 200 answer (AssertionError with the body otherwise)."""
    if response.status_code != 200:
        raise AssertionError(f"{response.status_code}: {response.text}")
    return [base64.b64decode(item["b64_json"]) for item in response.json()["data"]]
