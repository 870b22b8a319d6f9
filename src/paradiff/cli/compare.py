"""`--compare`: the same generations by diffusers' own pipeline in this one process, as the reference, and a
picture of both with their difference (compare.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from paradiff.io.outputs import Output, first_output
from paradiff.cli.pipeline_options import load_adapters, set_guider

# |difference| x AMPLIFY in compare.png: one level of 255 becomes a clearly visible grey, exact equality is black.
AMPLIFY = 50


def single_process_pipeline(model: str, dtype: torch.dtype, pipeline_cls: type | None = None,
                            gguf: dict[str, str] | None = None, quantization: Any = None):
    """diffusers' own pipeline of folder `model`, loaded whole in this process: a DiffusionPipeline, or a Modular
    Diffusers pipeline (modular_model_index.json, or a ModularPipeline class) with every component loaded. `gguf`:
    {transformer component: GGUF file}, those transformers being diffusers' `from_single_file` of the files,
    computing in `dtype`. `quantization` (--quantize): a PipelineQuantizationConfig, diffusers' own quantized load
    (docs/quantization.md: what paradiff's quantized shards equal)."""
    from diffusers import DiffusionPipeline, ModularPipeline

    from paradiff.io.folders import has_modular_index_only, read_pipeline_index

    modular = (pipeline_cls is None and has_modular_index_only(model)) or (
        pipeline_cls is not None and issubclass(pipeline_cls, ModularPipeline))
    transformers = {}
    if gguf:
        import importlib

        from diffusers import GGUFQuantizationConfig

        index = read_pipeline_index(model, modular if modular else None)
        for name, file in gguf.items():
            library, class_name = index.components[name][:2]
            repository, subfolder = index.location(name)
            transformers[name] = getattr(importlib.import_module(library), class_name).from_single_file(
                file, config=repository, subfolder=subfolder, torch_dtype=dtype,
                quantization_config=GGUFQuantizationConfig(compute_dtype=dtype))
    if modular:
        from paradiff.api.modular import modular_pipeline_object

        reference = modular_pipeline_object(pipeline_cls, model)
        reference.load_components(dtype=dtype)
        if transformers:
            reference.update_components(**transformers)
        return reference
    extra = {"quantization_config": quantization} if quantization is not None else {}
    reference = (pipeline_cls or DiffusionPipeline).from_pretrained(model, dtype=dtype, **transformers, **extra)
    if quantization is not None:  # bitsandbytes' 4-bit products as paradiff computes them, on every CPU
        from paradiff.quant.apply import float32_4bit_products

        for component in reference.components.values():
            if isinstance(component, torch.nn.Module):
                float32_4bit_products(component)
    return reference


def compare_single_process(model: str, dtype: torch.dtype, kwargs: dict, seed: int,
                           made: list[tuple[int, str, Output]], cache: str | None = None,
                           loras: list[dict] | None = None,
                           lora_weight_name: str | None = None,
                           pipeline_cls: type | None = None,
                           without_lora: list[tuple[int, str, Output]] | None = None,
                           guider: dict | None = None,
                           gguf: dict[str, str] | None = None,
                           quantization: Any = None) -> tuple[dict, list[Output]]:
    """Differences between each (index, prompt, image, video or sound) of `made` and diffusers' single-process
    result for that prompt (seed `seed + index`, as in the parallel run), with the same step cache on every
    transformer (`cache`, a --cache spec) when one is given, the same LoRA adapters (`loras`, from --lora), and the
    same pipeline class (`pipeline_cls`, from --pipeline; None: the folder's own), and for a Modular Diffusers
    pipeline the same guider settings (`guider`, e.g. the --guidance-scale its guider takes).

    `without_lora` (--also-without-lora): more (index, prompt, output) drawn with the adapters switched off; the
    reference draws them with its adapters off too. `gguf` (--gguf): {transformer component: GGUF file}; the
    reference's transformers are diffusers' `from_single_file` of those files, computing in `dtype`.
    `quantization` (--quantize): the reference is diffusers' own load with this PipelineQuantizationConfig.

    Returns ({"max_abs_diff": float over all of them, "compared": count}, for videos also "max_abs_diff_per_frame"
    (every frame is compared), "max_abs_diff_audio" when they have a soundtrack, "max_abs_diff_without_lora" over
    `without_lora`; the single-process outputs in the order of `made`, then of `without_lora`).
    """
    import paradiff

    reference = single_process_pipeline(model, dtype, pipeline_cls, gguf, quantization)
    reference.set_progress_bar_config(disable=True)
    if guider:
        set_guider(reference, guider)
    if loras:  # the same adapters, by diffusers alone
        load_adapters(reference, loras, lora_weight_name)
    if cache is not None:
        from paradiff.cli.args import cache_config

        for name, module in reference.components.items():
            if name.startswith("transformer") and isinstance(module, torch.nn.Module):
                # one process: no reduction, the same decisions
                paradiff.enable_cache(module, cache_config(cache, module))
    summary: dict = {"max_abs_diff": 0.0, "compared": len(made) + len(without_lora or [])}

    def check(index: int, prompt: str, output: Output) -> tuple[Output, float]:
        result = reference(prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed + index), **kwargs)
        expected = first_output(result)
        worst = _max_difference(expected.array, output.array, expected.kind)
        summary["max_abs_diff"] = max(summary["max_abs_diff"], worst)
        if expected.kind == "video":
            difference = np.abs(expected.array.astype(np.float64) - output.array.astype(np.float64))
            frames = [float(frame.max()) for frame in difference]
            earlier = summary.get("max_abs_diff_per_frame", frames)
            summary["max_abs_diff_per_frame"] = [max(a, b) for a, b in zip(earlier, frames)]
        if expected.audio is not None and output.audio is not None:
            summary["max_abs_diff_audio"] = max(summary.get("max_abs_diff_audio", 0.0),
                                                _max_difference(expected.audio, output.audio, "soundtrack"))
        return expected, worst

    expected_outputs = [check(*item)[0] for item in made]
    if without_lora:
        reference.disable_lora()
        summary["max_abs_diff_without_lora"] = 0.0
        for item in without_lora:
            expected, worst = check(*item)
            expected_outputs.append(expected)
            summary["max_abs_diff_without_lora"] = max(summary["max_abs_diff_without_lora"], worst)
        reference.enable_lora()
    return summary, expected_outputs


def _max_difference(expected: np.ndarray, actual: np.ndarray, kind: str) -> float:
    if expected.shape != actual.shape:
        raise RuntimeError(f"--compare: the single-process {kind} has shape {expected.shape}, the parallel one "
                           f"{actual.shape}")
    return float(np.abs(expected.astype(np.float64) - actual.astype(np.float64)).max())


def picture_rows(references: list[Output], made: list[tuple[int, str, Output]]
                 ) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[str]]:
    """compare.png's rows for `made` (index, prompt, output) and their single-process `references`: (single process,
    parallel) image pairs and each row's caption. An image is one row captioned with its prompt; a video three, its
    first, middle and last frames ("frame 12/24: prompt"); a sound none."""
    pairs, captions = [], []
    for reference, (_, prompt, output) in zip(references, made):
        if output.kind == "image":
            pairs.append((reference.array, output.array))
            captions.append(prompt)
        elif output.kind == "video":
            count = len(output.array)
            for frame in sorted({0, count // 2, count - 1}):
                pairs.append((reference.array[frame], output.array[frame]))
                captions.append(f"frame {frame}/{count - 1}: {prompt}")
    return pairs, captions


def write_compare_png(path: Path, pairs: list[tuple[np.ndarray, np.ndarray]], scale: int = 3,
                      column_titles: tuple[str, str] | None = None, captions: list[str] | None = None) -> None:
    """Per image: single process | parallel | |difference| x AMPLIFY, enlarged `scale` times; one such triple per
    row, in two columns of triples from five images on (or whenever `column_titles` name the two columns: the
    first half of `pairs` goes left, the second right). `captions` (one per pair, e.g. its prompt) are written above
    their rows, cut to the row's width."""
    from PIL import Image, ImageDraw

    def pixels(array: np.ndarray) -> np.ndarray:
        return (np.clip(array, 0, 1) * 255).round().astype(np.uint8)

    height, width = pairs[0][0].shape[:2]
    triples = []
    for single, parallel in pairs:
        difference = np.clip(np.abs(single.astype(np.float64) - parallel) * AMPLIFY, 0, 1)
        gap = np.full((height, 2, 3), 255, np.uint8)
        triple = np.concatenate([pixels(single), gap, pixels(parallel), gap, pixels(difference), gap], axis=1)
        triple = np.concatenate([triple, np.full((2, triple.shape[1], 3), 255, np.uint8)])
        triples.append(Image.fromarray(triple).resize((triple.shape[1] * scale, triple.shape[0] * scale),
                                                      Image.NEAREST))
    columns = 2 if len(triples) > 4 or column_titles else 1
    rows_per_column = -(-len(triples) // columns)
    caption = 12 if captions else 0  # one line of PIL's default font above each row
    row_width, row_height = triples[0].width, triples[0].height + caption
    top = 28 if column_titles else 14
    page = Image.new("RGB", (row_width * columns, top + row_height * rows_per_column), "white")
    draw = ImageDraw.Draw(page)
    for number, triple in enumerate(triples):
        x, y = number // rows_per_column * row_width, top + number % rows_per_column * row_height
        page.paste(triple, (x, y + caption))
        if captions:
            draw.text((x + 2, y), _fit(draw, captions[number], row_width - 4), fill="black")
    panel = (width + 2) * scale
    for column in range(columns):
        if column_titles:
            draw.text((column * 3 * panel + 2, 2), column_titles[column], fill="black")
        for position, label in enumerate(("single process", "parallel", f"|difference| x{AMPLIFY}")):
            draw.text((column * 3 * panel + position * panel + 2, top - 12), label, fill="black")
    page.save(path)


def _fit(draw, text: str, width: float) -> str:
    """`text`, cut and ended with "..." where it is wider than `width` pixels."""
    if draw.textlength(text) <= width:
        return text
    while text and draw.textlength(text + "...") > width:
        text = text[:-1]
    return text + "..."
