"""One drawn example of tests/test_properties.py, run on every rank of the 4-rank pool."""

from __future__ import annotations

import torch.distributed as dist

import paradiff
from paradiff.testing.models import Lengths, build_model, make_inputs, run_forward


def run_example(family: str, heads: int, tp: int, ring: int, ulysses: int, height: int, width: int, text: int,
                batch: int) -> dict:
    """Either a paradiff error raised before any collective, or the single-process output."""
    try:
        model = build_model(family, heads=heads)
        reference = build_model(family, heads=heads)
        config = paradiff.ParallelConfig.from_degrees(tp=tp, ring=ring, ulysses=ulysses,
                                                      data=max(1, dist.get_world_size() // (tp * ring * ulysses)))
        paradiff.enable_parallelism(model, config)
    except paradiff.ParadiffError as exc:
        return {"outcome": "refused", "error": f"{type(exc).__name__}: {exc}", "stage": "setup"}
    inputs = make_inputs(family, reference.config, batch=batch, lengths=Lengths(height=height, width=width, text=text))
    try:
        actual = run_forward(model, inputs)
    except ValueError as exc:
        return {"outcome": "refused", "error": f"{type(exc).__name__}: {exc}", "stage": "forward"}
    return {"outcome": "ran", "diff": float((actual - run_forward(reference, inputs)).abs().max())}
