"""Example inputs as data: the records a family's `INPUTS` declaration is made of.

A family declares the forward keywords of its tiny examples as a dict of these records (or, where its examples
differ, `ByExample({example name: dict})`); `plan_tools/example_inputs.py` materializes them, drawing every random
tensor from one generator in declaration order (depth first). Values that are not records (numbers, strings, None,
False) are passed as they are; dicts, lists and tuples are materialized item by item.

A dimension (`Dim`) is an int or an expression string over `batch`, the grid sizes `frames`, `height`, `width`,
`text`, the example's `name`, a per-sample `index` (inside `PerSample`), the whole `config` and its fields by their
bare names, e.g. `"height * patch_size"`, `"len(axes_dims_rope)"` or `"patch_size[0] * frames"`. Arithmetic,
comparisons, `and / or`, `x if c else y`, subscripts, `len / sum / max / min / int / float / tuple / list` and
`field("name", default)` (a config field the config may lack) are all an expression may use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Union

Dim = Union[int, str]
Shape = tuple[Dim, ...]
# (index, value) pairs applied in order after a tensor is made: `("-1, text // 2:", 0)` pads the last sample's
# second half of a (batch, text) mask. The index is numpy-style, its parts expressions as above.
Sets = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Noise:
    """Standard-normal noise of `shape`: latents, text embeddings, image embeddings."""

    shape: Shape


@dataclass(frozen=True)
class Uniform:
    """Uniform in [0, scale), drawn in `shape`, then `expand` and `set`: a timestep in [0, scale) per sample by
    default; per token, clean (0) on the first frame, with `expand` and `set`."""

    scale: float = 1.0
    shape: Shape = ("batch",)
    set: Sets = ()
    expand: Shape | None = None  # drawn in `shape`, then repeated to this shape (before `set`): one value per sample


@dataclass(frozen=True)
class Integers:
    """Integers in [low, high) of `shape`, then `set`: class labels, token ids (padded), integer timesteps."""

    high: Dim
    shape: Shape = ("batch",)
    low: Dim = 0
    set: Sets = ()


@dataclass(frozen=True)
class Full:
    """`torch.full(shape, value, dtype)` then `set`: masks (a padded last prompt), constant guidance, condition
    masks. Draws nothing."""

    shape: Shape
    value: Any = 1.0
    dtype: str | None = None  # a torch dtype's name ("bool", "long", ...); None: torch's default for `value`
    set: Sets = ()


@dataclass(frozen=True)
class Tensor:
    """`torch.tensor(values)`, each value a Dim (nested lists / tuples allowed); `per_sample`: the same row for each
    of the batch's samples, stacked. Draws nothing."""

    values: Any
    per_sample: bool = False
    dtype: str | None = None


@dataclass(frozen=True)
class Arange:
    """`torch.arange(start, stop)`, optionally `per_sample` (stacked once per sample); give `start` by keyword.
    Draws nothing."""

    stop: Dim
    start: Dim = 0
    per_sample: bool = False


@dataclass(frozen=True)
class GridIds:
    """FLUX-style position ids of a `rows` x `cols` token grid: an (rows * cols, axes) float tensor, zero but for
    its last two columns (the row, then the column, of each token in row-major order) and `fixed` {column: value}.
    Text ids are `GridIds(1, "text", axes)`. Draws nothing."""

    rows: Dim
    cols: Dim
    axes: Dim
    fixed: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class GridPositions:
    """The coordinates of every point of a grid of `sizes` (e.g. frames, rows, columns) in row-major order: an
    (axes, points) tensor, each axis times its `scale` (floats) and plus its `offset`; `points_first`: (points,
    axes); `per_sample`: repeated for each sample. Draws nothing."""

    sizes: Shape
    scale: tuple[float, ...] | None = None
    offset: tuple[Dim, ...] | None = None
    points_first: bool = False
    per_sample: bool = False


@dataclass(frozen=True)
class Cat:
    """The materialized `parts` concatenated along `dim` (the parts' common dtype)."""

    parts: tuple[Any, ...]
    dim: int = 0
    per_sample: bool = False  # the result repeated for each sample, stacked in front


@dataclass(frozen=True)
class Value:
    """A plain value from an expression (`Value("frames")`): an int, a tuple of sizes, ..."""

    expression: str


@dataclass(frozen=True)
class Repeat:
    """A list of `count` independent materializations of `item` (one draw each, in order)."""

    item: Any
    count: Dim


@dataclass(frozen=True)
class PerSample:
    """A list of one materialization of `item` per sample, `index` bound to the sample's index in its expressions."""

    item: Any


@dataclass(frozen=True)
class When:
    """`item` where the expression `condition` holds (e.g. `"guidance_embeds"`); otherwise the key is left out."""

    condition: str
    item: Any


@dataclass(frozen=True)
class Ref:
    """The input already materialized under `key` (declared earlier in this dict or one around it; "a.b" reaches
    into the dict `a`), times `scale`: a number or a record, materialized (`Ref("timestep", Uniform(shape=("batch",
    "frames")))` draws a tensor to multiply by)."""

    key: str
    scale: Any = 1.0


@dataclass(frozen=True)
class Call:
    """What `function` ("module:name", e.g. a diffusers rotary-table helper) returns for the materialized `args`
    and `kwargs` (strings pass as strings: wrap an expression in `Value`). Model code it names lives outside
    plans/ (diffusers, `paradiff.models.<family>`)."""

    function: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ByExample:
    """Different inputs per example: {example name: the dict of forward keywords}."""

    examples: Mapping[str, Mapping[str, Any]]


def image_inputs(text_width: str, flow: bool = False) -> dict:
    """An image DiT's example inputs: latents (batch, in_channels, the grid in patches of `patch_size`), `text`
    text tokens `text_width` wide and a timestep per sample, in [0, 1) before the text (`flow`) or in [0, 1000)
    after it; the model returns a tuple."""
    latents = Noise(("batch", "in_channels", "height * patch_size", "width * patch_size"))
    text = Noise(("batch", "text", text_width))
    if flow:
        return dict(hidden_states=latents, timestep=Uniform(), encoder_hidden_states=text, return_dict=False)
    return dict(hidden_states=latents, encoder_hidden_states=text, timestep=Uniform(1000), return_dict=False)


def text_mask(dtype: str = "bool", keep: str = "text - 2", length: Dim = "text") -> Full:
    """A (batch, `length`) key mask of ones whose last sample keeps only its first `keep` tokens (a shorter prompt,
    padded)."""
    return Full(("batch", length), 1, dtype, set=((f"-1, {keep}:", 0),))
