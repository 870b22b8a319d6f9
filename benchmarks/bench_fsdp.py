"""FSDP2 on CPU: per-rank peak RSS of fsdp2 against one process, and the step time of fsdp2 x ulysses2 against
ulysses2 alone (is the all-gather overlapped?).

Models: FLUX.2-architecture `Flux2Transformer2DModel`s with random weights, fp32, saved once to a temporary folder and
loaded shard-on-read by each case; one torch thread per rank, gloo on 127.0.0.1, each case in the ranks of one pool
(paradiff.testing.dist.RankPool).
- memory (single, fsdp2) on `--model real` (default): FLUX.2-dev's block counts (8 double + 48 single blocks) at a
  hidden size of 768, 2.0 GB, so the weights dominate each process as they do in a real model (the largest block is
  3% of the model, as in FLUX.2-dev: FSDP gathers one block and prefetches the next); batch 1, a 16x16 latent grid +
  64 text tokens, one forward after the load. `--model small` is the 375 MB, 24-block model of earlier runs.
- step (ulysses2, fsdp2xulysses2; `--step`, off by default: minutes under load; `--only-step` runs it alone and
  prints it without recording; run without MALLOC_MMAP_THRESHOLD_, in a child process when it is set) on the small
  model at two shapes (STEP_SHAPES): a 32x32 latent grid + 64 text tokens, and 48x48 + 512, which does as much
  compute per weight as FLUX.2-dev at 1024x1024 (FSDP gathers every weight once a forward; the compute that hides it
  grows with the tokens): both models loaded in the
  same two ranks, their steps interleaved for --repeats rounds after one warm-up each, the median of the slowest
  rank's, with the CPU time of the main thread (compute) and of the other threads (gloo's transport) over each step.

Per case: the anonymous RSS of each rank as the case starts (the fixed per-process baseline: torch, diffusers and
gloo imported, the pool's process group made), then after a warm-up load and forward of a tiny model of the same
family in the same mode (so the rise counts the model and its forward, not the modules the first load imports nor the
process groups it makes), then its peak over the load and the forwards (max over ranks) and the weight bytes it holds.
For the FSDP step case, the time of gathering every block once without computing (`unshard` / `reshard` in order)
says how much of the step the all-gathers would add without overlap. Beside the memory cases, what `--dry-run` predicts
for each from the config alone (`plan_tools/memory.per_rank_bytes`), against the measured peak rise.

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/bench_fsdp.py [--model real|small] [--step | --only-step]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import tempfile
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import figure, this_command, write_result  # noqa: E402

MODELS = {"real": dict(layers=8, single_layers=48, head_dim=128, heads=6),
          "small": dict(layers=2, single_layers=22, head_dim=64, heads=8)}
MEMORY_CASES = {"single": (1, "single"), "fsdp2": (2, "fsdp2")}
STEP_CASES = {"ulysses2": (2, "ulysses2"), "fsdp2xulysses2": (2, "fsdp2xulysses2")}
# the step's shapes on the small model: (latent grid side, text tokens). "small": 2.5k FLOPs per weight a forward
# (plan_tools.cost.forward_cost), 3.5x less than FLUX.2-dev at 1024x1024 (4096 + 512 tokens: 8.8k); "dev": 48x48 +
# 512 tokens, 9.1k FLOPs per weight, FLUX.2-dev 1024x1024's compute per gathered weight (FSDP gathers every weight
# once a forward, whatever the tokens: the compute it has to hide behind grows with them)
STEP_SHAPES = {"small": (32, 64), "dev": (48, 512)}


def run_case(folder: str, warm_folder: str, mode: str, repeats: int, grid: int) -> dict:
    import gc

    import torch
    import torch.distributed as dist

    import paradiff
    from paradiff.fsdp.apply import held_weight_bytes
    from paradiff.runtime.memory import PeakSampler, release_freed_memory, rss_anon_reading
    from paradiff.testing.models import Lengths, make_inputs, model_class, run_forward

    torch.set_num_threads(1)
    baseline = max(rss_anon_reading().values())
    cls = model_class("flux2")
    config = None if mode == "single" else paradiff.ParallelConfig.from_mode(mode)
    warm = paradiff.from_pretrained(cls, warm_folder, parallel_config=config)
    run_forward(warm, make_inputs("flux2", warm.config, batch=1, lengths=Lengths(height=4, width=4, text=8)))
    del warm
    gc.collect()
    release_freed_memory(torch.device("cpu"))
    before = rss_anon_reading()
    with PeakSampler() as sampler:
        model = paradiff.from_pretrained(cls, folder, parallel_config=config)
        loaded = max(rss_anon_reading().values())
        inputs = make_inputs("flux2", model.config, batch=1, lengths=Lengths(height=grid, width=grid, text=64))
        run_forward(model, inputs)
        times = []
        for _ in range(repeats):
            if dist.is_initialized():
                dist.barrier()
            started = time.perf_counter()
            run_forward(model, inputs)
            times.append(time.perf_counter() - started)
    peak = max(sampler.peak.values())
    after = max(rss_anon_reading().values())  # the gathered blocks freed again: back to about `loaded`
    gather = []
    if "fsdp" in mode and repeats:
        from paradiff.runtime.state import get_state

        units = [model.get_submodule(name) for name in get_state(model).fsdp_blocks]
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            for unit in units:
                unit.unshard()
                unit.reshard()
            gather.append(time.perf_counter() - started)
    return {"baseline": baseline, "peak_rss": peak, "rise": peak - max(before.values()), "times": times,
            "gather": gather, "held": held_weight_bytes(model), "loaded": loaded - max(before.values()),
            "after": after - max(before.values())}


def thread_cpu_s() -> tuple[float, float]:
    """(this thread's CPU seconds, the other threads' of this process): the main thread computes, the others are
    gloo's transport threads (the sends and receives of the all-gathers and all-to-alls) and torch's."""
    import os
    import threading

    ticks = os.sysconf("SC_CLK_TCK")
    me, others = 0.0, 0.0
    for task in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{task}/stat").read().rpartition(")")[2].split()
        except OSError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        if int(task) == threading.get_native_id():
            me += seconds
        else:
            others += seconds
    return me, others


def minor_faults() -> int:
    """This process's minor page faults so far: each is a page of fresh memory touched for the first time (a new
    buffer the kernel maps and zeroes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_step_case(folder: str, warm_folder: str, rounds: int, grid: int, text: int) -> dict:
    """ulysses2 and fsdp2 x ulysses2 loaded side by side in the same two ranks, their steps interleaved round by
    round (a load change on the machine hits both), with each step's wall time and the CPU time of the main thread
    (compute) and of the process's other threads (gloo's transport) over it; then gathering every block once without
    compute."""
    import os

    import torch
    import torch.distributed as dist

    import paradiff
    from paradiff.runtime.state import get_state
    from paradiff.testing.models import Lengths, make_inputs, model_class, run_forward

    torch.set_num_threads(1)
    cls = model_class("flux2")
    models = {mode: paradiff.from_pretrained(cls, folder, parallel_config=paradiff.ParallelConfig.from_mode(mode))
              for mode in STEP_CASES}
    inputs = make_inputs("flux2", models["ulysses2"].config, batch=1,
                         lengths=Lengths(height=grid, width=grid, text=text))
    for model in models.values():
        run_forward(model, inputs)  # warm-up
    load = [os.getloadavg()[0]]
    rows = {mode: [] for mode in models}
    for round_ in range(rounds):
        for mode in (list(models) if round_ % 2 == 0 else list(models)[::-1]):
            dist.barrier()
            cpu, faults = thread_cpu_s(), minor_faults()
            started = time.perf_counter()
            run_forward(models[mode], inputs)
            wall = time.perf_counter() - started
            after = thread_cpu_s()
            rows[mode].append((wall, after[0] - cpu[0], after[1] - cpu[1], minor_faults() - faults))
    load.append(os.getloadavg()[0])
    fsdp = models["fsdp2xulysses2"]
    units = [fsdp.get_submodule(name) for name in get_state(fsdp).fsdp_blocks]
    gather = []
    for _ in range(rounds):
        dist.barrier()
        cpu, faults = thread_cpu_s(), minor_faults()
        started = time.perf_counter()
        for unit in units:
            unit.unshard()
            unit.reshard()
        after = thread_cpu_s()
        gather.append((time.perf_counter() - started, after[0] - cpu[0], after[1] - cpu[1], minor_faults() - faults))
    return {"rows": rows, "gather": gather, "load": load}


def build_fast(config: dict):
    """A FLUX.2-architecture model with random weights, made on the meta device and filled in place (diffusers'
    own initialisation of 2 GB takes minutes on a loaded machine). No buffers to fill: its rotary tables are
    computed in the forward."""
    import torch

    from paradiff.testing.models import model_class, tiny_config

    with torch.device("meta"):
        model = model_class("flux2")(**tiny_config("flux2", **config))
    assert not list(model.buffers())
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def run_cases(cases: dict, folder: str, warm_folder: str, repeats: int, grid: int) -> dict:
    from paradiff.testing.dist import RankPool

    results = {}
    for name, (world, mode) in cases.items():
        pool = RankPool(world)
        try:
            per_rank = pool.run(run_case, timeout_s=900, folder=folder, warm_folder=warm_folder, mode=mode,
                                repeats=repeats, grid=grid)
        finally:
            pool.close()
        results[name] = {"ranks": world, "baseline_mb": max(r["baseline"] for r in per_rank) / 1e6,
                         "peak_rss_mb": max(r["peak_rss"] for r in per_rank) / 1e6,
                         "rise_mb": max(r["rise"] for r in per_rank) / 1e6,
                         "loaded_mb": max(r["loaded"] for r in per_rank) / 1e6,
                         "after_mb": max(r["after"] for r in per_rank) / 1e6,
                         "held_mb": max(r["held"] for r in per_rank) / 1e6}
        if repeats:
            step = [max(rank["times"][i] for rank in per_rank) for i in range(repeats)]
            results[name]["step_s"] = statistics.median(step)
            results[name]["gather_s"] = statistics.median([max(rank["gather"][i] for rank in per_rank)
                                                           for i in range(repeats)]) if "fsdp" in mode else 0.0
        print(name, results[name], flush=True)
    return results


def run_step(folder: str, warm_folder: str, rounds: int, grid: int, text: int) -> dict:
    """Per mode: the median over rounds of the slowest rank's step, and of that rank's main-thread and other-thread
    CPU seconds over it; the same for gathering every block once."""
    from paradiff.testing.dist import RankPool

    pool = RankPool(2)
    try:
        per_rank = pool.run(run_step_case, timeout_s=1800, folder=folder, warm_folder=warm_folder, rounds=rounds,
                            grid=grid, text=text)
    finally:
        pool.close()

    def medians(rows_of) -> dict:
        slowest = [max((rows_of(rank)[i] for rank in per_rank), key=lambda row: row[0]) for i in range(rounds)]
        return {"step_s": statistics.median(r[0] for r in slowest), "main_cpu_s": statistics.median(r[1] for r in slowest),
                "other_cpu_s": statistics.median(r[2] for r in slowest),
                "faults": statistics.median(r[3] for r in slowest), "steps_s": [r[0] for r in slowest]}

    results = {mode: {"ranks": 2, **medians(lambda rank, mode=mode: rank["rows"][mode])} for mode in STEP_CASES}
    results["gather"] = medians(lambda rank: rank["gather"])
    results["load"] = per_rank[0]["load"]
    for name, row in results.items():
        print(name, row, flush=True)
    return results


def step_without_mmap_threshold(repeats: int, out: Path) -> dict:
    """The step cases in a child process (and its ranks) without MALLOC_MMAP_THRESHOLD_: the memory figure needs it
    (freed blocks leave the RSS), but it maps every allocation over 128 KB afresh, activations included, so each step
    faults in and zeroes all it allocates (360k page faults a step in ulysses2 alone, against a few dozen with glibc's
    default threshold): that measures malloc, not the all-gathers."""
    env = {key: value for key, value in os.environ.items() if key != "MALLOC_MMAP_THRESHOLD_"}
    subprocess.run([sys.executable, __file__, "--only-step", "--repeats", str(repeats), "--json", str(out)],
                   env=env, check=True)
    return json.loads(out.read_text())


def dry_run_peaks(cls: type, config: dict, image_tokens: int, text_tokens: int) -> dict[str, int]:
    """What `paradiff generate --dry-run` predicts per rank for each memory case (`plan_tools/memory.per_rank_bytes`
    on the model built on meta from its config: weights held, FSDP's gathers, activations), float32."""
    import torch

    import paradiff
    from paradiff.plan_tools.memory import meta_model, per_rank_bytes

    return {name: per_rank_bytes(meta_model(cls, config), paradiff.ParallelConfig.from_mode(mode), torch.float32,
                                 image_tokens=image_tokens, text_tokens=text_tokens).peak
            for name, (_world, mode) in MEMORY_CASES.items()}


def step_figures(steps: dict, repeats: int) -> list[dict]:
    """The step ratio at each of STEP_SHAPES (the goal on both), and the small shape's CPU time ratio."""
    figures = []
    for shape, name in (("small", "step, fsdp2 x ulysses2 / ulysses2"),
                        ("dev", "step at FLUX.2-dev 1024^2's compute per weight, fsdp2 x ulysses2 / ulysses2")):
        results = steps[shape]
        grid, text = STEP_SHAPES[shape]
        sp, both, gather = results["ulysses2"], results["fsdp2xulysses2"], results["gather"]
        what = ("" if shape == "small" else " (9.1k FLOPs per weight a forward, plan_tools.cost, as FLUX.2-dev's "
                "8.8k at 4096 + 512 tokens; the small shape has 2.5k)")
        figures.append(figure(
            name, round(both["step_s"] / sp["step_s"], 3), "x", "<= 1.1",
            note=f"the 375 MB 24-block model, {grid}x{grid} latent + {text} text tokens{what}; both loaded in the "
                 f"same 2 ranks, steps interleaved, median of {repeats} rounds, slowest rank: ulysses2 "
                 f"{sp['step_s'] * 1000:.0f} ms, fsdp2 x ulysses2 {both['step_s'] * 1000:.0f} ms "
                 f"(+{(both['step_s'] - sp['step_s']) * 1000:.0f} ms); CPU time over a step, main thread (compute) / "
                 f"other threads (gloo's transport): {sp['main_cpu_s'] * 1000:.0f} / {sp['other_cpu_s'] * 1000:.0f} "
                 f"ms against {both['main_cpu_s'] * 1000:.0f} / {both['other_cpu_s'] * 1000:.0f} ms; gathering "
                 f"every block once without compute: {gather['step_s'] * 1000:.0f} ms wall, "
                 f"{gather['main_cpu_s'] * 1000:.0f} / {gather['other_cpu_s'] * 1000:.0f} ms CPU; minor page "
                 f"faults per step {sp['faults']:.0f} against {both['faults']:.0f} (gathering alone "
                 f"{gather['faults']:.0f}); load average {results['load'][0]:.0f} as the steps began, "
                 f"{results['load'][1]:.0f} as they ended; glibc's default malloc (the steps run without "
                 "MALLOC_MMAP_THRESHOLD_, which the memory figure needs)"))
    small = steps["small"]
    cpu = {mode: small[mode]["main_cpu_s"] + small[mode]["other_cpu_s"] for mode in STEP_CASES}
    figures.append(figure(
        "step CPU time (all threads), fsdp2 x ulysses2 / ulysses2", round(cpu["fsdp2xulysses2"] / cpu["ulysses2"], 3),
        "x", None,
        note=f"the small shape's steps: {cpu['ulysses2'] * 1000:.0f} against {cpu['fsdp2xulysses2'] * 1000:.0f} ms of "
             "CPU per rank, the median of the slowest rank's (10 ms ticks): with a core per rank and nothing else "
             "running, gloo's transport threads find no idle core to overlap on and a step takes about its CPU "
             "time; the machine's load inflates these less than the wall times, but it does (shared caches)"))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="real")
    parser.add_argument("--step", action="store_true", help="also time ulysses2 against fsdp2 x ulysses2")
    parser.add_argument("--repeats", type=int, default=3,
                        help="with --step: interleaved rounds of the two step cases (default 3)")
    parser.add_argument("--only-step", action="store_true", help="skip the memory cases")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    from paradiff.testing.models import build_model, save_model

    with tempfile.TemporaryDirectory() as tmp:
        warm_folder = str(save_model(build_model("flux2", layers=2, single_layers=2), Path(tmp) / "warm"))
        results = {}
        if not args.only_step:
            model = build_fast(MODELS[args.model])
            model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
            largest = max(sum(p.numel() * p.element_size() for p in block.parameters()) for block in blocks)
            folder = str(save_model(model, Path(tmp) / "flux2"))
            dry_runs = dry_run_peaks(type(model), dict(model.config), image_tokens=16 * 16, text_tokens=64)
            del model
            results = run_cases(MEMORY_CASES, folder, warm_folder, repeats=0, grid=16)
        if (args.step or args.only_step) and "MALLOC_MMAP_THRESHOLD_" in os.environ:
            results.update(step_without_mmap_threshold(args.repeats, Path(tmp) / "step.json"))
        elif args.step or args.only_step:
            small = str(save_model(build_fast(MODELS["small"]), Path(tmp) / "small"))
            results["steps"] = {shape: run_step(small, warm_folder, rounds=args.repeats, grid=grid, text=text)
                                for shape, (grid, text) in STEP_SHAPES.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"bench_fsdp: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"{platform.processor() or platform.machine()}, commit {commit}, torch {torch.__version__}")
    if args.only_step:
        return  # a step-only run is printed, not recorded: the result file carries the memory figure too
    print("| case | ranks | baseline RSS / rank | peak RSS / rank | rise / rank | weights held / rank |")
    print("|---|---|---|---|---|---|")
    for name in MEMORY_CASES:
        row = results[name]
        print(f"| {name} | {row['ranks']} | {row['baseline_mb']:.0f} MB | {row['peak_rss_mb']:.0f} MB | "
              f"{row['rise_mb']:.0f} MB | {row['held_mb']:.0f} MB |")
    single, fsdp = results["single"], results["fsdp2"]
    blocks_text = (f"{len(blocks)} blocks, {model_bytes / 1e9:.2f} GB fp32, largest block {largest / 1e6:.0f} MB")
    figures = [
        figure("peak RSS rise, fsdp2 / single", round(fsdp["rise_mb"] / single["rise_mb"], 3), "x", "<= 0.6",
               note=f"FLUX.2 architecture, {blocks_text}; rise of the peak anonymous RSS over each rank's RSS "
                    f"after a warm-up load in the same mode: single {single['rise_mb']:.0f} MB, fsdp2 "
                    f"{fsdp['rise_mb']:.0f} MB per rank (holding {fsdp['held_mb']:.0f} MB of weights); whole "
                    f"peak: single {single['peak_rss_mb']:.0f} MB, fsdp2 {fsdp['peak_rss_mb']:.0f} MB "
                    f"({fsdp['peak_rss_mb'] / single['peak_rss_mb']:.2f}x), of which the fixed per-process "
                    f"baseline (torch, diffusers, gloo) is {single['baseline_mb']:.0f} MB"),
    ]
    off = {name: dry_runs[name] / 1e6 / results[name]["rise_mb"] for name in MEMORY_CASES}
    figures.append(figure(
        "--dry-run's peak against the measured peak rise, fsdp2 (off by)", round(abs(off["fsdp2"] - 1) * 100, 1),
        "%", "<= 10",
        note=f"predicted from the config alone (weights held, two gathered blocks, one block's activations): fsdp2 "
             f"{dry_runs['fsdp2'] / 1e6:.0f} MB against {results['fsdp2']['rise_mb']:.0f} MB measured "
             f"({off['fsdp2']:.2f}x), single {dry_runs['single'] / 1e6:.0f} MB against "
             f"{results['single']['rise_mb']:.0f} MB ({off['single']:.2f}x); the rise covers the load and a "
             f"forward at a 16x16 latent grid + 64 text tokens"))
    if args.step:
        figures += step_figures(results["steps"], args.repeats)
    write_result("bench_fsdp", f"FSDP2 on CPU: per-rank peak RSS, FLUX.2 architecture in {len(blocks)} blocks"
                 + (", and step time" if args.step else ""), figures,
                 command="MALLOC_MMAP_THRESHOLD_=131072 " + this_command())


if __name__ == "__main__":
    main()
