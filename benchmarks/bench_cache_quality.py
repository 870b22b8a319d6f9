"""Step caching on the trained demo pipeline: what skipping steps does to real pictures.

bench_compile_cache.py measures time on a random-weight FLUX.2-shaped transformer, where a "picture" means nothing.
Here the embedded demo pipeline (a trained tiny FLUX.2, paradiff/assets/demo) draws its default prompts at 28 steps,
uncached and with first-block caches of several thresholds and TaylorSeer; per variant: the steps that ran every
block, the PSNR of the decoded images (0-255) against the uncached images, and the time per image. Single process:
a cached parallel run equals the cached single-process run, decision for decision (tests/test_cache.py), so its
pictures are these.

    .venv/bin/python benchmarks/bench_cache_quality.py
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_line, markdown_table, quiet_diffusers, wait_for_quiet  # noqa: E402
from results import figure, write_result  # noqa: E402

DEFAULT_VARIANTS = "none,fbc:0.05,fbc:0.1,fbc:0.2,fbc:0.3,taylorseer:2:3,taylorseer:3:3"


def psnr(actual, reference) -> float:
    import numpy as np

    mse = float(np.mean((actual.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def generate(pipeline, prompts: list[str], steps: int, seed: int, spec: str):
    """(images as uint8 arrays, steps computed per prompt or None, seconds per image) for one cache variant."""
    import numpy as np
    import torch

    import paradiff
    from paradiff.cli.args import cache_config
    from paradiff.demo import CALL_KWARGS

    import copy

    transformer = pipeline.transformer = copy.deepcopy(pipeline.transformer)  # a fresh, uncached copy per variant
    monitor = None
    if spec != "none":
        monitor = paradiff.enable_cache(transformer, cache_config(spec, transformer))
    images, computed = [], []
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        image = pipeline(prompt=prompt, generator=torch.Generator().manual_seed(seed + index), num_inference_steps=steps,
                         output_type="np", **CALL_KWARGS).images[0]
        images.append(np.round(np.asarray(image) * 255).astype(np.uint8))
        if monitor is not None:
            computed.append(len(monitor.computed_steps("cond")))
            monitor.clear()
    seconds = (time.perf_counter() - start) / len(prompts)
    return images, (computed or None), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="'none' and --cache specs, comma separated")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline

    from paradiff.demo import DEFAULT_PROMPTS, pipeline_path

    quiet_diffusers()
    torch.set_num_threads(1)
    started = datetime.datetime.now().isoformat(timespec="minutes")
    wait_for_quiet(timeout_s=60)
    pipeline = DiffusionPipeline.from_pretrained(pipeline_path())
    pipeline.set_progress_bar_config(disable=True)
    prompts = list(DEFAULT_PROMPTS)
    reference = None
    rows = []
    figures = []
    original = pipeline.transformer
    for spec in args.variants.split(","):
        pipeline.transformer = original
        images, computed, seconds = generate(pipeline, prompts, args.steps, args.seed, spec)
        if reference is None:
            if spec != "none":
                raise SystemExit("the first variant must be 'none' (the uncached reference)")
            reference, reference_s = images, seconds
        scores = [psnr(a, b) for a, b in zip(images, reference)]
        finite = [s for s in scores if s != math.inf]
        rows.append([
            spec, "all" if computed is None else f"{np.mean(computed):.1f} of {args.steps}",
            f"{seconds:.2f}", f"{seconds / reference_s:.2f}",
            "identical" if not finite else f"{min(finite):.1f}",
            "identical" if not finite else f"{np.median(scores):.1f}",
        ])
        print(markdown_table(HEADER, rows[-1:]).splitlines()[-1], flush=True)
        if spec != "none" and finite:
            steps = f"{np.mean(computed):.1f} of {args.steps} steps computed" if computed is not None else ""
            figures.append(figure(f"{spec} worst picture", round(min(finite), 1), "dB",
                                  ">= 30" if spec.startswith("taylorseer") else None, note=steps))
    print()
    print(f"command: python benchmarks/bench_cache_quality.py {' '.join(sys.argv[1:])}")
    print(f"date: {started}; machine: {machine_line()}")
    print(f"{len(prompts)} default demo prompts, {args.steps} steps, 64x64, one thread")
    print(markdown_table(HEADER, rows))
    if figures:
        write_result("bench_cache_quality", f"Step caches on the trained demo pipeline: steps computed and picture "
                     f"PSNR, {args.steps} steps", figures)


HEADER = ["cache", "steps computed (mean)", "s / image", "x uncached", "PSNR min (dB)", "PSNR median (dB)"]


if __name__ == "__main__":
    main()
