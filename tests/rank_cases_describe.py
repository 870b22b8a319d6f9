"""Functions run on every rank of a pool by tests/test_describe.py (gloo, CPU)."""

from __future__ import annotations

import paradiff
from paradiff.testing.models import model_class


def describe_a_split_model(family: str, folder: str, mode: str) -> dict:
    """Load `family` in `mode` and return what `paradiff.describe` finds: its counts by kind and its lines."""
    parallel = paradiff.ParallelConfig.from_mode(mode)
    model = paradiff.from_pretrained(model_class(family), folder, parallel_config=parallel)
    description = paradiff.describe(model)
    return {"counts": description.counts(), "lines": [str(change) for change in description.changes],
            "text": str(description)}
