"""Which VAE classes diffusers' DiT pipelines use and whether `paradiff.parallelize_vae` splits each: docs/vae.md's
table. `tools/list_pipeline_vaes.py` finds the classes (importing every pipeline, so not in the test suite) and
writes the table; the status column comes from `plans/vae.py` here, and a test keeps it in step."""

from __future__ import annotations

import collections
import importlib
import inspect
import pkgutil
import typing

from paradiff.plans.vae import VAE_PLANS, VAE_REFUSALS, vae_refusal

MARKERS = ("<!-- vaes:start -->", "<!-- vaes:end -->")


def vae_status(class_name: str) -> str:
    if class_name in VAE_PLANS:
        return "split (decode and encode)"
    return f"whole on each rank: {vae_refusal(class_name)}"


def pipeline_vaes() -> dict[str, list[str]]:
    """VAE class -> the DiT pipelines (a `transformer` argument; Modular pipelines by package) whose `vae` is it."""
    import diffusers

    found: dict[str, set[str]] = collections.defaultdict(set)
    for name in dir(diffusers):
        if not name.endswith("Pipeline"):
            continue
        try:
            pipeline = getattr(diffusers, name)
            parameters = inspect.signature(pipeline.__init__).parameters
        except Exception:  # noqa: BLE001 - optional dependencies missing: not a pipeline this install can run
            continue
        if not any("transformer" in parameter for parameter in parameters) or "vae" not in parameters:
            continue
        for vae in _class_names(parameters["vae"].annotation):
            found[vae].add(name)
    for module in _modular_modules():
        for _, block in inspect.getmembers(module, inspect.isclass):
            if block.__module__ != module.__name__ or not isinstance(
                    inspect.getattr_static(block, "expected_components", None), property):
                continue
            try:
                specs = block().expected_components
            except Exception:  # noqa: BLE001 - blocks that need arguments name their components elsewhere too
                continue
            for spec in specs:
                if spec.name == "vae" and isinstance(spec.type_hint, type):
                    found[spec.type_hint.__name__].add(f"modular {module.__name__.split('.')[2]}")
    return {vae: sorted(pipelines) for vae, pipelines in sorted(found.items())}


def _class_names(annotation) -> list[str]:
    """The classes an annotation names (a postponed one is a string: "AutoencoderKL | None")."""
    if isinstance(annotation, str):
        return [part.strip() for part in annotation.split("|") if part.strip() not in ("None", "")]
    return [option.__name__ for option in typing.get_args(annotation) or (annotation,)
            if isinstance(option, type) and option is not type(None)]


def _modular_modules():
    import diffusers.modular_pipelines as modular

    for info in pkgutil.walk_packages(modular.__path__, modular.__name__ + "."):
        try:
            yield importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - optional dependencies missing
            continue


def vae_table(pipelines_by_vae: dict[str, list[str]]) -> str:
    lines = ["| VAE class | DiT pipelines | parallel VAE |", "|---|---|---|"]
    for vae, pipelines in pipelines_by_vae.items():
        shown = ", ".join(pipelines[:4]) + (f" (+{len(pipelines) - 4})" if len(pipelines) > 4 else "")
        lines.append(f"| `{vae}` | {len(pipelines)}: {shown} | {vae_status(vae)} |")
    return "\n".join(lines)


def unclassified(class_names) -> list[str]:
    """Classes neither split nor refused with a reason."""
    return [name for name in class_names if name not in VAE_PLANS and name not in VAE_REFUSALS]
