"""The pipeline `paradiff generate` runs when no model is given: the trained demo pipeline shipped in the package
(`paradiff.demo`), which draws captioned shapes ("a red circle on a blue background, top left")."""

from __future__ import annotations

from pathlib import Path

from paradiff.demo import CALL_KWARGS, DEFAULT_PROMPTS, DEFAULT_STEPS, pipeline_path

__all__ = ["DEFAULT_PROMPTS", "DEFAULT_STEPS", "embedded_call_kwargs", "embedded_default"]


def embedded_default() -> Path:
    return pipeline_path()


def embedded_call_kwargs() -> dict:
    """Pipeline arguments the embedded pipeline needs beyond the command line's (its prompt length)."""
    return {"max_sequence_length": CALL_KWARGS["max_sequence_length"]}
