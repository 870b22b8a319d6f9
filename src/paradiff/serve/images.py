"""What the image routes of `paradiff serve` do on rank 0 beyond the request checks of protocol.py: the output
format an answer is sent in, and POST /v1/images/edits' multipart form (its uploaded images checked before the
request is queued: a readable PNG / JPEG / WebP, within the body limit and a decoded pixel limit; kept in memory,
never written to disk).

The ranks make PNG bytes; rank 0 re-encodes them as JPEG or WebP when `output_format` asks (the same pixels, then
the encoder's own loss at `output_compression`, its quality).
"""

from __future__ import annotations

import io
from dataclasses import replace
from typing import Any

from paradiff.serve.protocol import ImageRequest, Limits, RequestError, parse_image_request, quoted

MIME_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
UPLOAD_FORMATS = ("PNG", "JPEG", "WEBP", "MPO")  # MPO: a phone camera's JPEG with more pictures after the first
MAX_IMAGES = 8  # uploaded images per edit
# form fields the openai client sends as text, read back as the numbers they were (extra_body's numbers included)
INTEGER_FIELDS = ("n", "seed", "steps", "output_compression", "partial_images")
NUMBER_FIELDS = ("guidance", "true_cfg_scale", "strength")


def encode_output(png: bytes, output_format: str, quality: int) -> bytes:
    """PNG bytes from a rank as `output_format` (png: unchanged)."""
    if output_format == "png":
        return png
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format=output_format.upper(), quality=quality)
    return buffer.getvalue()


def max_upload_pixels(limits: Limits) -> int:
    """An uploaded image's decoded pixels: at most four times the largest image the server makes (twice each side)."""
    return 4 * limits.max_side * limits.max_side


def check_upload(field: str, data: bytes, limits: Limits) -> tuple[int, int]:
    """(width, height) of an uploaded image, read from its header before any decoding, then decoded once to check it
    whole; a RequestError (400, naming `field`) for anything but a readable PNG / JPEG / WebP within the pixel
    limit."""
    from PIL import Image, UnidentifiedImageError

    from paradiff.io.images import upright_size

    limit = max_upload_pixels(limits)
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in UPLOAD_FORMATS:
                raise RequestError(400, f"{field}: a {image.format} image; send PNG, JPEG or WebP", field)
            width, height = upright_size(image)  # as the ranks read it (io/images.py)
            if min(width, height) < limits.size_multiple:  # a pipeline rounds a side down to its multiple: to 0
                raise RequestError(400, f"{field}: {width}x{height}; each side at least {limits.size_multiple} "
                                        "pixels", field)
            if width * height > limit:
                raise RequestError(400, f"{field}: {width}x{height} is {width * height} pixels; at most {limit} here "
                                        f"(four times --max-side {limits.max_side} squared)", field)
            image.load()
    except RequestError:
        raise
    except UnidentifiedImageError:
        raise RequestError(400, f"{field}: not a readable image (its bytes are no PNG, JPEG or WebP file); send "
                                "PNG, JPEG or WebP", field) from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        line = (str(exc).splitlines() or [""])[0][:200]
        raise RequestError(400, f"{field}: not a readable image ({type(exc).__name__}: {line}); send PNG, JPEG or "
                                "WebP", field) from None
    return width, height


def form_body(fields: list[tuple[str, Any]]) -> tuple[dict, list[bytes], bytes | None]:
    """A multipart form, as (field, text or file bytes) pairs, as the request body protocol.py reads, the uploaded
    images (the openai client sends one as `image`, several as `image[]`) and the mask. Text fields the openai client
    sends for numbers are numbers again; `loras[NAME]` (extra_body's {"loras": {NAME: scale}}) an object."""
    body: dict = {}
    images: list[bytes] = []
    mask = None
    for name, value in fields:
        is_file = isinstance(value, bytes)
        if name in ("image", "image[]"):
            if not is_file:
                raise RequestError(400, f"{name}: expected an image file (multipart), got a text field", "image")
            images.append(value)
        elif name == "mask":
            if not is_file or mask is not None:
                raise RequestError(400, "mask: expected one image file (multipart)", "mask")
            mask = value
        elif is_file:
            raise RequestError(400, f"{name}: a file where a text field was expected (files: image, mask)", name)
        elif name.startswith("loras[") and name.endswith("]"):
            body.setdefault("loras", {})[name[6:-1]] = _form_number(name, value, float)
        elif name in body:
            raise RequestError(400, f"{name}: given twice", name)
        elif value == "":
            body[name] = None  # the openai client sends None as an empty field
        elif name in INTEGER_FIELDS:
            body[name] = _form_number(name, value, int)
        elif name in NUMBER_FIELDS:
            body[name] = _form_number(name, value, float)
        elif name == "stream":  # the openai client sends a boolean as "true" / "false"
            if value.lower() not in ("true", "false"):
                raise RequestError(400, f"stream: expected true or false, got {quoted(value)}", "stream")
            body[name] = value.lower() == "true"
        else:
            body[name] = value
    return body, images, mask


def _form_number(name: str, text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise RequestError(400, f"{name}: expected {what}, got {quoted(text)}", name.split("[")[0]) from None


def parse_edit_request(fields: list[tuple[str, Any]], limits: Limits) -> ImageRequest:
    """POST /v1/images/edits' form as an ImageRequest carrying its images (and mask), or a RequestError: on a
    pipeline that takes no image, naming what this server serves instead."""
    if "image" not in limits.inputs:
        serves = ("POST /v1/images/generations (a prompt to an image)" if limits.kind == "image"
                  else "POST /v1/videos (a prompt to a video)")
        raise RequestError(400, f"/v1/images/edits: this server's pipeline ({limits.pipeline or 'its class'}) takes "
                                f"no image; it serves {serves}. Edits need a pipeline whose call takes an image: "
                                "FLUX.1 Kontext, Qwen-Image-Edit, FLUX.2 (references), or an Img2Img / Inpaint class "
                                "(serve MODEL --pipeline CLASS)", "image")
    body, images, mask = form_body(fields)
    if not images:
        raise RequestError(400, "image: expected one image file (image) or several (image[])", "image")
    if len(images) > MAX_IMAGES:
        raise RequestError(400, f"image: {len(images)} images; at most {MAX_IMAGES}", "image")
    if mask is not None and "mask" not in limits.inputs:
        raise RequestError(400, f"mask: this server's pipeline ({limits.pipeline}) takes no mask_image; an Inpaint "
                                "class does (serve MODEL --pipeline ...InpaintPipeline)", "mask")
    if body.get("strength") is not None and "strength" not in limits.inputs:
        raise RequestError(400, f"strength: this server's pipeline ({limits.pipeline}) takes no strength; an Img2Img "
                                "or Inpaint class does", "strength")
    request = parse_image_request(body, limits, "edit")
    sizes = [check_upload("image", data, limits) for data in images]
    if mask is not None:
        mask_size = check_upload("mask", mask, limits)
        if mask_size != sizes[0]:
            raise RequestError(400, f"mask: {mask_size[0]}x{mask_size[1]}, but the image is {sizes[0][0]}x"
                                    f"{sizes[0][1]}; the mask must be as large as the (first) image", "mask")
    return replace(request, images=tuple(images), mask=mask)
