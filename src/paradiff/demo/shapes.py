"""The captioned shapes data set the embedded demo pipeline is trained on, drawn by code.

One shape (circle, square or triangle) in one of eight named colours on a background of another, at one of five
places and two sizes, 64x64 pixels. Captions name the colour, the shape and the background, and optionally the size
and the place: "a red circle on a blue background", "a small red circle on a blue background, top left".
`HELD_OUT` lists (shape, colour, background) combinations that training never sees: each of their pairs (shape and
colour, shape and background, colour and background) does occur in training, so a model that generates them has
combined what it learnt rather than recalled a picture.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

IMAGE_SIZE = 64

# Saturated and far apart, so that the nearest palette colour of a generated pixel names it without doubt.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (240, 220, 30),
    "orange": (245, 135, 15),
    "purple": (135, 45, 175),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
SHAPES = ("circle", "square", "triangle")
# Centre of the shape in pixels (x, y) for each place.
PLACES: dict[str, tuple[int, int]] = {
    "top left": (19, 19),
    "top right": (45, 19),
    "bottom left": (19, 45),
    "bottom right": (45, 45),
    "center": (32, 32),
}
# Width (= height) of the shape in pixels.
SIZES: dict[str, int] = {"small": 18, "large": 30}


def _held_out() -> tuple[tuple[str, str, str], ...]:
    names = list(COLOURS)
    combos = []
    for i, colour in enumerate(names):
        combos.append((SHAPES[i % 3], colour, names[(i + 3) % 8]))
        combos.append((SHAPES[(i + 1) % 3], colour, names[(i + 5) % 8]))
    return tuple(combos)


# 16 of the 168 (shape, colour, background) combinations: every colour twice as the shape's and twice as the
# background's, each (colour, background) pair held out for one shape only.
HELD_OUT: tuple[tuple[str, str, str], ...] = _held_out()


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    background: str
    place: str
    size: str

    def caption(self, with_size: bool = True, with_place: bool = True) -> str:
        first = f"{self.size} {self.colour}" if with_size else self.colour
        place = f", {self.place}" if with_place else ""
        return f"{_article(first)} {first} {self.shape} on {_article(self.background)} {self.background} background{place}"


def _article(phrase: str) -> str:
    return "an" if phrase[0] in "aeiou" else "a"


def combinations(held_out: bool) -> list[tuple[str, str, str]]:
    """The (shape, colour, background) triples of training (`held_out=False`) or of the held-out set."""
    held = set(HELD_OUT)
    every = [(s, c, b) for s in SHAPES for c in COLOURS for b in COLOURS if c != b]
    return [combo for combo in every if (combo in held) == held_out]


def scenes(held_out: bool = False) -> list[Scene]:
    """Every scene (combination x place x size) of training or of the held-out set, in a fixed order."""
    return [Scene(shape, colour, background, place, size)
            for shape, colour, background in combinations(held_out) for place in PLACES for size in SIZES]


def draw(scene: Scene, jitter: tuple[int, int, int] = (0, 0, 0)) -> np.ndarray:
    """The scene as a (64, 64, 3) uint8 image; `jitter` = (dx, dy, dsize) in pixels moves and resizes the shape.

    Edges are antialiased by drawing at 4x and averaging, so the autoencoder learns smooth edges, not aliasing.
    """
    scale = 4
    n = IMAGE_SIZE * scale
    cx, cy = PLACES[scene.place]
    dx, dy, dsize = jitter
    cx, cy = (cx + dx) * scale, (cy + dy) * scale
    half = (SIZES[scene.size] + dsize) * scale / 2
    y, x = np.mgrid[0:n, 0:n].astype(np.float32) + 0.5
    if scene.shape == "circle":
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= half**2
    elif scene.shape == "square":
        inside = (np.abs(x - cx) <= half) & (np.abs(y - cy) <= half)
    elif scene.shape == "triangle":  # apex up, base = height = size
        top, bottom = cy - half, cy + half
        rise = (y - top) / (bottom - top)
        inside = (y >= top) & (y <= bottom) & (np.abs(x - cx) <= rise * half)
    else:
        raise ValueError(f"unknown shape {scene.shape!r}; known: {SHAPES}")
    coverage = inside.reshape(IMAGE_SIZE, scale, IMAGE_SIZE, scale).mean(axis=(1, 3))[..., None]
    fg = np.asarray(COLOURS[scene.colour], np.float32)
    bg = np.asarray(COLOURS[scene.background], np.float32)
    return np.round(coverage * fg + (1 - coverage) * bg).astype(np.uint8)


def sample(rng: random.Random, held_out: bool = False) -> tuple[np.ndarray, str]:
    """One random (image, caption) pair: random scene, jitter of up to 2 pixels, size and place each named with
    probability 1/2 (so both "a red circle on a blue background" and the full caption are learnt)."""
    shape, colour, background = rng.choice(combinations(held_out))
    scene = Scene(shape, colour, background, rng.choice(list(PLACES)), rng.choice(list(SIZES)))
    jitter = (rng.randint(-2, 2), rng.randint(-2, 2), rng.randint(-2, 2))
    return draw(scene, jitter), scene.caption(with_size=rng.random() < 0.5, with_place=rng.random() < 0.5)


def all_captions(held_out: bool = False) -> list[str]:
    """Every caption a scene of training (or of the held-out set) can have, sorted."""
    captions = set()
    for scene in scenes(held_out):
        for with_size in (False, True):
            for with_place in (False, True):
                captions.add(scene.caption(with_size, with_place))
    return sorted(captions)


# Prompts of `paradiff generate` without a model: every shape and colour; the second of each pair is a held-out
# combination (tests check both).
DEFAULT_PROMPTS: tuple[str, ...] = (
    "a red circle on a blue background",
    "a large red circle on a yellow background, top left",
    "a yellow square on a purple background, center",
    "a large green triangle on a white background, bottom right",
    "a white triangle on a green background",
    "a yellow circle on a white background, center",
    "a black square on an orange background",
    "a small orange triangle on a green background, top right",
)
