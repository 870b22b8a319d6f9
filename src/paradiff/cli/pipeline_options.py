"""What a run applies to a loaded pipeline besides its weights, the same in the workers and in the single-process
reference that `--compare` checks them against: the guider's settings and the --lora adapters."""

from __future__ import annotations

from typing import Any

from paradiff.errors import AdapterError


def set_guider(pipeline: Any, settings: dict) -> None:
    """Give a modular pipeline's guider(s) these settings (a new guider of the same class and config)."""
    for name in [name for name in pipeline.components if name.startswith("guider")] if settings else []:
        guider = getattr(pipeline, name)
        if guider is not None:
            pipeline.update_components(**{name: guider.new(**settings)})


def load_adapters(pipeline: Any, loras: list[dict], weight_name: str | None) -> None:
    """--lora: each adapter by diffusers' load_lora_weights (paradiff's on a split transformer), mixed by scale."""
    if not loras:
        return
    if not hasattr(pipeline, "load_lora_weights"):
        raise AdapterError(f"--lora: {type(pipeline).__name__} has no LoRA loader in diffusers (no load_lora_weights);"
                           " adapters work on pipelines whose class has one (FLUX, Qwen-Image, Wan, SD3 ...).")
    for lora in loras:
        pipeline.load_lora_weights(lora["path"], adapter_name=lora["adapter_name"], weight_name=weight_name)
    pipeline.set_adapters([lora["adapter_name"] for lora in loras], [lora["scale"] for lora in loras])
