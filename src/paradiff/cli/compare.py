"""`--compare`: the same generations by diffusers' own pipeline in this one process, as the reference, and a
picture of both with their difference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# |difference| x AMPLIFY in compare.png: one level of 255 becomes a clearly visible grey, exact equality is black.
AMPLIFY = 50


def single_process_images(model: str, dtype: torch.dtype, kwargs: dict, seed: int,
                          outputs: list[tuple[int, str, np.ndarray]]) -> list[np.ndarray]:
    """diffusers' single-process image for each (index, prompt, parallel image) of `outputs`, prompt i with the
    seed `seed + i` as in the parallel run."""
    from diffusers import DiffusionPipeline

    reference = DiffusionPipeline.from_pretrained(model, dtype=dtype)
    reference.set_progress_bar_config(disable=True)
    return [np.asarray(reference(prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed + index),
                                 **kwargs).images[0])
            for index, prompt, _ in outputs]


def write_compare_png(path: Path, pairs: list[tuple[np.ndarray, np.ndarray]], scale: int = 3) -> None:
    """Per image: single process | parallel | |difference| x AMPLIFY, enlarged `scale` times; one such triple per
    row, in two columns of triples from five images on."""
    from PIL import Image, ImageDraw

    def pixels(array: np.ndarray) -> np.ndarray:
        return (np.clip(array, 0, 1) * 255).round().astype(np.uint8)

    height, width = pairs[0][0].shape[:2]
    triples = []
    for single, parallel in pairs:
        difference = np.clip(np.abs(single.astype(np.float64) - parallel) * AMPLIFY, 0, 1)
        gap = np.full((height, 2, 3), 255, np.uint8)
        triples.append(np.concatenate([pixels(single), gap, pixels(parallel), gap, pixels(difference), gap], axis=1))
    columns = 2 if len(triples) > 4 else 1
    rows_per_column = -(-len(triples) // columns)
    blank = np.full_like(triples[0], 255)
    triples += [blank] * (rows_per_column * columns - len(triples))
    gap = np.full((2, triples[0].shape[1], 3), 255, np.uint8)
    column_images = [np.concatenate([np.concatenate([t, gap]) for t in triples[c * rows_per_column:(c + 1) * rows_per_column]])
                     for c in range(columns)]
    grid = np.concatenate(column_images, axis=1)
    image = Image.fromarray(grid).resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST)
    page = Image.new("RGB", (image.width, image.height + 14), "white")
    page.paste(image, (0, 14))
    draw = ImageDraw.Draw(page)
    panel = (width + 2) * scale
    for column in range(columns):
        for position, label in enumerate(("single process", "parallel", f"|difference| x{AMPLIFY}")):
            draw.text((column * 3 * panel + position * panel + 2, 2), label, fill="black")
    page.save(path)
