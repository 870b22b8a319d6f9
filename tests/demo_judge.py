"""A pixel rule that says what a generated shapes picture shows, written independently of the model and its data.

Background: the palette colour nearest to the median of the border pixels. Shape colour: the palette colour most
of the other pixels are nearest to (pixels near the background colour left out). Shape, from the shape's pixels
(the largest 4-connected region of pixels more than half way from the background colour to the shape's; a stray
pixel elsewhere would stretch the bounding box): a triangle (apex up) by the skewness of their rows, a square from a
circle by how much of their bounding box they fill (all of it, pi/4). Calibrated on the autoencoder's
reconstructions of 507 drawn training scenes (every third), which round the corners: squares fill 0.86-0.95
(5th-95th percentile), circles 0.77-0.88, triangles 0.59-0.78; triangles skew -0.51 to -0.13, the others -0.06 to
0.01. The rule names the drawn shape of 95% of those reconstructions.
"""

from __future__ import annotations

import numpy as np

from paradiff.demo.shapes import COLOURS

_NAMES = list(COLOURS)
_PALETTE = np.asarray([COLOURS[name] for name in _NAMES], np.float32)


def _nearest(pixels: np.ndarray) -> np.ndarray:
    return np.argmin(((pixels[..., None, :] - _PALETTE) ** 2).sum(-1), axis=-1)


def judge(image: np.ndarray) -> tuple[str, str, str]:
    """(shape, colour, background) of a (H, W, 3) image, uint8 or float in [0, 1]."""
    pixels = np.asarray(image, np.float32)
    if pixels.max() <= 1.0:
        pixels = pixels * 255.0
    border = np.concatenate([pixels[:2].reshape(-1, 3), pixels[-2:].reshape(-1, 3),
                             pixels[:, :2].reshape(-1, 3), pixels[:, -2:].reshape(-1, 3)])
    background = int(_nearest(np.median(border, axis=0)))
    labels = _nearest(pixels)
    far = np.linalg.norm(pixels - _PALETTE[background], axis=-1) > 60
    votes = np.bincount(labels[far & (labels != background)], minlength=len(_NAMES))
    if votes.sum() == 0:
        return "none", "none", _NAMES[background]
    colour = int(np.argmax(votes))
    # How far each pixel is from the background towards the shape's colour: edges blend the two, so a pixel counts as
    # the shape's when it is more than half way (blurred edges then neither add nor remove area).
    step = _PALETTE[colour] - _PALETTE[background]
    towards = ((pixels - _PALETTE[background]) @ step) / (step @ step)
    mask = towards > 0.5
    if not mask.any():
        return "none", _NAMES[colour], _NAMES[background]
    mask = largest_region(mask)
    rows, cols = np.nonzero(mask)
    box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
    fill = mask.sum() / box
    # a triangle (apex up) has most of its area low: a skewed row distribution, where circles and squares have none
    offsets = rows - rows.mean()
    skew = (offsets**3).mean() / max((offsets**2).mean(), 1e-9) ** 1.5
    shape = "triangle" if skew < -0.15 else "square" if fill > 0.86 else "circle"
    return shape, _NAMES[colour], _NAMES[background]


def largest_region(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected region of a boolean (H, W) mask."""
    seen = np.zeros_like(mask, bool)
    height, width = mask.shape
    best: list[tuple[int, int]] = []
    for start in zip(*np.nonzero(mask)):
        if seen[start]:
            continue
        seen[start] = True
        stack, region = [start], []
        while stack:
            row, col = stack.pop()
            region.append((row, col))
            for r, c in ((row + 1, col), (row - 1, col), (row, col + 1), (row, col - 1)):
                if 0 <= r < height and 0 <= c < width and mask[r, c] and not seen[r, c]:
                    seen[r, c] = True
                    stack.append((r, c))
        if len(region) > len(best):
            best = region
    out = np.zeros_like(mask, bool)
    rows, cols = zip(*best)
    out[list(rows), list(cols)] = True
    return out


def parse(prompt: str) -> tuple[str, str, str]:
    """(shape, colour, background) a shapes prompt asks for."""
    words = prompt.replace(",", " ").split()
    on = words.index("on")
    return words[on - 1], words[on - 2], words[on + 2]


def score(prompts: list[str], images: list[np.ndarray]) -> dict[str, float]:
    """Fraction of prompts whose background, shape colour and shape the rule finds as asked."""
    found = [judge(image) for image in images]
    wanted = [parse(prompt) for prompt in prompts]
    return {part: float(np.mean([f[i] == w[i] for f, w in zip(found, wanted)]))
            for i, part in enumerate(("shape", "colour", "background"))}
