"""What differs between a diffusers model and a `transformers` model (a pipeline's text encoders) when paradiff
builds one on the meta device and reads its checkpoint: config, construction, checkpoint key names, tied weights and
the modules kept in float32.

transformers (v5) renames checkpoint keys at load time (e.g. Qwen2.5-VL's `model.layers.*` lives at
`model.language_model.layers.*` in the module tree) and saves them back under the old names; the renaming rules are
transformers' own, asked for through its conversion-mapping API rather than restated here.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from paradiff.errors import CheckpointError, UnsupportedModelError


def is_transformers_class(model_cls: type) -> bool:
    return any(k.__name__ == "PreTrainedModel" and k.__module__.startswith("transformers") for k in model_cls.__mro__)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """transformers builds its models under the target default dtype (buffers made in __init__, e.g. Gemma's
    embedding scale, take it); building ours the same way keeps those buffers identical to a plain load."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_config(model_cls: type, folder: Path) -> Any:
    if is_transformers_class(model_cls):
        return model_cls.config_class.from_pretrained(folder)
    return model_cls.load_config(folder)


def construct(model_cls: type, config: Any, dtype: torch.dtype) -> nn.Module:
    """Build the model (the caller holds parameters on the meta device)."""
    if is_transformers_class(model_cls):
        with default_dtype(dtype):
            return model_cls(config)
    return model_cls.from_config(config)


def keep_fp32_modules(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Module names whose parameters stay float32 at this dtype, with each library's own rule: diffusers keeps
    `_keep_in_fp32_modules` in fp32 for fp16 and bf16; transformers only for fp16, and its `..._strict` list for
    both."""
    if dtype not in (torch.float16, torch.bfloat16):
        return []
    if not is_transformers_class(type(model)):
        return list(getattr(type(model), "_keep_in_fp32_modules", None) or [])
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or [])
    return sorted(keep)


def checkpoint_keys(model: nn.Module, stored: set[str]) -> dict[str, str]:
    """Model state_dict name -> checkpoint tensor name, for every state_dict entry found in the checkpoint.

    Identity for diffusers models. For transformers models the library's renaming rules map each stored key; a name
    that is not stored but is tied to one that is (T5's `encoder.embed_tokens` and `shared`, a tied LM head) reads
    the stored tensor.
    """
    names = list(model.state_dict().keys())
    if not is_transformers_class(type(model)):
        return {name: name for name in names if name in stored}
    mapping = _renamed(model, stored, set(names))
    tied: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    for group in tied.values():
        source = next((mapping[name] for name in group if name in mapping), None)
        for name in group:
            if source is not None:
                mapping.setdefault(name, source)
    return mapping


def _renamed(model: nn.Module, stored: set[str], names: set[str]) -> dict[str, str]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = dict.fromkeys(names, True)
    mapping: dict[str, str] = {}
    for key in sorted(stored):
        target, converted_by = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if converted_by is not None:
            raise UnsupportedModelError(
                f"{type(model).__name__}: checkpoint tensor {key!r} is converted by transformers at load time "
                f"(pattern {converted_by!r}: fused or split, not just renamed), which paradiff cannot read slice by "
                "slice. Load this component without paradiff (shard_text_encoders=False)."
            )
        if target in names:
            if target in mapping:
                raise CheckpointError(
                    f"{type(model).__name__}: checkpoint tensors {mapping[target]!r} and {key!r} both map to {target!r}."
                )
            mapping[target] = key
    return mapping
