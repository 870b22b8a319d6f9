"""The OpenAPI document of `paradiff serve`, from the loaded pipeline's limits: the generation endpoint it serves
(images or videos, not both), each field's bounds and pattern as protocol.py checks them, and every error answer.
A client (or a fuzzer) that sends what the schema allows gets 200; anything else gets a documented 4xx."""

from __future__ import annotations

from paradiff.serve.protocol import (CALL_PARAMETERS, EDIT_FIELDS, IGNORED_FIELDS, IMAGE_FIELDS, MAX_PARTIAL_IMAGES,
                                     MAX_SEED, OUTPUT_FORMATS, VIDEO_FIELDS, Limits)

ERRORS = {400: "a field is missing, of the wrong type or out of bounds (the message names it and what is valid)",
          409: "the job is not completed yet", 410: "the job's result expired (--keep-results)",
          401: "missing or wrong API key", 403: "a foreign Host or Origin", 404: "no such path, or another model",
          405: "the path takes another method", 408: "the body was not sent within --read-timeout",
          413: "the body is larger than --max-body-bytes", 415: "the body is not application/json",
          500: "the pipeline failed on this request", 503: "loading, draining, failed, or the queue is full",
          504: "not answered within --request-timeout"}
GENERATION_ERRORS = (400, 401, 403, 404, 405, 408, 413, 415, 500, 503, 504)
READ_ERRORS = (401, 403, 404, 405)
NULLABLE = ("negative_prompt", "model", "size", "guidance", "true_cfg_scale", "loras", "frames", "user", "seed",
            "output_format", "output_compression", "strength", "stream",
            "partial_images", *IGNORED_FIELDS)


def size_pattern(limits: Limits) -> str:
    """'WIDTHxHEIGHT', each a multiple of size_multiple up to max_side, as a regular expression."""
    sides = "|".join(str(side) for side in range(limits.size_multiple, limits.max_side + 1, limits.size_multiple))
    return f"^({sides})x({sides})$"


def request_schema(limits: Limits, kind: str) -> dict:
    """The body of POST /v1/images/generations (kind "image"), /v1/images/edits' form ("edit") or /v1/videos
    ("video")."""
    fields = {"image": IMAGE_FIELDS, "edit": EDIT_FIELDS, "video": VIDEO_FIELDS}[kind]
    fields = {name for name in fields if name != "strength" or "strength" in limits.inputs}
    fields = {name for name in fields if name not in CALL_PARAMETERS or CALL_PARAMETERS[name] in limits.accepts}
    text = {"type": "string", "maxLength": limits.max_prompt_chars}
    adapters = [name for name, _ in limits.adapters]
    properties = {
        "prompt": {**text, "minLength": 1, "pattern": r"\S", "description": "at least one non-space character"},
        "negative_prompt": text,
        "model": {"type": "string", "enum": [limits.model_name]},
        "n": {"type": "integer", "minimum": 1, "maximum": limits.max_n, "default": 1},
        "size": {"type": "string", "pattern": f"^({size_pattern(limits)[1:-1]}|auto)$",
                 "default": f"{limits.default_size[0]}x{limits.default_size[1]}",
                 "description": f"WIDTHxHEIGHT, multiples of {limits.size_multiple} up to {limits.max_side}"},
        "response_format": {"type": "string", "enum": ["b64_json"]},
        "user": {"type": "string"},
        "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED - limits.max_n + 1,
                 "description": "image i of the request uses seed + i; absent: a random seed, returned with each "
                                "image"},
        "output_format": {"type": "string", "enum": list(OUTPUT_FORMATS), "default": "png"},
        "output_compression": {"type": "integer", "minimum": 0, "maximum": 100, "default": 100,
                               "description": "the JPEG / WebP quality"},
        "strength": {"type": "number", "minimum": 0, "maximum": 1},
        **{name: {"type": "string", **({"enum": list(valid)} if valid else {}), "description": "accepted, ignored"}
           for name, valid in IGNORED_FIELDS.items()},
        "steps": {"type": "integer", "minimum": 1, "maximum": limits.max_steps, "default": limits.default_steps},
        "guidance": {"type": "number", "minimum": 0, "maximum": 100},
        "true_cfg_scale": {"type": "number", "minimum": 0, "maximum": 100},
        "loras": {"type": "object", "additionalProperties": {"type": "number", "minimum": -10, "maximum": 10},
                  **({"propertyNames": {"enum": adapters}} if adapters else {"maxProperties": 0}),
                  "description": "{adapter: scale} among the adapters loaded with --lora; absent: all of them"},
        "frames": {"type": "integer", "minimum": 1, "maximum": limits.max_frames},
        "fps": {"type": "integer", "minimum": 1, "maximum": 120, "default": limits.default_fps},
        "stream": {"type": "boolean", "default": False,
                   "description": "answer as server-sent events (image_generation.partial_image, .completed)"},
        "partial_images": {"type": "integer", "minimum": 0, "maximum": MAX_PARTIAL_IMAGES, "default": 0,
                           "description": "x0 previews streamed while denoising (with stream)"},
    }
    for name in NULLABLE:  # null is the default, as in OpenAI's API
        properties[name] = {**properties[name], "type": [properties[name]["type"], "null"]}
        if "enum" in properties[name]:
            properties[name]["enum"] = [*properties[name]["enum"], None]
    return {"type": "object", "required": ["prompt"], "additionalProperties": False,
            "properties": {name: properties[name] for name in sorted(fields)}}


def edit_schema(limits: Limits) -> dict:
    """POST /v1/images/edits' multipart form: the generation fields (loras as `loras[NAME]` fields, not listed), the
    image file(s) and a mask where the pipeline takes one."""
    schema = request_schema(limits, "edit")
    properties = {name: value for name, value in schema["properties"].items() if name != "loras"}
    properties["image"] = {"type": "string", "format": "binary", "description": "an image (PNG, JPEG or WebP); "
                           "several as image[] fields"}
    if "mask" in limits.inputs:
        properties["mask"] = {"type": "string", "format": "binary", "description": "as large as the image"}
    return {**schema, "required": ["image", "prompt"], "properties": properties}


def _error_schema() -> dict:
    return {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "string"}}}}}


def _responses(ok: dict, errors: tuple[int, ...], secured: bool) -> dict:
    answers = {"200": ok}
    for status in errors:
        if status != 401 or secured:
            answers[str(status)] = {"description": ERRORS[status], "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return answers


def _video_paths(limits: Limits, secured: bool) -> dict:
    """OpenAI's videos API as jobs.py serves it: a job is created at once and followed until it completes."""
    body = request_schema(limits, "video")
    body["properties"].update(seconds={"type": ["number", "string", "null"], "exclusiveMinimum": 0,
                                       "description": "sets frames (seconds * fps + 1) when frames is not given"})
    video = {"type": "object", "required": ["id", "object", "status", "progress", "created_at", "model", "size",
                                             "seconds"], "properties": {
        "id": {"type": "string"}, "object": {"const": "video"},
        "status": {"enum": ["queued", "in_progress", "completed", "failed"]},
        "progress": {"type": "integer", "minimum": 0, "maximum": 100}, "created_at": {"type": "integer"},
        "completed_at": {"type": ["integer", "null"]}, "expires_at": {"type": ["integer", "null"]},
        "model": {"type": "string"}, "size": {"type": "string"}, "seconds": {"type": "string"},
        "prompt": {"type": ["string", "null"]}, "error": {"type": ["object", "null"]},
        "parameters": {"type": "object"}}}
    one = {"description": "the job", "content": {"application/json": {"schema": video}}}
    listed = {"description": "a page of jobs, newest first", "content": {"application/json": {"schema": {
        "type": "object", "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": video},
                                         "first_id": {"type": ["string", "null"]},
                                         "last_id": {"type": ["string", "null"]}, "has_more": {"type": "boolean"}}}}}}
    job_id = [{"name": "video_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    content = {"description": "the MP4 (variant video) or its first frame as PNG (variant thumbnail)",
               "content": {"video/mp4": {}, "image/png": {}}}
    gone = (400, 401, 403, 404, 405)
    return {
        "/v1/videos": {
            "post": {"summary": "create a video job (answered at once, queued)", "requestBody": {
                "required": True, "content": {"application/json": {"schema": body},
                                              "multipart/form-data": {"schema": body}}},
                     "responses": _responses(one, (400, 401, 403, 405, 408, 413, 415, 503), secured)},
            "get": {"summary": "list the jobs", "parameters": [
                {"name": "after", "in": "query", "schema": {"type": "string"}},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}}],
                    "responses": _responses(listed, gone, secured)}},
        "/v1/videos/{video_id}": {
            "get": {"summary": "the job", "parameters": job_id, "responses": _responses(one, gone, secured)},
            "delete": {"summary": "cancel (at the next denoising step) and delete", "parameters": job_id,
                       "responses": _responses({"description": "deleted"}, gone, secured)}},
        "/v1/videos/{video_id}/content": {"get": {
            "summary": "the result", "parameters": [*job_id, {"name": "variant", "in": "query", "schema": {
                "enum": ["video", "thumbnail"]}}], "responses": _responses(content, (*gone, 409, 410), secured)}},
    }


def openapi_document(limits: Limits | None, title: str, version: str, secured: bool) -> dict:
    """The schema; before the pipeline is loaded (limits None) it lists only the endpoints that need no pipeline."""
    files = {"type": "object", "required": ["created", "data"], "properties": {
        "created": {"type": "integer"},
        "data": {"type": "array", "items": {"type": "object", "required": ["b64_json"], "properties": {
            "b64_json": {"type": "string"}, "mime_type": {"type": "string"}, "seed": {"type": "integer"}}}},
        "size": {"type": "string"}, "output_format": {"type": "string"}, "mime_type": {"type": "string"}}}
    status = {"type": "object", "required": ["status"], "properties": {
        "status": {"type": "string", "enum": ["loading", "ready", "draining", "failed"]}}}
    models = {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"type": "string"}, "data": {"type": "array", "items": {"type": "object"}}}}
    json_of = {"content": {"application/json": {"schema": status}}}
    paths = {
        "/health": {"get": {"summary": "ready, loading, draining or failed (never needs the key)", "security": [],
                            "responses": {"200": {"description": "ready", **json_of},
                                          "503": {"description": "loading, draining or failed", **json_of},
                                          **{k: v for k, v in _responses({}, (403, 405), False).items()
                                             if k != "200"}}}},
        "/metrics": {"get": {"summary": "Prometheus text", "responses": _responses(
            {"description": "counters, gauges and the latency histogram",
             "content": {"text/plain": {"schema": {"type": "string"}}}}, READ_ERRORS, secured)}},
        "/v1/models": {"get": {"summary": "the one model served", "responses": _responses(
            {"description": "the model and its adapters", "content": {"application/json": {"schema": models}}},
            READ_ERRORS, secured)}},
        "/v1/models/{model_id}": {"get": {
            "summary": "the model, by its id (404 for another)",
            "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"},
                            **({"example": limits.model_name} if limits is not None else {})}],
            "responses": _responses({"description": "the model and its adapters",
                                     "content": {"application/json": {"schema": {"type": "object"}}}},
                                    READ_ERRORS, secured)}},
    }
    if limits is not None and "image" in limits.inputs:
        paths["/v1/images/edits"] = {"post": {
            "summary": "edit images: the pipeline's call takes them (base64 answers, as generations')",
            "requestBody": {"required": True, "content": {"multipart/form-data": {
                "schema": edit_schema(limits)}}},
            "responses": _responses({"description": "the images, base64",
                                     "content": {"application/json": {"schema": files}}},
                                    GENERATION_ERRORS, secured)}}
    if limits is not None and limits.kind == "video":
        paths.update(_video_paths(limits, secured))
    elif limits is not None:
        path, what = "/v1/images/generations", "PNG images"
        paths[path] = {"post": {
            "summary": f"generate {what} (base64)",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": request_schema(limits, limits.kind)}}},
            "responses": _responses({"description": f"the {what}, base64" + (
                                         "; server-sent events with stream" if limits.kind == "image" else ""),
                                     "content": {"application/json": {"schema": files}, **(
                                         {"text/event-stream": {"schema": {"type": "string"}}}
                                         if limits.kind == "image" else {})}},
                                    GENERATION_ERRORS, secured)}}
    document = {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
                "components": {"schemas": {"Error": _error_schema()}}}
    if secured:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    return document
