"""FSDP2 on CPU: per-rank peak RSS of fsdp2 against one process, and the step time of fsdp2 x ulysses2 against
ulysses2 alone (is the all-gather overlapped?).

Model: a FLUX.2-architecture `Flux2Transformer2DModel` with random weights (MODEL below), fp32, saved once to a
temporary folder and loaded shard-on-read by each case; batch 1, a 32x32 latent grid + 64 text tokens, one torch
thread per rank, gloo on 127.0.0.1, each case in the ranks of one pool (paradiff.testing.dist.RankPool).

Per case: peak anonymous RSS of each rank over the load and the forwards (max over ranks, and its rise over the
process before the load), and the median time per forward over --repeats after one warm-up (the slowest rank).
Before that, each rank loads and runs a tiny model of the same family in the same mode once, so that the rise counts
the model and its forward, not the modules the first load imports nor the process groups it makes (FSDP2 and DTensor
import tens of MB that a single process never imports: they were counted against fsdp2 before). For the FSDP modes,
the time of gathering every block once without computing (`unshard` / `reshard` in order) says how much of the step
the all-gathers would add without overlap.

    python benchmarks/bench_fsdp.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import tempfile
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import figure, write_result  # noqa: E402

MODEL = dict(layers=2, single_layers=22, head_dim=64, heads=8)
CASES = {"single": (1, "single"), "fsdp2": (2, "fsdp2"), "ulysses2": (2, "ulysses2"),
         "fsdp2xulysses2": (2, "fsdp2xulysses2")}


def run_case(folder: str, warm_folder: str, mode: str, repeats: int) -> dict:
    import gc

    import torch
    import torch.distributed as dist

    import paradiff
    from paradiff.runtime.memory import PeakSampler, rss_anon_reading
    from paradiff.testing.models import Lengths, make_inputs, model_class, run_forward

    torch.set_num_threads(1)
    cls = model_class("flux2")
    config = None if mode == "single" else paradiff.ParallelConfig.from_mode(mode)
    warm = paradiff.from_pretrained(cls, warm_folder, parallel_config=config)
    run_forward(warm, make_inputs("flux2", warm.config, batch=1, lengths=Lengths(height=4, width=4, text=8)))
    del warm
    gc.collect()
    before = rss_anon_reading()
    with PeakSampler() as sampler:
        model = paradiff.from_pretrained(cls, folder, parallel_config=config)
        inputs = make_inputs("flux2", model.config, batch=1, lengths=Lengths(height=32, width=32, text=64))
        run_forward(model, inputs)
        times = []
        for _ in range(repeats):
            if dist.is_initialized():
                dist.barrier()
            started = time.perf_counter()
            run_forward(model, inputs)
            times.append(time.perf_counter() - started)
    peak = max(sampler.peak.values())
    gather = []
    if "fsdp" in mode:
        from paradiff.runtime.state import get_state

        units = [model.get_submodule(name) for name in get_state(model).fsdp_blocks]
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            for unit in units:
                unit.unshard()
                unit.reshard()
            gather.append(time.perf_counter() - started)
    return {"peak_rss": peak, "rise": peak - max(before.values()), "times": times, "gather": gather}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from paradiff.testing.dist import RankPool
    from paradiff.testing.models import build_model, save_model

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(save_model(build_model("flux2", **MODEL), Path(tmp) / "flux2"))
        warm_folder = str(save_model(build_model("flux2", layers=2, single_layers=2), Path(tmp) / "warm"))
        for name, (world, mode) in CASES.items():
            pool = RankPool(world)
            try:
                per_rank = pool.run(run_case, timeout_s=900, folder=folder, warm_folder=warm_folder, mode=mode,
                                    repeats=args.repeats)
            finally:
                pool.close()
            step = [max(rank["times"][i] for rank in per_rank) for i in range(args.repeats)]
            results[name] = {"ranks": world, "peak_rss_mb": max(r["peak_rss"] for r in per_rank) / 1e6,
                             "rise_mb": max(r["rise"] for r in per_rank) / 1e6,
                             "step_s": statistics.median(step),
                             "gather_s": statistics.median([max(rank["gather"][i] for rank in per_rank)
                                                            for i in range(args.repeats)]) if "fsdp" in mode else 0.0}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"bench_fsdp: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"{platform.processor() or platform.machine()}, commit {commit}")
    print("| case | ranks | peak RSS / rank | rise / rank | step | every block gathered, no compute |")
    print("|---|---|---|---|---|---|")
    for name, row in results.items():
        print(f"| {name} | {row['ranks']} | {row['peak_rss_mb']:.0f} MB | {row['rise_mb']:.0f} MB | "
              f"{row['step_s'] * 1000:.0f} ms | {row['gather_s'] * 1000:.0f} ms |")
    single, fsdp = results["single"], results["fsdp2"]
    print(f"fsdp2 / single peak-RSS rise: {fsdp['rise_mb'] / single['rise_mb']:.2f} (goal <= 0.6); "
          f"fsdp2xulysses2 / ulysses2 step: {results['fsdp2xulysses2']['step_s'] / results['ulysses2']['step_s']:.2f}"
          " (goal <= 1.1)")
    sp, both = results["ulysses2"], results["fsdp2xulysses2"]
    write_result("bench_fsdp", "FSDP2 on CPU: per-rank peak RSS and step time, FLUX.2-architecture 24 blocks", [
        figure("peak RSS rise, fsdp2 / single", round(fsdp["rise_mb"] / single["rise_mb"], 3), "x", "<= 0.6",
               note="after a warm-up load in the same mode (imports and process groups not counted)"),
        figure("step, fsdp2 x ulysses2 / ulysses2", round(both["step_s"] / sp["step_s"], 3), "x", "<= 1.1",
               note=f"median of {args.repeats} steps, slowest rank; the step adds "
                    f"{(both['step_s'] - sp['step_s']) * 1000:.0f} ms, gathering every block without compute takes "
                    f"{both['gather_s'] * 1000:.0f} ms"),
    ])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
