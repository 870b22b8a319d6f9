"""The requests `paradiff serve` takes, checked before they are queued: a bad field is a 4xx naming it and what is
valid, and never reaches a rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IMAGE_FIELDS = {"model", "prompt", "n", "size", "response_format", "seed", "steps", "guidance", "negative_prompt",
                "true_cfg_scale", "user", "loras"}
VIDEO_FIELDS = IMAGE_FIELDS | {"frames", "fps"}
# request field -> the pipeline call's parameter it sets (refused where the pipeline's __call__ lacks it)
CALL_PARAMETERS = {"guidance": "guidance_scale", "true_cfg_scale": "true_cfg_scale",
                   "negative_prompt": "negative_prompt", "frames": "num_frames"}


class RequestError(Exception):
    """A request the server refuses: `status` is the HTTP code, the message says what is wrong and what is valid;
    `retry_after`: seconds worth waiting before a retry (sent as Retry-After), where known."""

    retry_after: int | None = None

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    max_n: int = 4
    max_steps: int = 50
    max_prompt_chars: int = 2000
    max_side: int = 2048
    size_multiple: int = 16
    default_size: tuple[int, int] = (64, 64)  # (width, height)
    default_steps: int = 4
    default_guidance: float | None = None
    default_true_cfg: float | None = None
    default_frames: int | None = None
    default_fps: int = 16
    max_frames: int = 257
    model_name: str = "paradiff"
    kind: str = "image"  # what the pipeline makes: "image" or "video"
    accepts: frozenset = frozenset()  # the parameters of the pipeline's __call__
    adapters: tuple = ()  # ((name, scale at start), ...): the LoRA adapters loaded with --lora


@dataclass(frozen=True)
class ImageRequest:
    prompt: str
    n: int
    width: int
    height: int
    seed: int
    steps: int
    guidance: float | None
    negative_prompt: str | None
    true_cfg_scale: float | None = None
    kind: str = "image"
    frames: int | None = None
    fps: int = 16
    loras: tuple = ()  # ((adapter name, scale), ...) active for this request; () = none

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one pipeline call (each keeps its own prompt and seeds)."""
        return (self.kind, self.width, self.height, self.steps, self.guidance, self.negative_prompt,
                self.true_cfg_scale, self.frames, self.loras)

    def seeds(self) -> list[int]:
        """Image i of the request uses seed + i, as `paradiff generate` does for prompt i."""
        return [self.seed + i for i in range(self.n)]


def _whole(value: Any) -> Any:
    """An integral JSON number as an int (JSON, and JSON Schema's "integer", make no difference between 1 and 1.0);
    anything else as it is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _integer(body: dict, name: str, default: int, low: int, high: int) -> int:
    value = _whole(body.get(name, default))
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"{name}: expected an integer from {low} to {high}, got {value!r}")
    if not low <= value <= high:
        raise RequestError(400, f"{name} {value} is out of bounds: expected {low} to {high}")
    return value


def _number(body: dict, name: str, default: float | None) -> float | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
        raise RequestError(400, f"{name}: expected a number from 0 to 100, got {value!r}")
    return float(value)


def parse_image_request(body: Any, limits: Limits, kind: str = "image") -> ImageRequest:
    """A POST /v1/images/generations (kind "image") or /v1/videos (kind "video") body as an ImageRequest, or a
    RequestError naming the field and what is valid."""
    endpoint = "/v1/images/generations" if kind == "image" else "/v1/videos"
    if kind != limits.kind:
        other = "/v1/images/generations" if limits.kind == "image" else "/v1/videos"
        raise RequestError(400, f"{endpoint}: this server's pipeline makes {limits.kind}s; use {other}")
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(body).__name__}")
    fields = IMAGE_FIELDS if kind == "image" else VIDEO_FIELDS
    unknown = sorted(set(body) - fields)
    if unknown:
        raise RequestError(400, f"unknown field(s) {unknown}; valid fields: {sorted(fields)}")
    for name, parameter in CALL_PARAMETERS.items():
        if body.get(name) is not None and parameter not in limits.accepts:
            raise RequestError(400, f"{name}: this pipeline's call takes no {parameter}")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError(400, "prompt: expected a non-empty string")
    _unicode("prompt", prompt)
    if len(prompt) > limits.max_prompt_chars:
        raise RequestError(400, f"prompt is {len(prompt)} characters long; at most {limits.max_prompt_chars}")
    model = body.get("model")
    if model is not None and model != limits.model_name:
        raise RequestError(404, f"model {model!r} is not served here; this server serves {limits.model_name!r}")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(400, f"user: expected a string, got {user!r}")
    response_format = body.get("response_format", "b64_json")
    if response_format != "b64_json":
        raise RequestError(400, f"response_format {response_format!r}: only 'b64_json' is served (no URLs)")
    width, height = _size(body.get("size"), limits)
    negative = body.get("negative_prompt")
    if negative is not None and (not isinstance(negative, str) or len(negative) > limits.max_prompt_chars):
        raise RequestError(400, f"negative_prompt: expected a string of at most {limits.max_prompt_chars} characters")
    if negative is not None:
        _unicode("negative_prompt", negative)
    seed = _whole(body.get("seed", 0))
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise RequestError(400, f"seed: expected an integer from 0 to 2**63 - 1, got {seed!r}")
    loras = _loras(body.get("loras"), limits)
    frames = fps = None
    if kind == "video":
        frames = body.get("frames", limits.default_frames)
        if frames is not None:
            frames = _integer(body, "frames", limits.default_frames, 1, limits.max_frames)
        fps = _integer(body, "fps", limits.default_fps, 1, 120)
    return ImageRequest(prompt=prompt, n=_integer(body, "n", 1, 1, limits.max_n), width=width, height=height,
                        seed=seed, steps=_integer(body, "steps", limits.default_steps, 1, limits.max_steps),
                        guidance=_number(body, "guidance", limits.default_guidance), negative_prompt=negative,
                        true_cfg_scale=_number(body, "true_cfg_scale", limits.default_true_cfg), kind=kind,
                        frames=frames, fps=fps or limits.default_fps, loras=loras)


def _unicode(name: str, text: str) -> None:
    """JSON can carry a lone UTF-16 surrogate ("\\ud800"), which no tokenizer reads: the request's error, not a
    rank's."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(400, f"{name}: not valid Unicode text (a lone surrogate at character {exc.start}); "
                                "send UTF-8 text") from None


def _loras(value: Any, limits: Limits) -> tuple:
    """`loras`: {adapter name: scale} among the adapters the server loaded (--lora); absent: those, at their start
    scales; {}: none."""
    if value is None:
        return tuple(limits.adapters)
    available = [name for name, _ in limits.adapters]
    if not isinstance(value, dict):
        raise RequestError(400, f"loras: expected an object {{adapter name: scale}}; adapters here: {available}")
    unknown = sorted(set(value) - set(available))
    if unknown:
        raise RequestError(400, f"loras: no adapter(s) {unknown} on this server; adapters here: {available} "
                                "(loaded at start with --lora)")
    for name, scale in value.items():
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not -10 <= scale <= 10:
            raise RequestError(400, f"loras: the scale of {name!r} must be a number from -10 to 10, got {scale!r}")
    return tuple((name, float(value[name])) for name in available if name in value)


def _size(value: Any, limits: Limits) -> tuple[int, int]:
    if value is None:
        return limits.default_size
    usage = (f"expected 'WIDTHxHEIGHT' with both multiples of {limits.size_multiple} from {limits.size_multiple} "
             f"to {limits.max_side}, e.g. '{limits.default_size[0]}x{limits.default_size[1]}'")
    if not isinstance(value, str) or value.count("x") != 1:
        raise RequestError(400, f"size {value!r}: {usage}")
    try:
        width, height = (int(part) for part in value.split("x"))
    except ValueError:
        raise RequestError(400, f"size {value!r}: {usage}") from None
    for side in (width, height):
        if side < limits.size_multiple or side > limits.max_side or side % limits.size_multiple:
            raise RequestError(400, f"size {value!r}: {usage}")
    return width, height
