"""The embedded demo pipeline: a tiny FLUX.2 (`Flux2Pipeline`) trained on the captioned shapes data set.

`tools/train_demo.py` trains it (tokenizer, text encoder, autoencoder, transformer, scheduler) and writes it to
`paradiff/assets/demo/`, which ships with the package: `paradiff generate` without a model and `make demo` run it,
with no download.
"""

from __future__ import annotations

from pathlib import Path

from paradiff.demo.shapes import DEFAULT_PROMPTS

PIPELINE_DIR = Path(__file__).resolve().parents[1] / "assets" / "demo"
# The demo LoRA (tools/train_demo_lora.py): swaps the shape's colour and the background's, "a red circle on a blue
# background" drawing a blue circle on red. A diffusers-format file, loaded by `--lora` or `load_lora_weights`.
LORA_FILE = PIPELINE_DIR / "lora" / "colour_swap.safetensors"

# What the pipeline was trained for, beyond diffusers' FLUX.2 defaults (which are for FLUX.2-dev at 1024x1024):
# 64x64 images, prompts padded to 20 tokens. Four Euler steps draw clean shapes: the pixel rule
# (tests/demo_judge.py) finds as many shapes, colours and backgrounds as at 8 steps, and the demo LoRA swaps the
# colours as at 8, in half the time.
CALL_KWARGS = dict(height=64, width=64, max_sequence_length=20)
DEFAULT_STEPS = 4

__all__ = ["CALL_KWARGS", "DEFAULT_PROMPTS", "DEFAULT_STEPS", "LORA_FILE", "PIPELINE_DIR", "pipeline_path"]


def pipeline_path() -> Path:
    """The shipped pipeline folder; a clear error if the package was installed without its data files."""
    if not (PIPELINE_DIR / "model_index.json").is_file():
        raise FileNotFoundError(
            f"the embedded demo pipeline is missing from {PIPELINE_DIR}: reinstall paradiff with its package data, "
            "or rebuild it with `python tools/train_demo.py`"
        )
    return PIPELINE_DIR
