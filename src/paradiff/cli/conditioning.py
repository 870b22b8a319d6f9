"""The conditioning inputs of `paradiff generate` (--image, --mask, --control-image, --video, --strength,
--controlnet-scale) and the
pipeline class they go to (--pipeline): checked before any process starts, read into the pipeline call's arguments
on every rank.

Each flag becomes the keyword diffusers' pipelines use for it, and only where the pipeline's `__call__` takes it:
--image -> image= (one image, or a list when repeated: multi-reference editing), --mask -> mask_image=,
--control-image -> control_image=, --video -> video= (a list of PIL frames), --last-image -> last_image= (the
last frame of first-last-frame video: Wan 2.1 FLF2V, SkyReels-V2 I2V), --reference-image -> reference_images= (a
list: Wan VACE), --strength -> strength=, --controlnet-scale -> controlnet_conditioning_scale= (how strongly a
ControlNet's residuals are added); a pipeline that names one of them otherwise gets it under its own keyword
(plans/pipelines.py, PipelineSpec.call_keywords).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
from pathlib import Path

from paradiff.api.pipeline_call import image_kwargs
from paradiff.cli.common import CliError, flag_error

# flag -> (the args attribute, the pipeline call's keyword)
FLAGS = {
    "--image": ("image", "image"),
    "--mask": ("mask", "mask_image"),
    "--control-image": ("control_image", "control_image"),
    "--video": ("video", "video"),
    "--last-image": ("last_image", "last_image"),
    "--reference-image": ("reference_image", "reference_images"),
    "--strength": ("strength", "strength"),
    "--controlnet-scale": ("controlnet_scale", "controlnet_conditioning_scale"),
}


def pipeline_class_name(args: argparse.Namespace) -> str | None:
    """The class `paradiff generate` runs: --pipeline, else the folder's model_index.json (or, for a Modular
    Diffusers pipeline, its modular_model_index.json); None when unknown (a Hub id not yet fetched)."""
    if getattr(args, "pipeline", None):
        return args.pipeline
    index = folder_index(args)
    return None if index is None else str(index.class_name)


def model_folder(args: argparse.Namespace) -> Path:
    if args.model is None:
        from paradiff.cli.embedded import embedded_default

        return embedded_default()
    return Path(args.model)


def folder_index(args: argparse.Namespace):
    """The pipeline index (io.folders.PipelineIndex) of the model folder, as `paradiff.load_pipeline` reads it; None
    when there is no local folder (a Hub id)."""
    from paradiff.io.folders import INDEX_FILES, read_pipeline_index

    folder = model_folder(args)
    if not any((folder / name).is_file() for name in INDEX_FILES):
        return None
    modular = True if getattr(args, "pipeline", None) and is_modular(pipeline_class(args.pipeline)) else None
    from paradiff.errors import CheckpointError

    try:
        return read_pipeline_index(folder, modular)
    except CheckpointError as exc:  # an index that is no JSON object
        raise CliError(str(exc)) from None


def pipeline_class(name: str) -> type:
    """The diffusers pipeline class called `name` (a DiffusionPipeline or a ModularPipeline), or a CliError listing
    the closest names."""
    from paradiff.api.load_spec import pipeline_class as named_class
    from paradiff.errors import LoadSpecError

    try:
        return named_class(name)
    except LoadSpecError as exc:
        raise flag_error(exc) from None


def is_modular(cls: type | None) -> bool:
    from diffusers import ModularPipeline

    return isinstance(cls, type) and issubclass(cls, ModularPipeline)


def call_parameter_names(cls: type, folder: Path | None = None) -> set[str] | None:
    """The keyword arguments a pipeline class's call takes: its __call__'s parameters, or for a Modular Diffusers
    pipeline its blocks' inputs; None when they cannot be known here (custom blocks, loaded with their own code)."""
    if not is_modular(cls):
        return set(inspect.signature(cls.__call__).parameters)
    blocks = modular_blocks(cls, folder)
    return None if blocks is None else set(blocks.input_names)


def modular_blocks(cls: type, folder: Path | None = None):
    """The blocks a Modular Diffusers pipeline of class `cls` runs: those `folder`'s modular_model_index.json names,
    else the class's default blocks (as ModularPipeline falls back); None when they are custom code."""
    import diffusers

    blocks_name = None
    index = folder / "modular_model_index.json" if folder is not None else None
    if index is not None and index.is_file():
        blocks_name = json.loads(index.read_text()).get("_blocks_class_name")
    blocks_cls = getattr(diffusers, blocks_name or "", None)
    if blocks_cls is None or not getattr(blocks_cls, "block_classes", None):
        blocks_cls = getattr(diffusers, cls.default_blocks_name or "", None)
    return None if blocks_cls is None else blocks_cls()


def check_conditioning(args: argparse.Namespace) -> None:
    """--pipeline names a diffusers pipeline; each conditioning flag is one its __call__ takes; every file is there
    and reads as an image (or video); a mask is as large as the (first) image."""
    given = [flag for flag, (attribute, _) in FLAGS.items() if getattr(args, attribute, None) is not None]
    name = pipeline_class_name(args)
    cls = None
    if getattr(args, "pipeline", None):
        cls = pipeline_class(name)
    elif given and name is not None:
        # the folder's own class; unknown (a custom or Hub pipeline): its signature is not checked here. Without a
        # conditioning flag there is nothing to check, and the launcher does not import diffusers for nothing.
        import diffusers

        cls = getattr(diffusers, name, None)
    from paradiff.plans.pipelines import call_keyword

    parameters = call_parameter_names(cls, model_folder(args)) if cls is not None else None
    if parameters is not None:
        for flag in given:
            keyword = call_keyword(name, FLAGS[flag][1])
            if keyword not in parameters:
                takes = [f for f, (_, k) in FLAGS.items() if call_keyword(name, k) in parameters]
                what = f"it takes {', '.join(takes)}" if takes else "it takes no conditioning input"
                example = ("a ControlNet pipeline (a folder with a controlnet component, e.g. FluxControlNetPipeline)"
                           if flag == "--controlnet-scale" else
                           "with --pipeline, e.g. an Img2Img, Inpaint or Kontext class on the same folder")
                raise CliError(f"{flag}: {name}'s __call__ takes no {keyword} ({what}); pick a pipeline class that "
                               f"does: {example}")
    if getattr(args, "strength", None) is not None and not 0.0 <= args.strength <= 1.0:
        raise CliError(f"--strength {args.strength}: expected a number from 0 to 1")
    scale = getattr(args, "controlnet_scale", None)
    if scale is not None and not math.isfinite(scale):
        raise CliError(f"--controlnet-scale {scale}: expected a finite number (1.0: the residuals as trained)")
    sizes = {"--image": [_image_size("--image", path) for path in args.image or []]}
    if args.control_image is not None:
        _image_size("--control-image", args.control_image)
    if getattr(args, "last_image", None) is not None:
        _image_size("--last-image", args.last_image)
    for path in getattr(args, "reference_image", None) or []:
        _image_size("--reference-image", path)
    if args.mask is not None:
        mask_size = _image_size("--mask", args.mask)
        if sizes["--image"] and mask_size != sizes["--image"][0]:
            (width, height), (image_width, image_height) = mask_size, sizes["--image"][0]
            raise CliError(f"--mask {args.mask} is {width}x{height} but --image {args.image[0]} is "
                           f"{image_width}x{image_height}; the mask must be as large as the image")
    if args.video is not None:
        _exists("--video", args.video)
        _read_video(args.video, frames_only=False)


def requested_pipeline_class(args: argparse.Namespace) -> type | None:
    """--pipeline's class; None when the folder's own class is to be used."""
    return pipeline_class(args.pipeline) if getattr(args, "pipeline", None) else None


def conditioning_kwargs(args: argparse.Namespace) -> dict:
    """The pipeline call's conditioning arguments, read from the files (every rank reads the same ones), under the
    keywords the pipeline class takes them by (its PipelineSpec's call_keywords, plans/pipelines.py: e.g. --video ->
    control_video=)."""
    from paradiff.io.images import read_image
    from paradiff.plans.pipelines import call_keyword

    kwargs = image_kwargs([read_image(path) for path in args.image or []],
                          read_image(args.mask, "L") if args.mask is not None else None)
    if args.control_image is not None:
        kwargs["control_image"] = read_image(args.control_image)
    if args.video is not None:
        kwargs["video"] = _read_video(args.video, frames_only=True)
    if getattr(args, "last_image", None) is not None:
        kwargs["last_image"] = read_image(args.last_image)
    if getattr(args, "reference_image", None):
        kwargs["reference_images"] = [read_image(path) for path in args.reference_image]
    if args.strength is not None:
        kwargs["strength"] = args.strength
    if getattr(args, "controlnet_scale", None) is not None:
        kwargs["controlnet_conditioning_scale"] = args.controlnet_scale
    if not kwargs:
        return kwargs
    name = pipeline_class_name(args)
    return {call_keyword(name, keyword): value for keyword, value in kwargs.items()}


def _exists(flag: str, path: str) -> None:
    if not Path(path).is_file():
        raise CliError(f"{flag} {path}: no such file")


def _image_size(flag: str, path: str) -> tuple[int, int]:
    """(width, height) of an image file, read from its header; a CliError when it is not there or not an image."""
    from PIL import Image, UnidentifiedImageError

    from paradiff.io.images import upright_size

    _exists(flag, path)
    try:
        with Image.open(path) as image:
            size = upright_size(image)  # as read_image turns it
        with Image.open(path) as image:  # verify only directly after an open
            image.verify()
        return size
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise CliError(f"{flag} {path}: not a readable image ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'unreadable'})") from None


def _read_video(path: str, frames_only: bool):
    """The frames of a video file as PIL images (PyAV); a CliError when it is not readable."""
    try:
        import av
    except ImportError:
        raise CliError(f"--video {path}: reading videos needs PyAV: pip install 'paradiff[video]'") from None
    try:
        with av.open(path) as container:
            frames = [frame.to_image() for frame in container.decode(video=0)]
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise CliError(f"--video {path}: not a readable video ({type(exc).__name__})") from None
    if not frames:
        raise CliError(f"--video {path}: holds no video frame")
    return frames
