"""Conditioning images as a pipeline call takes them: read from a file or bytes, turned upright as their EXIF
orientation says (a phone's JPEG is stored sideways with a tag), in the mode the call wants. `paradiff generate`'s
--image / --mask files and `paradiff serve`'s uploads go through the same reads."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

ORIENTATION = 0x0112  # the EXIF tag; values 5 to 8 swap width and height
SWAPPED = (5, 6, 7, 8)


def read_image(source: str | Path | bytes, mode: str = "RGB") -> Any:
    """The image at `source` (a path, or the file's bytes) as a PIL image in `mode`, upright."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
        return ImageOps.exif_transpose(image).convert(mode)


def upright_size(image: Any) -> tuple[int, int]:
    """(width, height) of an opened PIL image once turned upright, from its header alone (no pixel decoded)."""
    width, height = image.size
    return (height, width) if image.getexif().get(ORIENTATION, 1) in SWAPPED else (width, height)
