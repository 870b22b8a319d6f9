"""A pipeline call's arguments, as `paradiff generate` and `paradiff serve` both build them: the size, steps and
guidance asked for (`call_kwargs`), conditioning images under the pipeline's own keywords (`image_kwargs`), and only
what the pipeline's call takes (`accepted_kwargs`, from `call_parameters`)."""

from __future__ import annotations

import inspect
from typing import Any

from paradiff.errors import ParallelConfigError


def call_kwargs(height: int, width: int, steps: int, guidance_scale: float | None = None,
                true_cfg_scale: float | None = None, negative_prompt: str | None = None, frames: int | None = None,
                extra: dict | None = None) -> dict:
    """The call's arguments (NumPy output); an option left None is the pipeline's own default. `extra`: what the
    pipeline needs besides (the embedded demo pipeline's prompt length)."""
    kwargs = dict(height=height, width=width, num_inference_steps=steps, output_type="np")
    if guidance_scale is not None:
        kwargs["guidance_scale"] = guidance_scale
    if true_cfg_scale is not None:
        kwargs["true_cfg_scale"] = true_cfg_scale
    if negative_prompt is not None:
        kwargs["negative_prompt"] = negative_prompt
    if frames is not None:
        kwargs["num_frames"] = frames
    kwargs.update(extra or {})
    return kwargs


def image_kwargs(images: list, mask=None, strength: float | None = None, pipeline_name: str | None = None) -> dict:
    """image= (one image, or a list: multi-reference editing), mask_image= and strength= as diffusers' calls take
    them (under `pipeline_name`'s own keywords when it is given): how --image / --mask / --strength, and `paradiff
    serve`'s edits, become call arguments."""
    from paradiff.plans.pipelines import call_keyword

    kwargs: dict = {}
    if images:
        kwargs["image"] = images[0] if len(images) == 1 else list(images)
    if mask is not None:
        kwargs["mask_image"] = mask
    if strength is not None:
        kwargs["strength"] = strength
    if pipeline_name is None:
        return kwargs
    return {call_keyword(pipeline_name, keyword): value for keyword, value in kwargs.items()}


def call_parameters(pipeline: Any) -> dict:
    """The parameters of the diffusers pipeline class's own __call__ (past paradiff's mixin, which takes **kwargs);
    for a Modular Diffusers pipeline, its blocks' inputs (name -> None)."""
    from paradiff.api.pipeline import ParallelPipelineMixin

    if is_modular_pipeline(pipeline):
        return dict.fromkeys(pipeline._blocks.input_names)
    for cls in type(pipeline).__mro__:
        if "__call__" in vars(cls) and cls is not ParallelPipelineMixin:
            return dict(inspect.signature(vars(cls)["__call__"]).parameters)
    return {}


def is_modular_pipeline(pipeline: Any) -> bool:
    from diffusers import ModularPipeline

    return isinstance(pipeline, ModularPipeline)


def accepted_kwargs(kwargs: dict, pipeline: Any) -> dict:
    """The call's arguments as the pipeline takes them: no image size where it makes no image (audio pipelines such
    as Stable Audio take a length in seconds, not --height / --width), and a max_area of the size asked for. A
    modular pipeline's call takes its blocks' inputs; an option it does not take is refused by flag."""
    parameters = call_parameters(pipeline)
    if is_modular_pipeline(pipeline):
        flags = {"negative_prompt": "--negative-prompt", "num_frames": "--frames"}
        ignored = [flags.get(key, key) for key in kwargs
                   if key not in parameters and key not in ("height", "width", "output_type")]
        if ignored:
            raise ParallelConfigError(f"{type(pipeline).__name__} (a modular pipeline) takes no {', '.join(ignored)};"
                                      f" its blocks take {', '.join(sorted(parameters))}")
    accepted = {key: value for key, value in kwargs.items()
                if key not in ("height", "width", "output_type") or key in parameters}
    if "max_area" in parameters and "height" in accepted and "width" in accepted:
        # FLUX.1 Kontext scales the requested size up to max_area (1024^2 by default): keep --height x --width
        accepted["max_area"] = accepted["height"] * accepted["width"]
    return accepted
