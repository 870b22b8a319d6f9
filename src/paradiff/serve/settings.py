"""Everything a `paradiff serve` server is configured with, typed: the `LoadSpec` each replica loads
(api/load_spec.py) and the server's own settings (address, key, queue, limits, request defaults, adapters, folders,
Ray). Checked when built: each bad value is a `ServeSettingsError` naming the setting, its value and what would be
valid, before any rank starts or any weight is read. The command builds one from its flags (cli/serve.py:
settings_of); a library user builds one directly:

    from paradiff.api.load_spec import LoadSpec
    from paradiff.serve.settings import ServeSettings

    settings = ServeSettings(LoadSpec("path/to/pipeline"), port=8001, steps=8, max_batch=2)

Derived values (the request limits a server was not given) are computed here and only here: `limit_side`,
`limit_steps`, `limit_frames`."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from paradiff.api.load_spec import LoadSpec
from paradiff.errors import ServeSettingsError

SCHEDULES = ("fair", "fifo")
PREVIEWS = ("linear", "vae", "off")
RAY_ROUTES = ("none", "prompt-hash", "adapter")
# Ray Serve's ingress: its HTTP proxy (a Python actor: ~9 ms a request on this machine), or HAProxy in front of the
# ingress replicas' own HTTP ports (~1 ms; Ray 2.60's experimental HAProxy mode; a local cluster only)
RAY_INGRESSES = ("proxy", "haproxy")


def _text(value: Any) -> str:
    """A value inside an error message's template (whose {braces} name settings)."""
    return str(value).replace("{", "{{").replace("}", "}}")


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """A server's configuration. `spec`: what each replica loads (its `parallel.data_degree` replicas). `model_name`:
    the model id the server answers to ("" : the model folder's name). Address and access: `host`, `port`,
    `api_key` (None: none, unless PARADIFF_API_KEY is set), `allow_host` / `allow_origin` (Host names and browser
    origins served besides loopback). Queue: `max_batch` images per pipeline call, `batch_window` seconds an idle
    server waits for more, `max_queue`, `schedule` (fair | fifo), `max_wait` (the longest expected wait a request is
    queued for; None: any), `request_timeout`. Limits (None: derived, see `limit_side` ...): `max_n`, `max_side`,
    `max_steps`, `max_frames`; `max_body_bytes`, `read_timeout` (seconds a client may take to send its request).
    Request defaults: `width`, `height`, `steps`, `guidance_scale`, `true_cfg_scale`, `negative_prompt`, `frames`
    (None: the pipeline's own), `fps`; `extra_call_kwargs`: pipeline call arguments every call gets (the embedded demo
    pipeline's prompt length). `previews`: linear | vae | off. Folders: `out` (requests.jsonl, previews, jobs.db);
    `jobs_db`: the video jobs' store, a file or a database URL (None: jobs.db in `out`); `keep_results` (a count, or
    an age: 30m, 12h, 7d). Adapters per request: `lora_modules` (NAME=PATH), `allow_runtime_lora`, `lora_root`,
    `max_loras`, `max_lora_rank`. `timeout`: the ranks' collective timeout in seconds. Ray Serve: `ray`,
    `ray_replicas` (min, max), `ray_route`, `ray_address`, `ray_ingress`."""

    spec: LoadSpec
    model_name: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allow_host: tuple[str, ...] = ()
    allow_origin: tuple[str, ...] = ()
    max_batch: int = 1
    batch_window: float = 0.0
    max_queue: int = 64
    schedule: str = "fair"
    max_wait: float | None = None
    request_timeout: float = 600.0
    max_n: int = 4
    max_side: int | None = None
    max_steps: int | None = None
    max_frames: int | None = None
    max_body_bytes: int = 1 << 20
    read_timeout: float = 10.0
    width: int = 64
    height: int = 64
    steps: int = 4
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    negative_prompt: str | None = None
    frames: int | None = None
    fps: int = 16
    extra_call_kwargs: tuple[tuple[str, Any], ...] = ()
    previews: str = "linear"
    out: str = "out/serve"
    jobs_db: str | None = None
    keep_results: str = "100"
    lora_modules: tuple[str, ...] = ()
    allow_runtime_lora: bool = False
    lora_root: str | None = None
    max_loras: int = 4
    max_lora_rank: int = 64
    timeout: float = 600.0
    ray: bool = False
    ray_replicas: tuple[int, int] = (1, 1)
    ray_route: str = "none"
    ray_address: str | None = None
    ray_ingress: str = "proxy"

    def __post_init__(self) -> None:
        for name in ("allow_host", "allow_origin", "lora_modules"):  # a list (or one string) kept as a tuple
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value or ()))
        extra = self.extra_call_kwargs
        object.__setattr__(self, "extra_call_kwargs", tuple(extra.items() if isinstance(extra, dict) else extra))
        object.__setattr__(self, "ray_replicas", tuple(self.ray_replicas))
        self._check()

    # -- as JSON: for the process that hosts the frontend of ranks started elsewhere (Ray's Mesh replica) ---------
    def as_json(self) -> dict:
        """These settings as JSON data (`from_json` reads them back; no pickle): the ranks of a mesh under Ray Serve
        parse its flags, and its rank 0 hands the settings to the Ray replica that runs its frontend (serve/ray.py).
        The parallel degrees travel as numbers (a device mesh object does not)."""
        import json

        spec, parallel = self.spec, self.spec.parallel
        tp, cp = parallel.tensor_parallel_config, parallel.context_parallel_config
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "spec"}
        fields["spec"] = {field.name: getattr(spec, field.name) for field in dataclasses.fields(spec)
                          if field.name not in ("parallel", "loras")}
        fields["spec"].update(loras=[lora.as_dict() for lora in spec.loras], parallel={
            "tp": tp.tp_degree if tp else 1, "ring": cp.ring_degree if cp else 1,
            "ulysses": cp.ulysses_degree if cp else 1, "cfg": parallel.cfg_degree, "data": parallel.data_degree,
            "fsdp": parallel.fsdp_degree, "fsdp_offload": parallel.fsdp_offload})
        return json.loads(json.dumps(fields))  # tuples as lists; a value JSON cannot hold fails here, not later

    @classmethod
    def from_json(cls, fields: dict) -> "ServeSettings":
        """The settings `as_json` wrote, checked again as any settings are."""
        from paradiff.api.load_spec import LoraSpec
        from paradiff.config import ParallelConfig

        fields, spec = dict(fields), dict(fields["spec"])
        del fields["spec"]
        spec.update(parallel=ParallelConfig.from_degrees(**spec["parallel"]),
                    loras=tuple(LoraSpec(**lora) for lora in spec["loras"]),
                    gguf=tuple(tuple(pair) for pair in spec["gguf"]))
        fields["extra_call_kwargs"] = tuple(tuple(pair) for pair in fields["extra_call_kwargs"])
        return cls(LoadSpec(**spec), **fields)

    # -- derived values: the one place they are computed ----------------------------------------------------------
    @property
    def limit_side(self) -> int:
        """`max_side`, or twice the default size (rounded down to a multiple of 16): a request may not ask for more
        than four times the pixels the server was started for."""
        return self.max_side if self.max_side is not None else max(16, 2 * max(self.width, self.height) // 16 * 16)

    @property
    def limit_steps(self) -> int:
        """`max_steps`, or twice the default steps."""
        return self.max_steps if self.max_steps is not None else 2 * self.steps

    @property
    def limit_frames(self) -> int:
        """`max_frames`, or twice `frames` (257 where the pipeline's own default count is used)."""
        if self.max_frames is not None:
            return self.max_frames
        return 2 * self.frames if self.frames else 257

    @property
    def served_name(self) -> str:
        """The model id the server answers to: `model_name`, else the model folder's (or Hub id's) last part."""
        return self.model_name or os.path.basename(os.path.normpath(self.spec.model))

    @property
    def jobs_where(self) -> str:
        """The video jobs' store: `jobs_db` (a file path or a database URL), or jobs.db in `out`."""
        return self.jobs_db or str(Path(self.out) / "jobs.db")

    def call_kwargs(self) -> dict:
        """The arguments every pipeline call starts from (a request's own size, steps, guidance... replace them)."""
        from paradiff.api.pipeline_call import call_kwargs

        return call_kwargs(self.height, self.width, self.steps, self.guidance_scale, self.true_cfg_scale,
                           self.negative_prompt, self.frames, dict(self.extra_call_kwargs))

    # -- checks ---------------------------------------------------------------------------------------------------
    def _check(self) -> None:
        if not isinstance(self.spec, LoadSpec):
            raise ServeSettingsError("spec", self.spec, f"{{spec}} {_text(type(self.spec).__name__)}: expected a "
                                     "LoadSpec (paradiff.api.load_spec), what each replica loads")
        if not isinstance(self.host, str) or not self.host:
            raise ServeSettingsError("host", self.host, f"{{host}} {_text(repr(self.host))}: expected an address "
                                     "to bind, e.g. 127.0.0.1")
        if not _whole(self.port) or not 1 <= self.port <= 65535:
            raise ServeSettingsError("port", self.port, f"{{port}} {_text(self.port)}: expected a TCP port from 1 "
                                     "to 65535")
        for name in ("max_batch", "max_queue", "max_n", "max_body_bytes", "width", "height", "steps", "fps",
                     "max_loras", "max_lora_rank"):
            self._positive(name, getattr(self, name))
        for name in ("max_side", "max_steps", "max_frames", "frames"):
            if getattr(self, name) is not None:
                self._positive(name, getattr(self, name))
        if not _number(self.batch_window) or not 0 <= self.batch_window <= 10:
            raise ServeSettingsError("batch_window", self.batch_window, f"{{batch_window}} "
                                     f"{_text(self.batch_window)}: expected seconds from 0 to 10")
        self._choice("schedule", SCHEDULES)
        if self.ray:
            low, high = (*self.ray_replicas, 0, 0)[:2]
            if len(self.ray_replicas) != 2 or not (_whole(low) and _whole(high) and 1 <= low <= high):
                raise ServeSettingsError("ray_replicas", self.ray_replicas, f"{{ray_replicas}} "
                                         f"{_text(self.ray_replicas)}: expected (MIN, MAX), whole numbers from 1 "
                                         "with MIN <= MAX")
            self._choice("ray_route", RAY_ROUTES)
            self._choice("ray_ingress", RAY_INGRESSES)
        if self.max_wait is not None and (not _number(self.max_wait) or self.max_wait <= 0):
            raise ServeSettingsError("max_wait", self.max_wait, f"{{max_wait}} {_text(self.max_wait)}: expected a "
                                     "number of seconds > 0")
        if not _number(self.request_timeout) or self.request_timeout <= 0:
            raise ServeSettingsError("request_timeout", self.request_timeout, f"{{request_timeout}} "
                                     f"{_text(self.request_timeout)}: expected a number of seconds > 0")
        if not _number(self.timeout) or not 0 < self.timeout < float("inf"):
            raise ServeSettingsError("timeout", self.timeout, f"{{timeout}} {_text(self.timeout)}: expected a "
                                     "number of seconds above 0 (and finite)")
        if self.max_steps is not None and self.steps > self.max_steps:
            raise ServeSettingsError("steps", self.steps, f"{{steps}} {self.steps} is above {{max_steps}} "
                                     f"{self.max_steps}")
        if self.max_side is not None and max(self.width, self.height) > self.max_side:
            raise ServeSettingsError("width", self.width, f"{{width}} {self.width} / {{height}} {self.height}: "
                                     f"above {{max_side}} {self.max_side}")
        if self.max_frames is not None and self.frames is not None and self.frames > self.max_frames:
            raise ServeSettingsError("frames", self.frames, f"{{frames}} {self.frames} is above {{max_frames}} "
                                     f"{self.max_frames}")
        if not _number(self.read_timeout) or not 0 < self.read_timeout <= 600:
            raise ServeSettingsError("read_timeout", self.read_timeout, f"{{read_timeout}} "
                                     f"{_text(self.read_timeout)}: expected seconds above 0, at most 600")
        for origin in self.allow_origin:
            if not isinstance(origin, str) or not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ServeSettingsError("allow_origin", origin, f"{{allow_origin}} {_text(repr(origin))}: expected "
                                         "a page origin, SCHEME://HOST[:PORT] with no path, e.g. "
                                         "https://app.example.com")
        for name in self.allow_host:
            if not isinstance(name, str) or not name:
                raise ServeSettingsError("allow_host", name, f"{{allow_host}} {_text(repr(name))}: expected a Host "
                                         "name, NAME[:PORT]")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ServeSettingsError("api_key", "", "{api_key} is empty; give a key, or leave it out for a server "
                                     "without one")
        self._choice("previews", PREVIEWS)
        from paradiff.serve.jobs import keep_results

        try:
            keep_results(self.keep_results)
        except ValueError:
            raise ServeSettingsError("keep_results", self.keep_results, f"{{keep_results}} "
                                     f"{_text(repr(self.keep_results))}: expected a positive count of results (e.g. "
                                     "100) or an age (e.g. 30m, 12h, 7d)") from None
        for module in self.lora_modules:
            name, sep, path = str(module).partition("=")
            if not sep or not name or not path:
                raise ServeSettingsError("lora_modules", module, f"{{lora_modules}} {_text(module)}: expected "
                                         "NAME=PATH, e.g. style=/loras/style.safetensors")

    def _positive(self, name: str, value: Any) -> None:
        if not _whole(value) or value < 1:
            raise ServeSettingsError(name, value, f"{{{name}}} {_text(value)}: expected a positive integer")

    def _choice(self, name: str, valid: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in valid:
            raise ServeSettingsError(name, value, f"{{{name}}} {_text(repr(value))}: expected one of "
                                     f"{', '.join(valid)}")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN
