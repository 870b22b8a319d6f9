"""Tiny, random, fully local, seeded instances of any diffusers DiT pipeline class, from declarative recipes.

A recipe (`Recipe`) is data: which tiny family's components to start from (`paradiff_testkit.pipelines`' families:
scheduler, VAE, text encoders, tokenizers) or which other recipe to extend, the transformer's config changes, the
components to add or replace, the pipeline's config arguments and the call's keyword arguments (images, masks,
control images as `Picture` / `Mask` specs). The generic code here reads the pipeline class's `__init__`: it passes
the components the class takes, leaves out the ones it does not, and builds a ControlNet the class's annotation names
from the transformer's config. A variant of a pipeline (Img2Img, Inpaint, Kontext, ControlNet ...) is one recipe
line on top of its base.

    from paradiff_testkit import zoo
    folder = zoo.save("FluxKontextPipeline", "/tmp/tiny-kontext")      # a real pipeline folder
    pipe = diffusers.FluxKontextPipeline.from_pretrained(folder)
    out = pipe(**zoo.call_kwargs("FluxKontextPipeline"), generator=torch.Generator().manual_seed(0))

Recipes live in `zoo/recipes/<group>.py` (each a `RECIPES` dict, found by name); a recipe's key is the pipeline
class name, or "Class@variant" for a second configuration of the same class. Nothing is downloaded.

A Modular Diffusers pipeline class is a key too, with a `ModularRecipe` (in `zoo/recipes/modular*.py`): either the
tiny standard pipeline of another recipe loaded through `ModularPipeline.from_pretrained` (diffusers maps the
standard class to its modular one) or, for models diffusers ships only as modular pipelines, a builder of its own;
`save` writes it as a modular pipeline folder (modular_model_index.json), its call returns `output`:

    folder = zoo.save("FluxModularPipeline", "/tmp/tiny-flux-modular")
    pipe = diffusers.ModularPipeline.from_pretrained(folder); pipe.load_components(dtype=torch.float32)
    images = pipe(**zoo.call_kwargs("FluxModularPipeline"), generator=torch.Generator().manual_seed(0),
                  output=zoo.recipe("FluxModularPipeline").output)
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import typing
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch

from paradiff_testkit import pipelines as tiny


@dataclass(frozen=True)
class Picture:
    """A seeded random RGB picture of `height` x `width` pixels (a call's `image` / `control_image` ...)."""

    height: int
    width: int
    seed: int = 7

    def make(self):
        import numpy as np
        from PIL import Image

        pixels = np.random.default_rng(self.seed).integers(0, 256, size=(self.height, self.width, 3), dtype=np.uint8)
        return Image.fromarray(pixels)


@dataclass(frozen=True)
class Mask:
    """A mask of `height` x `width`: white (repaint) on the right half, black (keep) elsewhere."""

    height: int
    width: int

    def make(self):
        import numpy as np
        from PIL import Image

        mask = np.zeros((self.height, self.width), dtype=np.uint8)
        mask[:, self.width // 2:] = 255
        return Image.fromarray(mask)


# A component factory: (seed, the components built so far, the transformer's config) -> the component.
Factory = Callable[[int, dict, dict], Any]


@dataclass(frozen=True)
class TinyFamily:
    """A tiny family a recipe module declares itself (`FAMILIES = {name: TinyFamily(...)}`), for pipelines whose
    components `paradiff_testkit.pipelines` does not make: the transformer's class and config, every other
    component from a seed, and the call's base arguments. Recipes name it as they name testing.pipelines' families."""

    transformer_class: str
    transformer: dict
    components: Callable[[int], dict]  # seed -> every component but the transformer
    call: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Recipe:
    """How to build one tiny pipeline and call it. Either `family` (a testing.pipelines family, or a recipe module's
    `TinyFamily`) or `extends`
    (another recipe's key) gives the starting point; the other fields are applied on top, in order."""

    family: str | None = None
    extends: str | None = None
    transformer: dict = field(default_factory=dict)  # changes to the transformer's config
    components: dict[str, Factory | None] = field(default_factory=dict)  # added or replaced (None: left out)
    controlnet: dict = field(default_factory=dict)  # changes to the ControlNet's config (taken from the transformer's)
    init: dict = field(default_factory=dict)  # the pipeline's non-module __init__ arguments
    call: dict = field(default_factory=dict)  # the call's keyword arguments, over the base's
    drop: tuple[str, ...] = ()  # the base's call arguments this pipeline does not take
    note: str = ""  # why the recipe looks the way it does, where it is not obvious
    # applied to the loaded pipeline on both sides of a comparison (diffusers' single process and every rank, after
    # paradiff split it): a step diffusers computes in reduced precision, run in float32 (the same formula), so
    # float32 reassociation noise is not magnified into a rounding flip; the recipe's note says which step
    numerics: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        if (self.family is None) == (self.extends is None):
            raise ValueError("a Recipe names either a family or the recipe it extends")


@dataclass(frozen=True)
class ModularRecipe:
    """How to build one tiny Modular Diffusers pipeline (the key names its modular class) and call it: either
    `standard`, the key of a standard recipe whose tiny pipeline is saved and loaded through
    `ModularPipeline.from_pretrained` (the key's class built on that folder with its default blocks where diffusers
    maps the standard class to another modular class, or to none), or `build`, seed -> the ModularPipeline with every component set
    (models diffusers ships only as modular pipelines)."""

    standard: str | None = None
    build: Callable[[int], Any] | None = None
    call: dict = field(default_factory=dict)  # over the standard recipe's call (with `build`: the whole call)
    drop: tuple[str, ...] = ()  # the standard recipe's call arguments the modular blocks do not take
    output: str = "images"  # what the call returns (`pipe(..., output=...)`): "images", "videos", "audio" ...
    note: str = ""
    # changes to the guider component's config, made after every load (`configure`): a modular folder does not keep
    # its guider's config (diffusers makes it from the blocks' defaults, which for some disable guidance)
    guider: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.standard is None) == (self.build is None):
            raise ValueError("a ModularRecipe names either the standard recipe it loads or a build function")


def _recipe_modules() -> list[str]:
    import paradiff_testkit.zoo.recipes as package

    return [f"{package.__name__}.{info.name}" for info in pkgutil.iter_modules(package.__path__)]


@lru_cache(maxsize=1)
def _registry() -> dict[str, Recipe | ModularRecipe]:
    recipes: dict[str, Recipe | ModularRecipe] = {}
    for module_name in _recipe_modules():
        for key, recipe in importlib.import_module(module_name).RECIPES.items():
            if key in recipes:
                raise ValueError(f"recipe {key!r} is defined twice (again in {module_name})")
            recipes[key] = recipe
    return recipes


@lru_cache(maxsize=1)
def _families() -> dict[str, TinyFamily]:
    families: dict[str, TinyFamily] = {}
    for module_name in _recipe_modules():
        for name, family in getattr(importlib.import_module(module_name), "FAMILIES", {}).items():
            if name in families or name in tiny.PIPELINE_FAMILIES:
                raise ValueError(f"tiny family {name!r} is defined twice (again in {module_name})")
            families[name] = family
    return families


def _family_config(family: str) -> dict:
    own = _families().get(family)
    return dict(own.transformer) if own is not None else tiny.transformer_config(family)


def _family_parts(family: str, seed: int, config: dict) -> dict:
    """Every component of the family's tiny pipeline, the transformer(s) of `config` included."""
    own = _families().get(family)
    if own is None:
        parts = tiny.family_components(family, seed)
        parts.update(tiny.family_transformers(family, seed, config))
        return parts
    import diffusers

    parts = own.components(seed)
    parts["transformer"] = tiny.random_model(getattr(diffusers, own.transformer_class), config, seed, 0)
    return parts


def _family_call(family: str) -> dict:
    own = _families().get(family)
    return dict(own.call) if own is not None else tiny.default_call_kwargs(family)


def names() -> list[str]:
    """Every recipe's key, sorted."""
    return sorted(_registry())


def pipeline_name(key: str) -> str:
    """The diffusers pipeline class a recipe builds ("WanPipeline@wan2.2" -> "WanPipeline")."""
    return key.partition("@")[0]


def pipeline_class(key: str) -> type:
    import diffusers

    return getattr(diffusers, pipeline_name(key))


def is_modular(key: str) -> bool:
    """Whether recipe `key` builds a Modular Diffusers pipeline (a `ModularRecipe`)."""
    return isinstance(_recipe_entry(key), ModularRecipe)


def _recipe_entry(key: str) -> Recipe | ModularRecipe:
    registry = _registry()
    if key not in registry:
        close = [name for name in registry if pipeline_name(key).lower()[:8] in name.lower()]
        raise KeyError(f"no tiny-pipeline recipe {key!r}; close: {close or sorted(registry)[:10]}")
    return registry[key]


def recipe(key: str) -> Recipe | ModularRecipe:
    """The recipe with everything it extends folded in: family, transformer / ControlNet / init changes, components
    and call arguments merged, the later recipe winning (a `ModularRecipe` as it is written)."""
    own = _recipe_entry(key)
    if isinstance(own, ModularRecipe) or own.extends is None:
        return own
    base = recipe(own.extends)
    call = {k: v for k, v in base.call.items() if k not in own.drop}
    call.update(own.call)
    return replace(base, transformer={**base.transformer, **own.transformer},
                   components={**base.components, **own.components},
                   controlnet={**base.controlnet, **own.controlnet}, init={**base.init, **own.init}, call=call,
                   drop=tuple(dict.fromkeys(base.drop + own.drop)), note=own.note or base.note,
                   numerics=own.numerics or base.numerics)


def transformer_config(key: str) -> dict:
    resolved = recipe(key)
    return {**_family_config(resolved.family), **resolved.transformer}


def fingerprint(key: str) -> str:
    """A short digest of what the recipe builds (its resolved fields, factories by name): a folder saved under
    another fingerprint holds another pipeline."""
    import hashlib

    def plain(value: Any) -> Any:
        if callable(value) and not isinstance(value, type):
            return f"{value.__module__}.{value.__qualname__}"
        if isinstance(value, dict):
            return {k: plain(v) for k, v in sorted(value.items())}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    resolved = recipe(key)
    if isinstance(resolved, ModularRecipe):
        what = {"class": pipeline_name(key), "build": resolved.build,
                "standard": resolved.standard and fingerprint(resolved.standard)}
        return hashlib.sha256(repr(plain(what)).encode()).hexdigest()[:10]
    text = repr(plain({"family": resolved.family, "transformer": transformer_config(key),
                       "components": resolved.components, "controlnet": resolved.controlnet, "init": resolved.init}))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def build(key: str, seed: int = 0, standard_folder: str | Path | None = None):
    """The tiny pipeline of recipe `key`, random weights, the same for the same seed; the caller's global RNG state
    is left untouched. `standard_folder`: for a modular key built from a standard recipe, that recipe's folder when
    it is saved already (with the same seed)."""
    resolved = recipe(key)
    if isinstance(resolved, ModularRecipe):
        return _build_modular(key, resolved, seed, standard_folder)
    cls = pipeline_class(key)
    config = transformer_config(key)
    parts = _family_parts(resolved.family, seed, config)
    for name, factory in resolved.components.items():
        if factory is None:
            parts.pop(name, None)
        else:
            parts[name] = factory(seed, parts, config)
    parameters = dict(list(inspect.signature(cls.__init__).parameters.items())[1:])
    taken = {name: value for name, value in parts.items() if name in parameters}
    for name, parameter in parameters.items():
        if name in taken or parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
            continue
        if name in resolved.init:
            taken[name] = resolved.init[name]
        elif _controlnet_class(parameter.annotation) is not None:
            taken[name] = controlnet_from_transformer(_controlnet_class(parameter.annotation), config, seed,
                                                      resolved.controlnet)
        elif parameter.default is inspect.Parameter.empty:
            raise TypeError(f"recipe {key!r}: {cls.__name__} needs a {name!r} component "
                            f"({_annotation_name(parameter.annotation)}) the recipe does not make")
    return tiny.finish_pipeline(cls(**taken))


def save(key: str, folder: str | Path, seed: int = 0, standard_folder: str | Path | None = None) -> Path:
    """Write `build(key, seed, standard_folder)` as a pipeline folder, a modular one for a modular key
    (testing.pipelines.save_pipeline_folder: renamed into place); does nothing if the folder holds a pipeline."""
    return tiny.save_pipeline_folder(folder, lambda: build(key, seed, standard_folder))


def configure(pipe, key: str):
    """What a loaded pipeline of recipe `key` needs before its call: a modular recipe's guider changes (on diffusers'
    pipeline and on paradiff's alike)."""
    resolved = recipe(key)
    if isinstance(resolved, ModularRecipe) and resolved.guider:
        pipe.update_components(guider=pipe.guider.new(**resolved.guider))
    return pipe


def _build_modular(key: str, resolved: ModularRecipe, seed: int, standard_folder: str | Path | None):
    """The tiny modular pipeline of `key`, every component loaded in float32."""
    import tempfile

    from diffusers import ModularPipeline

    cls = pipeline_class(key)
    if resolved.build is not None:
        pipe = resolved.build(seed)
    else:
        with tempfile.TemporaryDirectory(prefix="paradiff-zoo-standard-") as scratch:
            standard = str(standard_folder or save(resolved.standard, Path(scratch) / "standard", seed))
            try:
                pipe = ModularPipeline.from_pretrained(standard)
            except ValueError:  # a standard class diffusers maps to no modular class (ERNIE-Image)
                pipe = None
            if type(pipe) is not cls:  # mapped to another class, or none: the key's class, its default blocks
                pipe = cls(pretrained_model_name_or_path=standard)
            pipe.load_components(dtype=torch.float32)
            # diffusers logs a component it fails to load and goes on without it
            lost = [name for name, spec in pipe._component_specs.items()
                    if spec.default_creation_method == "from_pretrained" and getattr(pipe, name, None) is None
                    and (Path(standard) / name).is_dir()]
            if lost:
                raise RuntimeError(f"recipe {key!r}: {cls.__name__} did not load {lost} from {resolved.standard}'s "
                                   "folder")
    if type(pipe) is not cls:
        raise TypeError(f"recipe {key!r} built a {type(pipe).__name__}, not a {cls.__name__}")
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    return pipe


def call_kwargs(key: str) -> dict[str, Any]:
    """The recipe's call arguments, with its pictures and masks made (pass a generator or `seed=` along)."""
    def make(value: Any) -> Any:
        if isinstance(value, (Picture, Mask)):
            return value.make()
        if isinstance(value, list):
            return [make(item) for item in value]
        return value

    resolved = recipe(key)
    if isinstance(resolved, ModularRecipe):
        base = {} if resolved.standard is None else call_kwargs(resolved.standard)
        base = {k: v for k, v in base.items() if k not in resolved.drop}
    else:
        base = {k: v for k, v in _family_call(resolved.family).items() if k not in resolved.drop}
    return {name: make(value) for name, value in {**base, **resolved.call}.items()}


# --- ControlNets from their transformer's config -------------------------------------------------------------------

def _controlnet_class(annotation: Any) -> type | None:
    """The ControlNet model class an `__init__` annotation names (a Union of it, lists of it and a Multi wrapper:
    the single model)."""
    from diffusers import ModelMixin

    candidates = typing.get_args(annotation) or (annotation,)
    for candidate in candidates:
        if (isinstance(candidate, type) and issubclass(candidate, ModelMixin) and "ControlNet" in candidate.__name__
                and "Multi" not in candidate.__name__):
            return candidate
    return None


def _annotation_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", str(annotation))


def controlnet_from_transformer(cls: type, transformer_config: dict, seed: int, changes: dict) -> torch.nn.Module:
    """A ControlNet of `cls` with the transformer's config where the class takes the same keys, then `changes`.
    diffusers zero-initialises a ControlNet's residual projections and condition embedders (a fresh one changes
    nothing): those draw at tiny.CONTROLNET_RESIDUAL_STD, so residuals added to the wrong tokens change the image
    far beyond any tolerance."""
    accepted = inspect.signature(cls.__init__).parameters
    config = {k: v for k, v in transformer_config.items() if k in accepted}
    config.update(changes)
    zero: set[str] = set()

    def std_of(name: str) -> float | None:
        return tiny.CONTROLNET_RESIDUAL_STD if name in zero else None

    # which parameters the class zero-initialises: read from a real initialisation of the same config
    with tiny._seeded(seed, 6):
        probe = cls(**config)
    zero.update(name for name, param in probe.named_parameters() if not param.detach().any())
    del probe
    return tiny.random_model(cls, config, seed, 6, std_of=std_of)


# --- the DiT pipeline classes of the installed diffusers ----------------------------------------------------------

def dit_pipeline_classes() -> list[str]:
    """Every pipeline class diffusers exports whose `__init__` takes a `transformer` (imports every pipeline), and
    every Modular Diffusers class whose default blocks expect a `transformer` component (`modular_dit_classes`)."""
    from paradiff.plan_tools.coverage import diffusers_classes

    found = []
    for name, value in diffusers_classes(lambda name: "Pipeline" in name):
        try:
            parameters = inspect.signature(value.__init__).parameters
        except (TypeError, ValueError):
            continue
        if "transformer" in parameters:
            found.append(name)
    return sorted(found + list(modular_dit_classes()))


def modular_dit_classes() -> dict[str, list[str]]:
    """Every Modular Diffusers pipeline class diffusers exports that is a DiT pipeline, with its guider components
    (`modular_guiders`)."""
    from diffusers import ModularPipeline

    from paradiff.plan_tools.coverage import diffusers_classes

    found = {}
    for name, cls in diffusers_classes(lambda name: name.endswith("ModularPipeline") and name != "ModularPipeline"):
        if issubclass(cls, ModularPipeline):
            guiders = modular_guiders(name)
            if guiders is not None:
                found[name] = guiders
    return found


def modular_guiders(name: str) -> list[str] | None:
    """The guider components of the Modular Diffusers class `name`'s default blocks, or None when it is no DiT
    pipeline. A modular class is a DiT pipeline when the components its default blocks expect include a
    `transformer` (so StableDiffusionXLModularPipeline, a UNet's, is not one); the blocks are built, no component
    is. A class with no guider component never guides (guidance-distilled)."""
    import warnings

    import diffusers
    from diffusers.utils import logging

    from paradiff.runtime.cfg import is_guider_component

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # "Guiders are currently an experimental feature ..."
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            specs = getattr(diffusers, name)()._component_specs
    finally:
        logging.set_verbosity(verbosity)
    if "transformer" not in specs:
        return None
    return sorted(component for component in specs if is_guider_component(component))
