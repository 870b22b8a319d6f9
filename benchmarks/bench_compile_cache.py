"""torch.compile and step caching on CPU: eager, compiled, cached and compiled + cached, single process, TP 2 and
Ulysses 2, on the FLUX.2-shaped transformer of bench_cp.py.

Per case, freshly spawned processes (one torch thread each, gloo on 127.0.0.1) run one warm-up forward (it compiles,
for the compiled variants; its time is reported separately) and then one 28-step flow-matching Euler loop (t from 1
to 0, batch 1, fp32) on fixed random latents and text; the time of that loop is the time per image (slowest rank).
"Image" here is the final latents: the model has random weights, so a decoded picture would mean nothing; the
quality figure is the PSNR of the final latents against the uncached single-process eager latents, with the
reference's value range as peak. Cached variants use diffusers' first-block cache through paradiff (decisions agreed
by all ranks); the steps that ran every block are listed.

The first-block threshold: a real FLUX model is usually run at 0.08-0.12; this random-weight model's first-block
residual changes by other amounts, so `--threshold auto` (default) takes the median of the step-to-step changes the
reference run measured (it carries a first-block cache at threshold 0, which computes every step; its only extra
work is one residual difference per step) and reports it.

The machine is shared: before each case the script waits (up to --quiet-wait s) for other processes to go quiet and
records the CPU-seconds other processes used while the case ran (`foreign CPU`); a case run next to a busy machine
says so in the table. Each rank's own CPU time over the loop is reported too (the slowest rank's): with one thread per
rank it measures the work done, which contention inflates far less than wall time.

    .venv/bin/python benchmarks/bench_compile_cache.py                       # 64x64 grid + 256 text = 4352 tokens
    .venv/bin/python benchmarks/bench_compile_cache.py --grid 32x32+128 --steps 8 --modes single   # quick check
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paradiff.config import mode_world_size  # noqa: E402
from _common import LoadWindow, foreign_cpu, machine_line, markdown_table, run_ranks, wait_for_quiet  # noqa: E402
from results import figure, write_result  # noqa: E402
from bench_cp import MODEL_CONFIG, build_inputs, build_model  # noqa: E402

VARIANTS = ("eager", "compiled", "cached", "compiled+cached")
MODES = ("single", "tp2", "ulysses2")


def denoise(model, inputs: dict, steps: int):
    """The flow-matching Euler loop a FLUX.2 pipeline runs, on the transformer alone."""
    import torch

    inputs = dict(inputs)
    latents = inputs.pop("hidden_states")
    inputs.pop("timestep")
    for step in range(steps):
        t, t_next = 1.0 - step / steps, 1.0 - (step + 1) / steps
        velocity = model(**inputs, hidden_states=latents, timestep=torch.full((latents.shape[0],), t),
                         return_dict=False)[0]
        latents = latents + (t_next - t) * velocity
    return latents


def case_worker(rank: int, world_size: int, mode: str, variant: str, grid: tuple[int, int, int], steps: int,
                threshold: float | None, backend: str, cache_spec: str | None = None) -> dict:
    import torch
    import torch.distributed as dist
    from diffusers import FirstBlockCacheConfig

    import paradiff

    torch.set_grad_enabled(False)
    model = build_model(MODEL_CONFIG)
    inputs = build_inputs(model, grid)
    if world_size > 1:
        paradiff.enable_parallelism(model, paradiff.ParallelConfig.from_mode(mode))
    if "compiled" in variant:
        paradiff.compile(model, backend=backend)
    monitor = None
    if "cached" in variant and cache_spec is not None:
        from paradiff.cli.args import cache_config

        monitor = paradiff.enable_cache(model, cache_config(cache_spec, model))
    elif "cached" in variant or threshold == 0.0:
        monitor = paradiff.enable_cache(model, FirstBlockCacheConfig(threshold=threshold))
    start = time.perf_counter()
    with model.cache_context("warm-up") if monitor is not None else _nothing():
        model(**inputs, return_dict=False)  # compiles the blocks (compiled variants)
    warmup_s = time.perf_counter() - start
    if monitor is not None:
        model._reset_stateful_cache()
        monitor.clear()
    if world_size > 1:
        dist.barrier()
    with LoadWindow() as window:
        with model.cache_context("cond") if monitor is not None else _nothing():
            latents = denoise(model, inputs, steps)
    result = {"rank": rank, "image_s": window.wall, "warmup_s": warmup_s,
              "window": {"system": window.system, "own": window.own, "wall": window.wall}}
    if monitor is not None:
        result["computed"] = monitor.computed_steps("cond")
        result["metrics"] = [d.metric for d in monitor.decisions if d.metric is not None]
    if rank == 0:
        result["latents"] = latents.float().numpy()
    return result


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def psnr(actual, reference) -> float:
    import numpy as np

    mse = float(np.mean((actual - reference) ** 2))
    peak = float(reference.max() - reference.min())
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def run_case(mode: str, variant: str, grid, steps: int, threshold, backend: str, quiet_wait: float,
             cache_spec: str | None = None) -> dict:
    busy_before = wait_for_quiet(timeout_s=quiet_wait)
    results = run_ranks(case_worker, mode_world_size(mode), timeout_s=3600, mode=mode, variant=variant, grid=grid,
                        steps=steps, threshold=threshold, backend=backend, cache_spec=cache_spec)
    return {
        "mode": mode, "variant": variant,
        "image_s": max(r["image_s"] for r in results),
        "image_cpu_s": max(r["window"]["own"] for r in results),
        "warmup_s": max(r["warmup_s"] for r in results),
        "foreign_cpu_s": foreign_cpu([r["window"] for r in results]),
        "busy_before": busy_before,
        "computed": results[0].get("computed"),
        "metrics": results[0].get("metrics"),
        "latents": results[0]["latents"],
    }


def parse_grid(text: str) -> tuple[int, int, int]:
    image, _, txt = text.partition("+")
    height, _, width = image.partition("x")
    return int(height), int(width), int(txt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", default="64x64+256", help="HxW image grid + text tokens (default 4352 tokens)")
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--modes", default="single,tp2,ulysses2")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threshold", default="auto", help="first-block cache threshold, or 'auto'")
    parser.add_argument("--cache", default=None,
                        help="a `paradiff generate --cache` spec for the cached variants instead of the first-block "
                             "cache at --threshold (e.g. taylorseer:4:3)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--quiet-wait", type=float, default=120.0, help="seconds to wait for a quiet machine")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    grid = parse_grid(args.grid)
    modes = args.modes.split(",")
    variants = args.variants.split(",")
    started = datetime.datetime.now().isoformat(timespec="minutes")

    # the reference: uncached single-process eager (with a threshold-0 cache that only measures)
    reference = run_case("single", "eager", grid, args.steps, 0.0, args.backend, args.quiet_wait)
    metrics = reference["metrics"]
    threshold = statistics.median(metrics) if args.threshold == "auto" else float(args.threshold)
    print(f"reference: {reference['image_s']:.1f} s/image; step-to-step first-block change: min {min(metrics):.4f} "
          f"median {statistics.median(metrics):.4f} max {max(metrics):.4f}; threshold {threshold:.4f}", flush=True)

    rows = []
    records = []
    figures = []
    eager_s = {}
    for mode in modes:
        for variant in variants:
            if mode == "single" and variant == "eager":
                result = reference
                result = dict(result, computed=None)
            else:
                result = run_case(mode, variant, grid, args.steps, threshold if "cached" in variant else None,
                                  args.backend, args.quiet_wait, args.cache if "cached" in variant else None)
            if variant == "eager":
                eager_s[mode] = (result["image_s"], result["image_cpu_s"])
            quality = psnr(result["latents"], reference["latents"])
            computed = result["computed"]
            rows.append([
                mode, variant, f"{result['image_s']:.1f}",
                f"{result['image_s'] / eager_s[mode][0]:.3f}" if mode in eager_s else "-",
                f"{result['image_s'] / reference['image_s']:.3f}",
                f"{result['image_cpu_s']:.1f}",
                f"{result['image_cpu_s'] / eager_s[mode][1]:.3f}" if mode in eager_s else "-",
                "inf (identical)" if quality == math.inf else f"{quality:.1f}",
                "all" if computed is None else f"{len(computed)} of {args.steps}",
                f"{result['warmup_s']:.1f}",
                f"{result['foreign_cpu_s']:.1f}",
            ])
            records.append({k: v for k, v in result.items() if k != "latents"} | {"psnr_db": quality})
            if variant in ("compiled", "compiled+cached") and mode in eager_s:
                ratio = round(result["image_cpu_s"] / eager_s[mode][1], 3)
                steps = "" if computed is None else f"{len(computed)} of {args.steps} steps computed; "
                figures.append(figure(f"{variant} / eager, {mode} (CPU time)", ratio, "x",
                                      "<= 0.5" if "cached" in variant else "<= 0.85",
                                      note=f"{steps}PSNR {quality:.1f} dB vs single eager"))
            print(markdown_table(HEADER, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(f"command: python benchmarks/bench_compile_cache.py {' '.join(sys.argv[1:])}")
    print(f"date: {started}; machine: {machine_line()}")
    print(f"grid {grid[0]}x{grid[1]} image + {grid[2]} text = {grid[0] * grid[1] + grid[2]} tokens, {args.steps} steps, "
          f"cache {args.cache or f'first-block, threshold {threshold:.4f}'}, backend {args.backend}")
    print(markdown_table(HEADER, rows))
    if figures:
        write_result("bench_compile_cache", f"torch.compile and step caching: FLUX.2-shaped transformer, {args.steps} "
                     f"steps, {grid[0] * grid[1] + grid[2]} tokens", figures)
    if args.json:
        Path(args.json).write_text(json.dumps({"threshold": threshold, "records": records}, indent=2, default=str))


HEADER = ["mode", "variant", "s / image", "x eager (same mode)", "x single eager", "CPU s / image (slowest rank)",
          "CPU x eager (same mode)", "PSNR vs single eager (dB)", "steps computed", "warm-up forward s (compile)",
          "foreign CPU s"]


if __name__ == "__main__":
    main()
