"""Where a checkpoint lives: a local folder, or a Hub id fetched once into the local cache."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from paradiff.errors import CheckpointError


def resolve_folder(path: str | os.PathLike, subfolder: str | None = None, hub_kwargs: dict[str, Any] | None = None,
                   pipeline: bool = False) -> Path:
    """The local folder of a model (`path`/`subfolder`) or, with `pipeline`, of a whole diffusers pipeline (which must
    hold a model_index.json). A path that does not exist locally is a Hub id 'owner/name'; for a model only its
    configs and safetensors (or just `subfolder`) are downloaded, a pipeline is downloaded whole."""
    local = Path(path)
    if pipeline and local.is_dir():
        if not (local / "model_index.json").is_file():
            raise CheckpointError(f"{local} has no model_index.json: not a diffusers pipeline folder.")
        return local
    if not pipeline and local.exists():
        folder = local / subfolder if subfolder else local
        if not folder.is_dir():
            raise CheckpointError(f"{folder} is not a folder (path={str(path)!r}, subfolder={subfolder!r}).")
        return folder
    if local.exists() or str(path).count("/") != 1:
        kind = "a pipeline folder" if pipeline else "a local folder"
        raise CheckpointError(f"{str(path)!r} is neither {kind} nor a Hub id of the form 'owner/name'.")
    from huggingface_hub import snapshot_download

    if pipeline:
        return Path(snapshot_download(str(path), **(hub_kwargs or {})))
    patterns = [f"{subfolder}/*"] if subfolder else ["*.json", "*.safetensors"]
    root = Path(snapshot_download(str(path), allow_patterns=patterns, **(hub_kwargs or {})))
    return root / subfolder if subfolder else root
