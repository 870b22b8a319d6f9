"""The pipeline `paradiff generate` runs when no model is given."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("PARADIFF_CACHE", ".cache/paradiff"))


def embedded_default(cache: Path = DEFAULT_CACHE) -> Path:
    from ..testing.pipelines import save_pipeline

    return save_pipeline("flux2", cache / "tiny-flux2-pipeline")


def embedded_call_kwargs() -> dict:
    """Pipeline arguments the embedded pipeline needs beyond the command line's."""
    from ..testing.pipelines import default_call_kwargs

    defaults = default_call_kwargs("flux2")
    return {key: defaults[key] for key in ("max_sequence_length", "text_encoder_out_layers") if key in defaults}
