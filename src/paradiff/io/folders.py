"""Where a checkpoint lives: a local folder, or a Hub id fetched once into the local cache; and what a pipeline
folder's index (model_index.json, or a Modular Diffusers pipeline's modular_model_index.json) says it holds."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paradiff.errors import CheckpointError


def resolve_folder(path: str | os.PathLike, subfolder: str | None = None, hub_kwargs: dict[str, Any] | None = None,
                   pipeline: bool = False) -> Path:
    """The local folder of a model (`path`/`subfolder`) or, with `pipeline`, of a whole diffusers pipeline (which must
    hold a model_index.json, or a modular_model_index.json). A path that does not exist locally is a Hub id 'owner/name'; for a model only its
    configs and safetensors (or just `subfolder`) are downloaded, a pipeline is downloaded whole."""
    local = Path(path)
    if pipeline and local.is_dir():
        if not any((local / name).is_file() for name in INDEX_FILES):
            raise CheckpointError(f"{local} has neither a model_index.json nor a modular_model_index.json: not a "
                                  "diffusers pipeline folder.")
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


STANDARD_INDEX, MODULAR_INDEX = "model_index.json", "modular_model_index.json"
INDEX_FILES = (STANDARD_INDEX, MODULAR_INDEX)


@dataclass(frozen=True)
class PipelineIndex:
    """What a pipeline folder's index names. A standard pipeline's model_index.json maps each component to
    [library, class] in the subfolder of its name; a Modular Diffusers pipeline's modular_model_index.json maps each
    component loaded from weights to [library, class, loading spec], the spec naming the repository (a local folder
    or a Hub id) and subfolder it is read from, which may lie outside the folder."""

    folder: Path
    modular: bool
    class_name: str | None  # "_class_name": the pipeline class (a DiffusionPipeline or a ModularPipeline)
    components: dict[str, tuple[str, str]]  # name -> (library, class) of each component with weights or a config
    sources: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # name -> (repository, subfolder)
    config: dict[str, Any] = field(default_factory=dict)  # the other entries: the pipeline's own settings

    def entries(self) -> dict[str, Any]:
        """model_index.json's layout: the settings, and [library, class] for each component."""
        return {**self.config, **{name: list(entry) for name, entry in self.components.items()}}

    def location(self, name: str) -> tuple[str, str | None]:
        """(repository, subfolder) of component `name`: a local folder, or a Hub id to fetch."""
        return self.sources.get(name, (str(self.folder), name))


def has_modular_index_only(folder: str | os.PathLike) -> bool:
    """A folder that only a Modular Diffusers pipeline reads (it has no model_index.json)."""
    folder = Path(folder)
    return (folder / MODULAR_INDEX).is_file() and not (folder / STANDARD_INDEX).is_file()


def read_pipeline_index(folder: str | os.PathLike, modular: bool | None = None) -> PipelineIndex:
    """The index of pipeline folder `folder`. `modular`: read modular_model_index.json (True), model_index.json
    (False), or (None) model_index.json when there is one, else modular_model_index.json. A modular pipeline may also
    be read from a model_index.json (Modular Diffusers falls back to it): its components then lie in the folder."""
    folder = Path(folder)
    if modular is None:
        modular = has_modular_index_only(folder)
    use_modular_file = modular and (folder / MODULAR_INDEX).is_file()
    path = folder / (MODULAR_INDEX if use_modular_file else STANDARD_INDEX)
    if not path.is_file():
        raise CheckpointError(f"{folder} has no {path.name}: not a {'modular ' if modular else ''}diffusers "
                              "pipeline folder.")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); the file is corrupt.") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object of components; the file is corrupt.")
    components: dict[str, tuple[str, str]] = {}
    sources: dict[str, tuple[str, str | None]] = {}
    config: dict[str, Any] = {}
    for name, entry in raw.items():
        if name.startswith("_"):
            continue
        if use_modular_file and _is_modular_entry(entry):
            spec = entry[2]
            hint = spec.get("type_hint") or entry[:2]
            library, class_name = (hint[0], hint[1]) if hint[0] and hint[1] else (entry[0], entry[1])
            source = _modular_source(folder, spec)
            if not (isinstance(library, str) and isinstance(class_name, str)) or source is None:
                continue  # registered without a class, or without a place to load it from: nothing to load
            components[name] = (library, class_name)
            sources[name] = source
        elif not use_modular_file and _is_standard_entry(entry):
            components[name] = (entry[0], entry[1])
        elif not isinstance(entry, (list, tuple)):
            config[name] = entry
    return PipelineIndex(folder, modular, raw.get("_class_name"), components, sources, config)


def _is_standard_entry(entry: Any) -> bool:
    return isinstance(entry, (list, tuple)) and len(entry) == 2 and all(isinstance(e, str) for e in entry)


def _is_modular_entry(entry: Any) -> bool:
    return isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[2], dict)


def _modular_source(folder: Path, spec: dict) -> tuple[str, str | None] | None:
    """Where a modular component is read from (None: nowhere, Modular Diffusers leaves it unloaded). As Modular
    Diffusers does, a component whose files are in this folder is read here: a local copy of a repository keeps the
    index of the original, which points at the Hub."""
    subfolder = spec.get("subfolder") or None
    local = folder / (subfolder or "")
    if subfolder and local.is_dir() and any(local.iterdir()):
        return str(folder), subfolder
    repository = spec.get("pretrained_model_name_or_path")
    return (str(repository), subfolder) if repository else None
