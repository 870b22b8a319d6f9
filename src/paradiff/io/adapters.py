"""A LoRA adapter's tensors before any is read, and this rank's slice of each: a local safetensors file by its header
(each factor read by slices), anything else (a dict, a Hub id, another key format) through diffusers' own fetch and
conversions to peft's names; with a checksum of the content the ranks agree on (`api/lora.py` checks and agrees,
then reads each rank's slices through `AdapterSource.read`).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paradiff.distributed.agreement import fingerprint, tensor_checksum
from paradiff.io.checkpoint import Checkpoint
from paradiff.tensor_parallel.shard import slice_tensor
from paradiff.tensor_parallel.styles import ShardSpec

# the keyword arguments diffusers' load_lora_adapter uses to find a file (dropped once paradiff has read it)
FETCH_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder",
                "weight_name", "use_safetensors")
DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


@dataclass
class AdapterSource:
    """An adapter's tensors, by peft name without the prefix, before any is read: a safetensors file's header
    (read by slices) or tensors in memory."""

    names: dict[str, str]  # peft name -> key in the file / the dict
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    identity: str  # a checksum of the content, which every rank must share
    checkpoint: Checkpoint | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    metadata: Any = None
    bytes_read: int = 0

    def read(self, name: str, spec: ShardSpec | None) -> torch.Tensor:
        key = self.names[name]
        if self.checkpoint is not None:
            tensor = self.checkpoint.read(key, spec)
            self.bytes_read += tensor.numel() * tensor.element_size()
            return tensor
        return slice_tensor(self.tensors[key], spec)

    def close(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint.close()


def open_adapter(source: Any, prefix: str | None, kwargs: dict[str, Any], identity: str | None = None) -> AdapterSource:
    """The adapter's tensors under peft's names, prefix removed: a local safetensors file by its header (nothing
    read yet, beyond the checksum), anything else (a dict, a Hub id, another format) through diffusers. `identity`:
    the content's checksum when the caller already took one (then none is computed here)."""
    from diffusers.utils import convert_unet_state_dict_to_peft

    path = None if isinstance(source, dict) else _local_safetensors(source, kwargs)
    if path is not None:
        from diffusers.utils.state_dict_utils import _load_sft_state_dict_metadata

        checkpoint = Checkpoint.of_file(path)
        names = _strip_prefix(list(checkpoint.tensors), prefix)
        # diffusers reads the adapter metadata only when asked for safetensors (use_safetensors=True or a
        # .safetensors weight_name); otherwise it loads the file without it, and so does this
        weight_name = kwargs.get("weight_name")
        wants_metadata = (kwargs.get("use_safetensors") and weight_name is None) or (
            weight_name is not None and weight_name.endswith(".safetensors"))
        # with its prefix: diffusers filters it
        metadata = _load_sft_state_dict_metadata(str(path)) if wants_metadata else None
        if not names or _is_peft(names):  # nothing under the prefix: diffusers then only warns
            return AdapterSource(
                names=names, shapes={n: tuple(checkpoint.tensors[k].shape) for n, k in names.items()},
                dtypes={n: str(checkpoint.tensors[k].dtype) for n, k in names.items()},
                identity=identity or _file_digest(path),
                checkpoint=checkpoint, metadata=metadata)
        # another key format: converted whole by diffusers, as its own load would
        tensors = {key: checkpoint.read(key) for key in checkpoint.tensors}
        checkpoint.close()
    elif isinstance(source, dict):
        tensors, metadata = source, None
    else:
        from diffusers.loaders.lora_base import _fetch_state_dict

        fetch = {k: kwargs.get(k) for k in FETCH_KWARGS}
        tensors, metadata = _fetch_state_dict(
            pretrained_model_name_or_path_or_dict=source, user_agent={"file_type": "attn_procs_weights",
                                                                      "framework": "pytorch"},
            allow_pickle=False, metadata=kwargs.get("metadata"), **fetch)
    names = _strip_prefix(list(tensors), prefix)
    tensors = {name: tensors[key] for name, key in names.items()}
    if tensors and not _is_peft(tensors):
        tensors = convert_unet_state_dict_to_peft(tensors)
    return AdapterSource(
        names={name: name for name in tensors}, shapes={n: tuple(t.shape) for n, t in tensors.items()},
        dtypes={n: str(t.dtype) for n, t in tensors.items()}, identity=identity or _tensors_digest(tensors),
        tensors=tensors, metadata=metadata)


def text_encoder_adapter(state_dict: dict[str, torch.Tensor], prefix: str, text_encoder: nn.Module) -> AdapterSource:
    """The text encoder's tensors of a pipeline LoRA under peft's names, as diffusers' text-encoder loader sees them:
    those under `prefix`, through diffusers' key conversions, without the `text_model.` level that transformers'
    CLIPTextModel no longer has. (Possibly none: diffusers then only warns.)"""
    from diffusers.utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft

    tensors = {key.removeprefix(f"{prefix}."): value for key, value in state_dict.items()
               if key.startswith(f"{prefix}.")}
    if tensors:
        tensors = convert_state_dict_to_peft(convert_state_dict_to_diffusers(tensors))
        if not hasattr(text_encoder, "text_model"):
            tensors = {key.removeprefix("text_model."): value for key, value in tensors.items()}
    return AdapterSource(
        names={name: name for name in tensors}, shapes={n: tuple(t.shape) for n, t in tensors.items()},
        dtypes={n: str(t.dtype) for n, t in tensors.items()}, identity=_tensors_digest(tensors), tensors=tensors)


def _local_safetensors(source: Any, kwargs: dict[str, Any]) -> Path | None:
    """The local safetensors file diffusers would load for `source`, or None (then diffusers fetches it)."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    path = Path(source)
    if kwargs.get("subfolder"):
        path = path / kwargs["subfolder"]
    if path.is_file():
        return path if path.suffix == ".safetensors" else None
    if not path.is_dir():
        return None
    if kwargs.get("weight_name"):
        named = path / kwargs["weight_name"]
        return named if named.is_file() and named.suffix == ".safetensors" else None
    if (path / DEFAULT_WEIGHT_NAME).is_file():
        return path / DEFAULT_WEIGHT_NAME
    files = sorted(path.glob("*.safetensors"))
    return files[0] if len(files) == 1 else None


def _strip_prefix(keys: list[str], prefix: str | None) -> dict[str, str]:
    if prefix is None:
        return {key: key for key in keys}
    return {key.removeprefix(f"{prefix}."): key for key in keys if key.startswith(f"{prefix}.")}


def _is_peft(names) -> bool:
    return "lora_A" in next(iter(names))  # diffusers' own test for its peft conversion


def _file_digest(path: Path) -> str:
    """The file's CRC-32, streamed, with its size: it only has to tell apart files given to the ranks by mistake, and
    zlib's CRC-32 runs 2.5x faster than SHA-256 on the development machine (894 vs 359 MB/s), which a hot-swap waits
    for."""
    crc = 0
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            crc = zlib.crc32(chunk, crc)
    return f"crc32 {crc:08x}, {path.stat().st_size} bytes"


def _tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    return fingerprint(sorted((name, tensor_checksum(tensor)) for name, tensor in tensors.items()))
