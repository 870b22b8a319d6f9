"""Functions run on every rank of a pool by tests/test_vae.py (gloo, CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import paradiff
from paradiff.comm import CommStats
from paradiff.testing.vaes import build_vae, run_vae, sample_input
from paradiff.vae import get_vae_runtime


def vae_equivalence(cases: list[dict]) -> dict:
    """Each case {name, kind, height, width, frames}: the split VAE's output equals a single-process call's."""
    torch.set_num_threads(1)
    references, splits, results = {}, {}, {}
    for case in cases:
        name, kind = case["name"], case["kind"]
        if name not in splits:
            references[name] = build_vae(name)
            splits[name] = paradiff.parallelize_vae(build_vae(name), stats=CommStats())
        sample = sample_input(name, references[name], kind, case["height"], case["width"], case.get("frames", 1))
        expected = run_vae(references[name], kind, sample)
        runtime = get_vae_runtime(splits[name])
        runtime.stats = CommStats()
        actual = run_vae(splits[name], kind, sample)
        region = "decoder" if kind == "decode" else "encoder"
        results[f"{name}-{kind}"] = {
            "shape": tuple(actual.shape), "expected_shape": tuple(expected.shape),
            "relative": float((actual - expected).abs().max() / expected.abs().max()),
            "rows": runtime.last_split.get(region), "calls": dict(runtime.stats.calls),
        }
    return {"rank": dist.get_rank(), "results": results}
