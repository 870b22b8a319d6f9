"""Adapters per sample on a paradiff (or plain diffusers) transformer: a bank of fixed-size slots on its Linears
(`tensor_parallel/lora_slots.py`), adapters loaded into slots by name, and the adapter of each sample of the next
call. Every sample of one batch can run another adapter (or none), unmerged, in one call.

    enable_adapter_slots(model, max_loras=4, max_lora_rank=64)
    load_slot_adapter(model, "style", "style.safetensors")        # any format diffusers' loaders read, as a dict
    set_sample_adapters(model, ["style", None, "style", "turbo"])   # one per sample; None: the base model
    model(...)

Loading reuses `load_lora_adapter`'s steps (api/lora.py): the adapter is read and converted as diffusers would
(kohya & co. through diffusers' converters when given as the dict `lora_state_dict` returns), checked against the
full model, agreed by every rank (name, tensors, content checksum) before any rank writes a slot, and each rank
reads only its slices. The scaling of each module is the one diffusers' LoraConfig gives it (alpha / rank, from the
file's metadata or the network alphas). peft's own adapters (`load_lora_adapter`, `set_adapters`) still work beside
the slots and apply to every sample.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from paradiff.runtime.patches import add_hook
from paradiff.api.lora import _resolved, _split_name, check_adapter, open_adapter
from paradiff.distributed.agreement import agree, fingerprint
from paradiff.errors import AdapterError
from paradiff.runtime.state import model_state
from paradiff.tensor_parallel.layers import RowwiseLinear, VocabLinear
from paradiff.tensor_parallel.lora_slots import LoraSlots, SlotIndex, add_slot_output

DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 64


@dataclass
class SlotAdapter:
    """An adapter resident in one slot."""

    name: str
    slot: int
    ranks: dict[str, int]  # module -> rank
    identity: str  # the checksum the ranks agreed on
    local_bytes: int


@dataclass
class AdapterBank:
    """The slots of one model: kept in its ModelState (`adapter_bank`)."""

    index: SlotIndex
    layers: dict[str, LoraSlots]
    max_loras: int
    max_rank: int
    adapters: dict[str, SlotAdapter] = field(default_factory=dict)
    removers: list[Callable[[], None]] = field(default_factory=list)

    def slot_of(self, name: str | None) -> int:
        if name is None:
            return 0
        adapter = self.adapters.get(name)
        if adapter is None:
            raise AdapterError(f"No adapter named {name!r} is loaded in a slot (loaded: {sorted(self.adapters)}); "
                               "load it with load_slot_adapter first, or pass None for the base model.")
        return adapter.slot

    def free_slot(self) -> int:
        used = {adapter.slot for adapter in self.adapters.values()}
        for slot in range(1, self.max_loras + 1):
            if slot not in used:
                return slot
        raise AdapterError(f"All {self.max_loras} adapter slots are in use ({sorted(self.adapters)}); unload one "
                           "first, or enable the slots with a larger max_loras.")


def adapter_bank(model: nn.Module) -> AdapterBank | None:
    state = model_state(model, create=False)
    return None if state is None else state.adapter_bank


def enable_adapter_slots(model: nn.Module, max_loras: int = DEFAULT_MAX_LORAS,
                         max_lora_rank: int = DEFAULT_MAX_LORA_RANK, targets: Iterable[str] | None = None,
                         dtype: torch.dtype | None = None) -> AdapterBank:
    """Give every Linear of `model` (or only `targets`, module names) `max_loras` adapter slots of rank up to
    `max_lora_rank`, on this rank's shard. Call after the model is parallelised and before compiling it; the slots
    then never change shape. Costs (max_loras + 1) * max_lora_rank * (in + out) values per Linear (its local
    shard's widths)."""
    if max_loras < 1 or max_lora_rank < 1:
        raise AdapterError(f"max_loras={max_loras}, max_lora_rank={max_lora_rank}: both must be at least 1.")
    if adapter_bank(model) is not None:
        raise AdapterError(f"{type(model).__name__} already has adapter slots; disable_adapter_slots first.")
    linears = {name: module for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and not isinstance(module, VocabLinear)
               and ".lora_" not in f".{name}" and "lora_slots" not in name}
    if targets is not None:
        targets = list(targets)
        missing = [name for name in targets if name not in linears]
        if missing:
            raise AdapterError(f"Adapter slot targets {missing[:8]} are not Linears of {type(model).__name__} "
                               f"(e.g. {sorted(linears)[:8]}).")
        linears = {name: linears[name] for name in targets}
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)
    index = SlotIndex(max_loras + 1)
    bank = AdapterBank(index=index, layers={}, max_loras=max_loras, max_rank=max_lora_rank)
    for name, linear in linears.items():
        slots = LoraSlots(linear.in_features, linear.out_features, max_loras, max_lora_rank, index, dtype,
                          linear.weight.device)
        linear.lora_slots = slots
        bank.layers[name] = slots
        if isinstance(linear, RowwiseLinear):  # the seam before its all-reduce
            bank.removers.append(lambda linear=linear: setattr(linear, "lora_slots", None))
        else:
            handle = add_hook(linear, add_slot_output, by="lora_slots", prepend=True)
            bank.removers.append(lambda linear=linear, handle=handle: (handle.remove(), _drop(linear)))
    model_state(model).adapter_bank = bank
    return bank


def _drop(linear: nn.Module) -> None:
    del linear.lora_slots


def disable_adapter_slots(model: nn.Module) -> None:
    """Remove every slot and its hook: the model is as before `enable_adapter_slots`."""
    bank = adapter_bank(model)
    if bank is None:
        return
    for remove in bank.removers:
        remove()
    model_state(model).adapter_bank = None


def load_slot_adapter(model: nn.Module, name: str, source: Any, prefix: str | None = "transformer",
                      network_alphas: dict[str, float] | None = None, metadata: dict[str, Any] | None = None,
                      identity: str | None = None, ranks: list[int] | None = None, scale: float = 1.0,
                      **kwargs: Any) -> SlotAdapter:
    """Load an adapter into a free slot under `name`. `source` is what `load_lora_adapter` takes (a local
    safetensors file in peft format is read by slices; a dict, e.g. from a pipeline's `lora_state_dict` with
    `network_alphas`, as diffusers converted it). `identity` (e.g. the file's sha256) replaces the content checksum
    the ranks agree on; `scale` multiplies every module's scaling (as set_adapters' weight). Called on every rank (of `ranks`, default all) with the same arguments."""
    bank = adapter_bank(model)
    if bank is None:
        raise AdapterError(f"{type(model).__name__} has no adapter slots; call enable_adapter_slots first.")
    stage = f"paradiff.load_slot_adapter ({name})"
    adapter, specs, scalings, slot, error = None, {}, {}, 0, None
    try:
        if name in bank.adapters:
            raise AdapterError(f"An adapter named {name!r} is already in a slot (loaded: {sorted(bank.adapters)}); "
                               "unload it first or choose another name.")
        slot = bank.free_slot()
        # a given identity (the server's sha256) is what the ranks agree on: no second checksum of the file
        adapter = open_adapter(source, prefix, kwargs, identity=identity)
        if not adapter.shapes:
            raise AdapterError(f"Adapter {name!r} has no tensors under the prefix {prefix!r}.")
        specs = check_adapter(model, _resolved(model), adapter, None, False)
        scalings = module_scalings(adapter.shapes, _strip(network_alphas, prefix),
                                   _strip(metadata if metadata is not None else adapter.metadata, prefix), name)
        scalings = {module: scaling * scale for module, scaling in scalings.items()}
        _check_fits(bank, adapter.shapes, name)
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then re-raised
        error = exc
    facts = None if adapter is None else {
        "adapter name": name, "slot": slot, "prefix": prefix,
        "adapter tensors": fingerprint(sorted((n, list(s), adapter.dtypes[n]) for n, s in adapter.shapes.items())),
        "adapter content": adapter.identity, "scalings": fingerprint(scalings),
    }
    try:
        agree(stage, facts, error, ranks=ranks)
        error, written = None, []
        try:
            local = {tensor: adapter.read(tensor, spec) for tensor, spec in specs.items()}
            for module, scaling in scalings.items():
                bank.layers[module].write(slot, local[f"{module}.lora_A.weight"], local[f"{module}.lora_B.weight"],
                                          scaling)
                written.append(module)
            loaded = SlotAdapter(name, slot, {m: adapter.shapes[f"{m}.lora_B.weight"][1] for m in scalings},
                                 facts["adapter content"], sum(t.numel() * t.element_size() for t in local.values()))
        except Exception as exc:  # noqa: BLE001
            error = exc
        try:
            agree(f"{stage} (writing the slots)", {"loaded": True}, error, ranks=ranks)
        except Exception:
            for module in written:
                bank.layers[module].clear(slot)
            raise
        bank.adapters[name] = loaded
        return loaded
    finally:
        if adapter is not None:
            adapter.close()


def unload_slot_adapter(model: nn.Module, name: str) -> None:
    """Clear the adapter's slot (zeros: the base model) and forget its name."""
    bank = adapter_bank(model)
    if bank is None or name not in bank.adapters:
        raise AdapterError(f"No adapter named {name!r} is in a slot (loaded: "
                           f"{sorted(bank.adapters) if bank else []}).")
    adapter = bank.adapters.pop(name)
    for module in adapter.ranks:  # only the layers it wrote: no walk over the model
        bank.layers[module].clear(adapter.slot)


def set_sample_adapters(model: nn.Module, names: Sequence[str | None]) -> list[int]:
    """The adapter of each sample of the next calls (None: the base model); returns their slots."""
    bank = adapter_bank(model)
    if bank is None:
        raise AdapterError(f"{type(model).__name__} has no adapter slots; call enable_adapter_slots first.")
    slots = [bank.slot_of(name) for name in names]
    device = next(iter(bank.layers.values())).lora_a.device if bank.layers else None
    bank.index.set(slots, device)
    return slots


def module_scalings(shapes: dict[str, tuple[int, ...]], network_alphas: dict[str, float] | None,
                    metadata: dict[str, Any] | None, name: str) -> dict[str, float]:
    """Module -> the scaling peft gives it when diffusers' `load_lora_adapter` builds the LoraConfig (diffusers'
    own `_create_lora_config`, then peft's pattern lookup of rank and alpha)."""
    from diffusers.utils.peft_utils import _create_lora_config
    from peft.utils.other import get_pattern_key

    rank = {f"^{tensor}": shape[1] for tensor, shape in shapes.items() if "lora_B" in tensor and len(shape) > 1}
    config = _create_lora_config(dict.fromkeys(shapes), network_alphas, metadata, rank, adapter_name=name)
    scalings = {}
    for tensor in shapes:
        module, factor = _split_name(tensor)
        if factor != "lora_A.weight":
            continue
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module), config.r)
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
        scalings[module] = alpha / (math.sqrt(r) if config.use_rslora else r)
    return scalings


def _check_fits(bank: AdapterBank, shapes: dict[str, tuple[int, ...]], name: str) -> None:
    for tensor, shape in shapes.items():
        module, factor = _split_name(tensor)
        if factor not in ("lora_A.weight", "lora_B.weight"):
            raise AdapterError(f"Adapter {name!r}: tensor {tensor} is not a plain LoRA factor; adapter slots hold "
                               "lora_A / lora_B weights only (no LoRA bias, DoRA or other peft variants).")
        if module not in bank.layers:
            raise AdapterError(f"Adapter {name!r} targets {module!r}, which has no adapter slots (enable the slots "
                               "on it: enable_adapter_slots(targets=...)).")
        if factor == "lora_A.weight" and shape[0] > bank.max_rank:
            raise AdapterError(f"Adapter {name!r} has rank {shape[0]} on {module!r}, above max_lora_rank "
                               f"{bank.max_rank}; raise --max-lora-rank / max_lora_rank to at least {shape[0]}.")


def _strip(values: dict[str, Any] | None, prefix: str | None) -> dict[str, Any] | None:
    """Network alphas or metadata under the prefix, without it (as diffusers' load_lora_adapter filters them)."""
    if not values or prefix is None:
        return values or None
    if not any(str(key).startswith(f"{prefix}.") for key in values):
        return values
    return {key.removeprefix(f"{prefix}."): value for key, value in values.items()
            if str(key).startswith(f"{prefix}.")} or None


def slot_adapter_source(pipeline: Any, path: str, data: bytes | None = None,
                        name: str | None = None) -> tuple[Any, dict]:
    """`load_slot_adapter`'s source and keywords for a pipeline's LoRA file: a file in diffusers' own format is
    read by slices (with its metadata), or, given `data` (the file's bytes, which the server has read once to hash
    them), taken from those bytes without reading the file again; any other format goes through the pipeline's
    `lora_state_dict`, diffusers' converters (kohya, BFL, XLabs...), as `load_lora_weights` would. Text-encoder
    tensors are refused, naming the adapter (`name`, default the file's stem) and the tensors:
    `text_encoder_refusal`."""
    if data is not None:
        header = _safetensors_header(data, path)
        keys = [key for key in header if key != "__metadata__"]
    else:
        from safetensors import safe_open

        with safe_open(path, "pt") as handle:
            keys = list(handle.keys())
    refusal = text_encoder_refusal(name or Path(path).stem, path, keys)
    if refusal is not None:
        raise AdapterError(refusal)
    if keys and all(key.startswith("transformer.") and ".lora_" in key for key in keys):
        if data is None:
            return path, {"use_safetensors": True}
        from safetensors.torch import load

        # the adapter metadata diffusers' loader reads (r, lora_alpha, patterns), under the same key
        raw = (header.get("__metadata__") or {}).get("lora_adapter_metadata")
        return load(data), {"metadata": json.loads(raw)} if raw else {}
    try:
        state, alphas = pipeline.lora_state_dict(path, return_alphas=True)
    except TypeError:  # loaders without network alphas
        state, alphas = pipeline.lora_state_dict(path), None
    return state, {"network_alphas": alphas} if alphas else {}


# where the LoRA formats diffusers reads keep a text encoder's factors: diffusers' `text_encoder.` / `text_encoder_2.`
# prefixes, kohya's `lora_te_` / `lora_te1_` / `lora_te2_`
TEXT_ENCODER_PREFIXES = ("text_encoder", "lora_te")


def text_encoder_refusal(name: str, path: str, keys: Iterable[str]) -> str | None:
    """Why an adapter file with text-encoder tensors cannot be an adapter per sample / per request (None when it has
    none): naming the adapter, its file and those tensors. The text encoders run once for the whole batch, so an
    adapter per sample adapts the transformer only; the file's transformer part, or `--lora` (every sample), do."""
    encoder = sorted(key for key in keys if key.startswith(TEXT_ENCODER_PREFIXES))
    if not encoder:
        return None
    shown = ", ".join(encoder[:3]) + (f" and {len(encoder) - 3} more" if len(encoder) > 3 else "")
    return (f"adapter {name!r} ({path}) adapts a text encoder: {len(encoder)} tensor(s) {shown}. Adapters per "
            "request or per sample adapt the transformer only (the text encoders run once for the whole batch): use "
            "a file with only its transformer tensors, or --lora to apply it to every sample.")


def safetensors_keys(path: str | Path) -> list[str]:
    """A safetensors file's tensor names, from its header alone."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if not 0 < size <= 100 << 20:
            raise ValueError(f"{path}: not a safetensors header")
        return [key for key in _safetensors_header(head + handle.read(size), str(path)) if key != "__metadata__"]


def _safetensors_header(data: bytes, path: str) -> dict[str, Any]:
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + size])
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{path}: not a safetensors file (its header: {exc}).") from None
    return header


def source_max_rank(source: Any) -> int:
    """The largest rank of an adapter given as a safetensors path (its header only) or a state dict."""
    if isinstance(source, dict):
        return max((t.shape[0] for k, t in source.items() if "lora_A" in k or "lora_down" in k), default=1)
    from safetensors import safe_open

    with safe_open(source, "pt") as handle:
        return max((handle.get_slice(k).get_shape()[0] for k in handle.keys() if "lora_A" in k or "lora_down" in k),
                   default=1)
