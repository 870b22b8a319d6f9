"""The requests `paradiff serve` takes, checked before they are queued: a bad field is a 4xx naming it and what is
valid, and never reaches a rank."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

BASE_FIELDS = {"model", "prompt", "n", "size", "response_format", "seed", "steps", "guidance", "negative_prompt",
               "true_cfg_scale", "user", "loras"}
# OpenAI's image fields that change nothing here (docs/serve.md), with the values OpenAI takes: another is a 400
IGNORED_FIELDS = {"quality": ("auto", "standard", "hd", "low", "medium", "high", "xhigh", "max"),
                  "style": ("vivid", "natural"), "background": ("auto", "opaque", "transparent"),
                  "moderation": ("auto", "low"), "complexity": ("low", "medium", "high"),
                  "input_fidelity": ("low", "high"), "safety_identifier": None}
OUTPUT_FORMATS = ("png", "jpeg", "webp")
STREAM_FIELDS = {"stream", "partial_images"}  # generations streamed with previews (serve/stream.py)
IMAGE_FIELDS = BASE_FIELDS | set(IGNORED_FIELDS) | {"output_format", "output_compression"} | STREAM_FIELDS
EDIT_FIELDS = IMAGE_FIELDS | {"strength"}  # and the files: image (or image[]), mask
VIDEO_FIELDS = BASE_FIELDS | {"frames", "fps"}
ENDPOINTS = {"image": "/v1/images/generations", "edit": "/v1/images/edits", "video": "/v1/videos"}
MAX_SEED = 2**63 - 1
MAX_PARTIAL_IMAGES = 3  # OpenAI's bound on partial_images
# request field -> the pipeline call's parameter it sets (refused where the pipeline's __call__ lacks it)
CALL_PARAMETERS = {"guidance": "guidance_scale", "true_cfg_scale": "true_cfg_scale",
                   "negative_prompt": "negative_prompt", "frames": "num_frames"}


class RequestError(Exception):
    """A request the server refuses: `status` is the HTTP code, the message says what is wrong and what is valid,
    `param` the request field at fault (None when no one field is), `code` a short string (default: the status's);
    `retry_after`: seconds worth waiting before a retry (sent as Retry-After), where known."""

    retry_after: int | None = None

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


# OpenAI's error shape: {"error": {"message", "type", "param", "code"}}; type and code (strings) from the status
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               503: "service_unavailable_error", 504: "timeout_error"}
ERROR_CODES = {400: "invalid_request", 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
               405: "method_not_allowed", 408: "request_timeout", 409: "conflict", 413: "request_too_large",
               415: "unsupported_media_type", 431: "request_header_fields_too_large", 499: "client_closed_request",
               500: "server_error", 503: "service_unavailable", 504: "request_timeout"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON body of an error answer, in OpenAI's shape (`code` a string, as OpenAI's)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": code or ERROR_CODES.get(status, str(status))}}


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
    inputs: frozenset = frozenset()  # which of "image", "mask", "strength" the pipeline's call takes (edits)
    pipeline: str = ""  # the pipeline's class name


@dataclass(frozen=True)
class ImageRequest:
    prompt: str
    n: int
    width: int
    height: int
    seed: int | None  # None: the frontend draws one (app.Frontend.generate) before the request is queued
    steps: int
    guidance: float | None
    negative_prompt: str | None
    true_cfg_scale: float | None = None
    kind: str = "image"
    frames: int | None = None
    fps: int = 16
    loras: tuple = ()  # ((adapter name, scale), ...) active for this request; () = none
    output_format: str = "png"  # png, jpeg or webp: rank 0 re-encodes the ranks' PNG (serve/images.py)
    output_compression: int = 100  # the JPEG / WebP quality
    images: tuple = ()  # an edit's uploaded images (bytes, checked by serve/images.py)
    mask: bytes | None = None
    strength: float | None = None
    stream: bool = False  # answered as server-sent events (serve/stream.py)
    partial_images: int = 0  # previews streamed while it is denoised
    adapter: tuple = ()  # ("name", "path", "sha256") of the adapter `model` named (serve/adapters.py); () = none

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one pipeline call (each keeps its own prompt and seeds)."""
        return (self.kind, self.width, self.height, self.steps, self.guidance, self.negative_prompt,
                self.true_cfg_scale, self.frames, self.loras, self.images, self.mask, self.strength)

    def seeds(self) -> list[int]:
        """Image i of the request uses seed + i, as `paradiff generate` does for prompt i."""
        return [self.seed + i for i in range(self.n)]


def quoted(value: Any, limit: int = 60) -> str:
    """A client's value as an error message quotes it: its repr, cut to `limit` characters (a 300-digit number or a
    5000-character id is not echoed whole)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def _whole(value: Any) -> Any:
    """An integral JSON number as an int (JSON, and JSON Schema's "integer", make no difference between 1 and 1.0);
    anything else as it is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _integer(body: dict, name: str, default: int, low: int, high: int) -> int:
    """An integer field; absent or null: `default` (OpenAI takes null as "the default")."""
    value = body.get(name)
    value = default if value is None else _whole(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"{name}: expected an integer from {low} to {high}, got {quoted(value)}", name)
    if not low <= value <= high:
        raise RequestError(400, f"{name} {quoted(value)} is out of bounds: expected {low} to {high}", name)
    return value


def _number(body: dict, name: str, default: float | None) -> float | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
        raise RequestError(400, f"{name}: expected a number from 0 to 100, got {quoted(value)}", name)
    return float(value)


def parse_image_request(body: Any, limits: Limits, kind: str = "image") -> ImageRequest:
    """A POST /v1/images/generations (kind "image"), /v1/images/edits' fields but its files ("edit": their checks
    are serve/images.py's) or /v1/videos ("video") body as an ImageRequest, or a RequestError naming the field and
    what is valid."""
    endpoint = ENDPOINTS[kind]
    if ("video" if kind == "video" else "image") != limits.kind:
        other = ENDPOINTS["image" if limits.kind == "image" else "video"]
        raise RequestError(400, f"{endpoint}: this server's pipeline makes {limits.kind}s; use {other}")
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(body).__name__}")
    fields = {"image": IMAGE_FIELDS, "edit": EDIT_FIELDS, "video": VIDEO_FIELDS}[kind]
    unknown = sorted(set(body) - fields)
    if unknown:
        raise RequestError(400, f"unknown field(s) {unknown}; valid fields: {sorted(fields)}", unknown[0],
                           "unknown_parameter")
    for name, parameter in CALL_PARAMETERS.items():
        if body.get(name) is not None and parameter not in limits.accepts:
            raise RequestError(400, f"{name}: this pipeline's call takes no {parameter}", name)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError(400, "prompt: expected a non-empty string", "prompt")
    _unicode("prompt", prompt)
    if len(prompt) > limits.max_prompt_chars:
        raise RequestError(400, f"prompt is {len(prompt)} characters long; at most {limits.max_prompt_chars}",
                           "prompt")
    model = body.get("model")
    if model is not None and model != limits.model_name:
        raise RequestError(404, f"model {quoted(model)} is not served here; this server serves {limits.model_name!r}",
                           "model", "model_not_found")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(400, f"user: expected a string, got {quoted(user)}", "user")
    response_format = body.get("response_format")
    if response_format not in (None, "b64_json"):
        raise RequestError(400, f"response_format {quoted(response_format)}: only 'b64_json' is served (no URLs)",
                           "response_format")
    for name, valid in IGNORED_FIELDS.items():
        value = body.get(name)
        if value is not None and not (isinstance(value, str) and (valid is None or value in valid)):
            expected = f"one of {list(valid)}" if valid else "a string"
            raise RequestError(400, f"{name} {quoted(value)}: expected {expected} (accepted, and ignored here: "
                                    "docs/serve.md)", name)
    output_format = body.get("output_format")
    output_format = "png" if output_format is None else output_format
    if not isinstance(output_format, str) or output_format not in OUTPUT_FORMATS:
        raise RequestError(400, f"output_format {quoted(output_format)}: expected one of {list(OUTPUT_FORMATS)}",
                           "output_format")
    compression = 100 if body.get("output_compression") is None else _integer(body, "output_compression", 100, 0,
                                                                                100)
    width, height = _size(body.get("size"), limits)
    negative = body.get("negative_prompt")
    if negative is not None and (not isinstance(negative, str) or len(negative) > limits.max_prompt_chars):
        raise RequestError(400, f"negative_prompt: expected a string of at most {limits.max_prompt_chars} characters",
                           "negative_prompt")
    if negative is not None:
        _unicode("negative_prompt", negative)
    seed = _whole(body.get("seed"))
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise RequestError(400, f"seed: expected an integer from 0 to 2**63 - 1, got {quoted(seed)}", "seed")
    loras = _loras(body.get("loras"), limits)
    frames = fps = None
    if kind == "video":
        frames = body.get("frames", limits.default_frames)
        if frames is not None:
            frames = _integer(body, "frames", limits.default_frames, 1, limits.max_frames)
        fps = _integer(body, "fps", limits.default_fps, 1, 120)
    n = _integer(body, "n", 1, 1, limits.max_n)
    if seed is not None and seed + n - 1 > MAX_SEED:  # image i uses seed + i
        raise RequestError(400, f"seed {seed}: image {n - 1} would use seed {seed + n - 1}, above 2**63 - 1", "seed")
    strength = _number(body, "strength", None) if kind == "edit" else None
    if strength is not None and not 0 <= strength <= 1:
        raise RequestError(400, f"strength {strength:g}: expected a number from 0 to 1", "strength")
    stream, partial_images = _stream(body) if kind in ("image", "edit") else (False, 0)
    return ImageRequest(prompt=prompt, n=n, width=width, height=height, seed=seed,
                        steps=_integer(body, "steps", limits.default_steps, 1, limits.max_steps),
                        guidance=_number(body, "guidance", limits.default_guidance), negative_prompt=negative,
                        true_cfg_scale=_number(body, "true_cfg_scale", limits.default_true_cfg), kind=kind,
                        frames=frames, fps=fps or limits.default_fps, loras=loras, output_format=output_format,
                        output_compression=compression, strength=strength, stream=stream,
                        partial_images=partial_images)


def _stream(body: dict) -> tuple[bool, int]:
    """`stream` (a boolean) and `partial_images` (0 to 3; without stream it asks nothing), as OpenAI's
    images.generate takes them."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(400, f"stream: expected true or false, got {quoted(stream)}", "stream")
    if body.get("partial_images") is None:
        return stream, 0
    partial = _integer(body, "partial_images", 0, 0, MAX_PARTIAL_IMAGES)
    return stream, partial if stream else 0


def _unicode(name: str, text: str) -> None:
    """JSON can carry a lone UTF-16 surrogate ("\\ud800"), which no tokenizer reads: the request's error, not a
    rank's."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(400, f"{name}: not valid Unicode text (a lone surrogate at character {exc.start}); "
                                "send UTF-8 text", name) from None


def _loras(value: Any, limits: Limits) -> tuple:
    """`loras`: {adapter name: scale} among the adapters the server loaded (--lora); absent: those, at their start
    scales; {}: none."""
    if value is None:
        return tuple(limits.adapters)
    available = [name for name, _ in limits.adapters]
    if not isinstance(value, dict):
        raise RequestError(400, f"loras: expected an object {{adapter name: scale}}; adapters here: {available}",
                           "loras")
    unknown = sorted(set(value) - set(available))
    if unknown:
        raise RequestError(400, f"loras: no adapter(s) {unknown} on this server; adapters here: {available} "
                                "(loaded at start with --lora)", "loras")
    for name, scale in value.items():
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not -10 <= scale <= 10:
            raise RequestError(400, f"loras: the scale of {quoted(name)} must be a number from -10 to 10, got "
                                    f"{quoted(scale)}", "loras")
    return tuple((name, float(value[name])) for name in available if name in value)


def _size(value: Any, limits: Limits) -> tuple[int, int]:
    if value is None or value == "auto":  # OpenAI's "auto": the server's default size
        return limits.default_size
    usage = (f"expected 'WIDTHxHEIGHT' with both multiples of {limits.size_multiple} from {limits.size_multiple} "
             f"to {limits.max_side}, e.g. '{limits.default_size[0]}x{limits.default_size[1]}'")
    parts = re.fullmatch(r"([0-9]{1,6})x([0-9]{1,6})", value) if isinstance(value, str) else None  # ASCII digits
    if parts is None:
        raise RequestError(400, f"size {quoted(value)}: {usage}", "size")
    width, height = int(parts.group(1)), int(parts.group(2))
    for side in (width, height):
        if side < limits.size_multiple or side > limits.max_side or side % limits.size_multiple:
            raise RequestError(400, f"size {quoted(value)}: {usage}", "size")
    return width, height


def with_seed(request: ImageRequest) -> ImageRequest:
    """A request without a seed gets a fresh random one, drawn on rank 0 before it is queued (so every rank runs the
    same), and returned in the answer (each image's `seed`) so that any image can be drawn again."""
    import secrets
    from dataclasses import replace

    return request if request.seed is not None else replace(request, seed=secrets.randbelow(2**32))
