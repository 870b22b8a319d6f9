"""Adapters per request, in vLLM's convention: `--lora-modules NAME=PATH` at start, `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` at run time (with `--allow-runtime-lora`, paths confined to `--lora-root`), each adapter
its own model id, `"model": NAME` selecting it.

Two halves. Rank 0's `AdapterRegistry` (the frontend) knows the names served, checks a file before it is named (in
the root, a safetensors file of LoRA factors no wider than `--max-lora-rank`) and takes its sha256; a request
carries its adapter's name, path and sha256 into the round. Each rank's `AdapterCache` keeps up to `--max-loras`
adapters resident in the transformer's slots (api/lora_slots.py), least recently used out first: before a pipeline
call it loads the chunk's missing adapters (every rank of the replica agrees on the file's sha256 before any
writes a slot), then sets each sample's slot. Loading happens between pipeline calls, so it never stalls a running
one, and never reloads the pipeline. Unloading forgets the name at once (its requests then get 404); its slot is
reused when needed.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from paradiff.errors import ServeSettingsError
from paradiff.runtime.console import say
from paradiff.serve.protocol import RequestError, quoted
from paradiff.serve.settings import ServeSettings


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def lora_header_ranks(path: Path) -> dict[str, int]:
    """A safetensors LoRA file's factors (tensor name -> rank), from its header alone (no tensor is read)."""
    with open(path, "rb") as handle:
        size = struct.unpack("<Q", handle.read(8))[0]
        if size > 100 << 20:
            raise ValueError(f"a header of {size} bytes")
        header = json.loads(handle.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"its header is a JSON {type(header).__name__}, not an object")
    ranks = {}
    for key, entry in header.items():
        if key == "__metadata__" or not any(part in key for part in LORA_DOWN):
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or len(shape) != 2 or not all(
                isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in shape):
            raise ValueError(f"tensor {quoted(key)} has the shape {quoted(shape)}; a LoRA factor is 2-D")
        ranks[key] = shape[0]
    return ranks


LORA_DOWN = ("lora_A.weight", "lora_down.weight", "lora.down.weight")  # the factor whose first side is the rank


class AdapterRegistry:
    """Rank 0: the adapters served, by name -> {"path", "sha256"} (thread-safe: HTTP threads and the round loop)."""

    def __init__(self, base_name: str, modules: list[str] | None, root: str | None, allow_runtime: bool,
                 max_rank: int) -> None:
        self.base_name, self.allow_runtime, self.max_rank = base_name, allow_runtime, max_rank
        self.root = Path(root).resolve() if root else None
        self.modules: frozenset[str] | None = None  # the transformer's modules with slots, once a replica loaded
        self._lock = threading.Lock()
        self._adapters: dict[str, dict[str, str]] = {}
        for spec in modules or []:
            name, _, path = spec.partition("=")
            # operator-given at start: not confined to --lora-root
            self.add(name, path, confined=False)

    @property
    def enabled(self) -> bool:
        return bool(self._adapters) or self.allow_runtime

    def names(self) -> list[str]:
        with self._lock:
            return list(self._adapters)

    def get(self, name: str) -> dict[str, str] | None:
        with self._lock:
            entry = self._adapters.get(name)
            return None if entry is None else dict(entry, name=name)

    def add(self, name: Any, path: Any, confined: bool = True) -> dict[str, str]:
        """Check and name an adapter file; RequestError (400 / 403 / 404) naming what is wrong."""
        _check_name(name)
        if name == self.base_name:
            raise RequestError(400, f"lora_name {quoted(name)} is the base model's id; choose another name",
                               "lora_name")
        if not isinstance(path, str) or not path or len(path) > 4096 or "\0" in path:
            raise RequestError(400, f"lora_path: expected a path to a .safetensors file, got {quoted(path)}",
                               "lora_path")
        given = quoted(path)
        try:  # a path the OS cannot take (too long, a loop of links, ~user of no one) is the request's fault
            if confined:  # relative to the root, as written: no ~ expansion
                if self.root is None:
                    raise RequestError(403, "runtime adapter loading needs --lora-root DIR: paths are read only "
                                            "inside it", "lora_path")
                resolved = (self.root / path).resolve()
                if not resolved.is_relative_to(self.root):
                    raise RequestError(403, f"lora_path {given} is outside --lora-root {self.root}; only files "
                                            "under it are read", "lora_path")
            else:
                resolved = Path(path).expanduser()
            found = resolved.suffix == ".safetensors" and resolved.is_file()
        except (OSError, RuntimeError, ValueError) as exc:
            raise RequestError(400, f"lora_path {given} is not a usable path ({type(exc).__name__}: "
                                    f"{quoted(str(exc), 120)})", "lora_path") from None
        if not found:
            raise RequestError(404 if confined else 400, f"lora_path {given}: no such .safetensors file"
                               + (f" under --lora-root {self.root}" if confined else ""), "lora_path")
        try:
            ranks = lora_header_ranks(resolved)
        except (OSError, ValueError, KeyError, struct.error) as exc:
            raise RequestError(400, f"lora_path {given} is not a readable safetensors file of LoRA factors "
                                    f"({quoted(str(exc), 160)})", "lora_path") from None
        if not ranks:
            raise RequestError(400, f"lora_path {given} holds no LoRA factors (no lora_A / lora_down tensors)",
                               "lora_path")
        if max(ranks.values()) > self.max_rank:
            raise RequestError(400, f"lora_path {given} has rank {max(ranks.values())}, above --max-lora-rank "
                                    f"{self.max_rank}; restart with a larger --max-lora-rank", "lora_path")
        # peft's names (transformer.<module>.lora_A.weight) say the modules outright; other formats are converted by
        # diffusers when the ranks load them
        aimed = {key.removeprefix("transformer.").removesuffix(".lora_A.weight") for key in ranks
                 if key.startswith("transformer.") and key.endswith(".lora_A.weight")}
        missing = sorted(aimed - self.modules) if self.modules else []
        if missing:
            raise RequestError(400, f"lora_path {given} adapts module(s) this model has no adapter slots for: "
                                    f"{quoted(missing, 200)} (e.g. {sorted(self.modules)[:3]}); is it made for "
                                    "another model?", "lora_path")
        from paradiff.api.lora_slots import safetensors_keys, text_encoder_refusal

        refusal = text_encoder_refusal(name, str(resolved), safetensors_keys(resolved))
        if refusal is not None:
            raise RequestError(400, f"lora_path: {refusal}", "lora_path")
        entry = {"path": str(resolved), "sha256": file_sha256(resolved)}
        with self._lock:
            if name in self._adapters:
                raise RequestError(400, f"an adapter named {quoted(name)} is already loaded; unload it first",
                                   "lora_name")
            self._adapters[name] = {**entry, "created": int(time.time())}
        return entry

    def remove(self, name: Any) -> None:
        _check_name(name)
        with self._lock:
            if name not in self._adapters:
                raise RequestError(404, f"no adapter named {quoted(name)} is loaded (loaded: "
                                        f"{sorted(self._adapters)})", "lora_name")
            del self._adapters[name]

    def resolve_model(self, body: Any) -> tuple[Any, dict[str, str] | None]:
        """The request body (a JSON object, or an edit's multipart (field, value) pairs) with `model` an adapter
        name replaced by the base id, and that adapter (or None)."""
        if isinstance(body, dict):
            model = body.get("model")
        elif isinstance(body, list):
            model = next((value for name, value in body if name == "model"), None)
        else:
            return body, None
        entry = self.get(model) if isinstance(model, str) and model != self.base_name else None
        if entry is None:
            return body, None  # the base model, or the protocol answers 404 naming what is served
        if isinstance(body, dict):
            return dict(body, model=self.base_name), entry
        return [(name, self.base_name if name == "model" else value) for name, value in body], entry

    def model_entries(self) -> list[dict]:
        with self._lock:
            return [{"id": name, "object": "model", "created": entry["created"], "owned_by": "paradiff",
                     "root": entry["path"],
                     "parent": self.base_name, "sha256": entry["sha256"]} for name, entry in self._adapters.items()]


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise RequestError(400, f"lora_name: expected a non-empty name of at most 200 characters, got {quoted(name)}",
                           "lora_name")


def runtime_refusal(registry: AdapterRegistry | None) -> RequestError | None:
    if registry is None or not registry.allow_runtime:
        return RequestError(403, "runtime adapter loading is off; start the server with --allow-runtime-lora "
                                 "(and --lora-root DIR)")
    return None


class AdapterCache:
    """Each rank: the adapters resident in the transformer's slots, least recently used first."""

    def __init__(self, transformer: Any, max_loras: int, max_rank: int) -> None:
        from paradiff.api.lora_slots import enable_adapter_slots

        self.transformer, self.max_loras = transformer, max_loras
        enable_adapter_slots(transformer, max_loras=max_loras, max_lora_rank=max_rank)
        self.resident: OrderedDict[str, str] = OrderedDict()  # name -> sha256
        self.loads = 0

    def prepare(self, adapters: list[dict | None], pipeline: Any, ranks: list[int] | None = None) -> None:
        """Make every adapter of one pipeline call resident (evicting the least recently used others), then set each
        sample's slot. `adapters`: one per sample, {"name", "path", "sha256"} or None (the base model)."""
        from paradiff.api.lora_slots import (load_slot_adapter, set_sample_adapters, slot_adapter_source,
                                             unload_slot_adapter)
        from paradiff.distributed.agreement import agree

        needed = {a["name"]: a for a in adapters if a is not None}
        if len(needed) > self.max_loras:
            raise RequestError(400, f"{len(needed)} adapters in one call, above --max-loras {self.max_loras}")
        for name, adapter in needed.items():
            if self.resident.get(name) == adapter["sha256"]:
                self.resident.move_to_end(name)
                continue
            # each rank reads the file once and hashes those bytes: the ranks agree on that sha256 (and it must be
            # the one rank 0 took when the adapter was named) before any rank writes a slot from the same bytes
            try:
                data = Path(adapter["path"]).read_bytes()
            except OSError as exc:
                data, local = b"", "unreadable"
                changed = RequestError(409, f"adapter {name!r}: its file {adapter['path']} cannot be read now "
                                            f"({exc.strerror or exc}); load it again", param="model")
            else:
                local = hashlib.sha256(data).hexdigest()
                changed = None if local == adapter["sha256"] else RequestError(
                    409, f"adapter {name!r}: {adapter['path']} changed since it was loaded (sha256 {local[:12]}, "
                         f"loaded as {adapter['sha256'][:12]}); load it again", param="model")
            # decided together: a rank whose copy changed refuses, and so does every other (none goes on alone)
            agree(f"paradiff serve: adapter {name!r} file", {"sha256": local}, changed, ranks=ranks)
            # evicted only once the file is known good: a refused load leaves the cache as it was
            if name in self.resident:  # another file under the same name since
                unload_slot_adapter(self.transformer, name)
                del self.resident[name]
            while len(self.resident) >= self.max_loras:
                victim = next(n for n in self.resident if n not in needed)
                unload_slot_adapter(self.transformer, victim)
                del self.resident[victim]
            source, extra = slot_adapter_source(pipeline, adapter["path"], data)
            del data
            load_slot_adapter(self.transformer, name, source, identity=f"sha256 {local}", ranks=ranks, **extra)
            self.resident[name] = local
            self.loads += 1
        set_sample_adapters(self.transformer, [None if a is None else a["name"] for a in adapters])


def adapter_chunks(images: list[tuple[dict, int]], max_batch: int, max_loras: int) -> list[list[tuple[dict, int]]]:
    """The round's images as pipeline calls of at most `max_batch` images and `max_loras` distinct adapters, in
    order."""
    chunks: list[list[tuple[dict, int]]] = []
    names: set[str] = set()
    for image in images:
        name = (image[0].get("adapter") or {}).get("name")
        if not chunks or len(chunks[-1]) >= max_batch or (name is not None and name not in names
                                                           and len(names) >= max_loras):
            chunks.append([])
            names = set()
        chunks[-1].append(image)
        if name is not None:
            names.add(name)
    return chunks


def adapter_registry(settings: ServeSettings) -> AdapterRegistry | None:
    """Rank 0's registry, when the server takes adapters per request (ServeSettings: lora_modules or
    allow_runtime_lora); a module it cannot serve is a ServeSettingsError naming it."""
    if not settings.lora_modules and not settings.allow_runtime_lora:
        return None
    try:
        return AdapterRegistry(settings.served_name, list(settings.lora_modules), settings.lora_root,
                               settings.allow_runtime_lora, settings.max_lora_rank)
    except RequestError as exc:
        raise ServeSettingsError("lora_modules", settings.lora_modules,
                                 "{lora_modules}: " + str(exc).replace("{", "{{").replace("}", "}}")) from None


async def adapter_endpoint(frontend: Any, request: Any, action: str, body_of: Any) -> Any:
    """POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"}, as vLLM
    takes them. A load checks the file and takes its sha256 here (in a thread: the server keeps answering); the ranks
    read it when a request first names it."""
    import asyncio

    from fastapi.responses import JSONResponse

    what = f"POST /v1/{action}_lora_adapter"
    try:
        refusal = runtime_refusal(frontend.adapters)
        if refusal is not None:
            raise refusal
        body = await body_of(request)
        fields = {"lora_name", "lora_path", "load_inplace"} if action == "load" else {"lora_name", "lora_int_id"}
        if not isinstance(body, dict) or set(body) - fields:
            raise RequestError(400, f"{what}: expected a JSON object with fields {sorted(fields)}")
        name = body.get("lora_name")
        if action == "load":
            await asyncio.to_thread(frontend.adapters.add, name, body.get("lora_path"))
            message = f"Success: LoRA adapter '{name}' added successfully."
        else:
            frontend.adapters.remove(name)
            message = f"Success: LoRA adapter '{name}' removed successfully."
    except RequestError as exc:
        return frontend.refusal(exc.status, str(exc), what, param=exc.param)
    say(f"paradiff serve: {message}")
    return JSONResponse({"status": "ok", "message": message})
