"""Cases on the embedded demo pipeline, run on every rank by tests/test_demo.py (gloo, CPU)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import paradiff
from paradiff.demo import CALL_KWARGS


def _config(tp: int = 1, ring: int = 1, ulysses: int = 1, dp: int = 1) -> paradiff.ParallelConfig:
    return paradiff.ParallelConfig.from_degrees(tp=tp, ring=ring, ulysses=ulysses, data=dp)


def generate_batch(folder: str, degrees: dict, prompts: list[str], steps: int, seed: int) -> dict:
    """All prompts in one call (one batch) on the mesh; the images from the output rank."""
    torch.set_num_threads(1)
    pipeline = paradiff.load_pipeline(folder, parallel_config=_config(**degrees))
    pipeline.set_progress_bar_config(disable=True)
    images = pipeline(prompt=prompts, seed=seed, num_inference_steps=steps, output_type="np", **CALL_KWARGS).images
    local = sum(p.numel() for p in pipeline.transformer.parameters())
    return {"rank": dist.get_rank(), "images": np.asarray(images) if pipeline.is_output_rank else None,
            "transformer_params": local}


def generate_in_modes(folder: str, modes: list[dict], prompts: list[str], steps: int, seed: int) -> list[dict]:
    """As `paradiff generate` does: prompt i with seed `seed + i`, shared out between the data replicas; per mode
    the images this rank made as an output rank, by prompt index."""
    torch.set_num_threads(1)
    results = []
    for degrees in modes:
        degrees = dict(degrees)
        whole = degrees.pop("whole_text_encoders", False)
        pipeline = paradiff.load_pipeline(folder, parallel_config=_config(**degrees), shard_text_encoders=not whole)
        pipeline.set_progress_bar_config(disable=True)
        made = {}
        with paradiff.split_between_processes(list(enumerate(prompts)), pipeline) as share:
            for index, prompt in share:
                image = pipeline(prompt=prompt, seed=seed + index, num_inference_steps=steps, output_type="np",
                                 **CALL_KWARGS).images[0]
                if pipeline.is_output_rank:
                    made[index] = np.asarray(image)
        results.append({"degrees": degrees, "images": made,
                        "transformer_params": sum(p.numel() for p in pipeline.transformer.parameters()),
                        "text_encoder_params": sum(p.numel() for p in pipeline.text_encoder.parameters())})
    return results


def lora_forward(folder: str, lora: str, degrees: dict) -> dict:
    """One forward of the demo transformer on the mesh with the demo LoRA loaded from its file, against diffusers'
    LoRA on the unsplit transformer (seeded inputs at the demo's size); and what this rank read of the file."""
    from diffusers import Flux2Transformer2DModel

    from paradiff.demo.tp_check import _inputs

    torch.set_num_threads(1)
    model = paradiff.from_pretrained(Flux2Transformer2DModel, folder, subfolder="transformer",
                                     parallel_config=_config(**degrees))
    reference = Flux2Transformer2DModel.from_pretrained(folder, subfolder="transformer").eval()
    inputs = _inputs(reference.config)
    with torch.no_grad():
        plain = reference(**inputs)[0]
        for module in (model, reference):
            module.load_lora_adapter(lora, adapter_name="swap", use_safetensors=True)
        actual, expected = model(**inputs)[0], reference(**inputs)[0]
    report = model._paradiff_lora_load
    return {"rank": dist.get_rank(),
            "rel_diff": float((actual - expected).abs().max() / expected.abs().max()),
            "lora_effect": float((expected - plain).abs().max() / plain.abs().max()),
            "bytes_read": report.bytes_read, "local_bytes": report.local_bytes, "sliced": report.sliced}
