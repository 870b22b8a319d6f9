"""What a run applies to a loaded pipeline besides its weights, the same in the workers and in the single-process
reference that `--compare` checks them against: the guider's settings and the --lora adapters
(`load_adapters`, api/load_spec.py)."""

from __future__ import annotations

from typing import Any

from paradiff.api.load_spec import load_adapters  # noqa: F401 - the workers' and the reference's adapters


def set_guider(pipeline: Any, settings: dict) -> None:
    """Give a modular pipeline's guider(s) these settings (a new guider of the same class and config)."""
    for name in [name for name in pipeline.components if name.startswith("guider")] if settings else []:
        guider = getattr(pipeline, name)
        if guider is not None:
            pipeline.update_components(**{name: guider.new(**settings)})
