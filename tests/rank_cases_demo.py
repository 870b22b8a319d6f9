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
