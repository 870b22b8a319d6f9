"""LoRA adapters on the FLUX.2-width transformer of bench_tp_step.py (CPU, gloo, one thread per rank, fp32, batch 1):
forward step time without an adapter, with one and with two unfused adapters, and with both fused; single process
and tp=2; the adapter bytes each rank holds and reads, and the load, switch, hot-swap and fuse times, the switches
next to a reload (loading the model again, then the adapter: what a fused-only TP needs to change adapters).

Model and inputs: bench_tp_step.py's (12 heads x 128, 2 double + 4 single blocks, 294 M parameters; 512 image + 128
text tokens), from its checkpoint. Adapters: three random rank-64 LoRAs (alpha 64, 32, 64) on every attention and
feed-forward Linear of every block (the 28 of the double blocks' attention and both streams' feed-forward, the
single blocks' fused projection in and out: 40 Linears), saved once as diffusers-format safetensors files.

Each configuration runs in fresh processes; inside them the variants are interleaved, round after round: no
adapter, load the first (timed), one adapter, load the second and `set_adapters` both (timed), two adapters,
`set_adapters` to other weights (timed), the third hot-swapped into the first one's layers (timed) and back,
`fuse_lora` (timed), fused, `unfuse_lora` and `unload_lora`. The model load is timed once per configuration. Each variant's step time is the median over every
round's timed steps (a step is timed between barriers; the slowest rank counts) in which other processes used under
0.1 core on average ("quiet steps"; all of them when fewer than 2 were), so the ratios compare steps taken minutes
apart at most, on the same loaded model. The machine is shared: each configuration first waits for it to go quiet.

    .venv/bin/python benchmarks/bench_lora.py [--rounds 3] [--steps 3] [--warmup 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))  # paradiff_testkit (docs/testing.md)

from _common import (  # noqa: E402
    LoadWindow,
    cpu_seconds,
    foreign_cpu,
    machine_line,
    markdown_table,
    quiet_diffusers,
    run_ranks,
    system_busy_seconds,
    wait_for_quiet,
)
from results import figure, write_result  # noqa: E402
from bench_tp_step import CONFIG, DEFAULT_FOLDER, _inputs, ensure_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LORA_FOLDER = ROOT / ".cache" / "bench" / "lora"
RANK = 64
# name: rank, alpha, seed ("swap": hot-swapped into the first one's layers)
ADAPTERS = {"first": (RANK, 64.0, 1), "second": (RANK, 32.0, 2), "swap": (RANK, 64.0, 3)}
DOUBLE = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
          "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
          "ff_context.linear_out")
SINGLE = ("attn.to_qkv_mlp_proj", "attn.to_out")
VARIANTS = ("no adapter", "1 adapter", "2 adapters", "2 fused")
CONFIGS = {"single": ("single process", 1), "tp2": ("tp=2 paradiff", 2)}


def targets() -> tuple[str, ...]:
    return tuple([f"transformer_blocks.{i}.{name}" for i in range(CONFIG["num_layers"]) for name in DOUBLE]
                 + [f"single_transformer_blocks.{i}.{name}" for i in range(CONFIG["num_single_layers"])
                    for name in SINGLE])


def ensure_loras(folder: Path) -> dict[str, str]:
    """The two adapter files, written once (random factors, scale 0.02; the Linears' shapes from a meta-device model)."""
    import torch
    from diffusers import Flux2Transformer2DModel

    from paradiff_testkit.lora import random_lora, save_lora

    files = {name: folder / f"{name}-r{rank}.safetensors" for name, (rank, _, _) in ADAPTERS.items()}
    if all(path.is_file() for path in files.values()):
        return {name: str(path) for name, path in files.items()}
    with torch.device("meta"):
        model = Flux2Transformer2DModel(**CONFIG)  # only the Linears' shapes are read
    for name, (rank, alpha, seed) in ADAPTERS.items():
        save_lora(files[name], random_lora(model, targets(), rank, seed=seed, scale=0.02), rank=rank, alpha=alpha)
    return {name: str(path) for name, path in files.items()}


def lora_worker(rank: int, world_size: int, folder: str, loras: dict[str, str], rounds: int, steps: int,
                warmup: int) -> dict:
    import torch
    import torch.distributed as dist
    from diffusers import Flux2Transformer2DModel

    import paradiff

    quiet_diffusers()
    # peft warns on every second adapter that the model already has one: that is the point here
    warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
    config = paradiff.TensorParallelConfig(world_size) if world_size > 1 else None

    def sync():
        if world_size > 1:
            dist.barrier()

    def load_model():
        return paradiff.from_pretrained(Flux2Transformer2DModel, folder, torch_dtype=torch.float32, progress=False,
                                        parallel_config=config).eval()

    sync()
    started = time.perf_counter()
    model = load_model()
    sync()
    model_load_s = time.perf_counter() - started
    inputs = _inputs(model.config)

    def timed(action) -> float:
        sync()
        start = time.perf_counter()
        action()
        sync()
        return time.perf_counter() - start

    def forward():
        with torch.inference_mode():
            return model(**inputs, return_dict=False)[0]

    times = {variant: [] for variant in VARIANTS}
    # per timed step: (machine busy CPU-s, this rank's CPU-s), to tell the steps other processes disturbed
    loads = {variant: [] for variant in VARIANTS}
    outputs, actions = {}, {"load first": [], "load second + set_adapters": [], "set_adapters switch": [],
                            "hot-swap first": [], "fuse_lora": [], "unfuse_lora": []}
    held, read = {}, {}

    def measure(variant: str) -> None:
        for _ in range(warmup):
            forward()
        for _ in range(steps):
            busy, own = system_busy_seconds(), cpu_seconds()
            times[variant].append(timed(forward))
            loads[variant].append((system_busy_seconds() - busy, cpu_seconds() - own))
        if variant not in outputs:
            outputs[variant] = forward().numpy().copy()

    def lora_bytes() -> int:
        return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".lora_" in name)

    with LoadWindow() as window:
        for round_index in range(rounds):
            measure("no adapter")
            actions["load first"].append(timed(lambda: model.load_lora_adapter(
                loras["first"], adapter_name="first", use_safetensors=True)))
            report = getattr(model, "_paradiff_lora_load", None)
            read["first"] = report.bytes_read if report is not None else None
            held["first"] = lora_bytes()
            measure("1 adapter")

            def load_second():
                model.load_lora_adapter(loras["second"], adapter_name="second", use_safetensors=True)
                model.set_adapters(["first", "second"], [1.0, 1.0])

            actions["load second + set_adapters"].append(timed(load_second))
            held["both"] = lora_bytes()
            measure("2 adapters")
            actions["set_adapters switch"].append(timed(lambda: model.set_adapters(["first", "second"], [0.5, 1.0])))
            model.set_adapters(["first", "second"], [1.0, 1.0])
            # another adapter of the same shape copied into the first one's layers (what a compiled model does)
            actions["hot-swap first"].append(timed(lambda: model.load_lora_adapter(
                loras["swap"], adapter_name="first", hotswap=True, use_safetensors=True)))
            model.load_lora_adapter(loras["first"], adapter_name="first", hotswap=True, use_safetensors=True)
            actions["fuse_lora"].append(timed(lambda: model.fuse_lora(lora_scale=1.0,
                                                                      adapter_names=["first", "second"])))
            measure("2 fused")
            actions["unfuse_lora"].append(timed(model.unfuse_lora))
            model.unload_lora()
            if round_index == 0:
                print(f"  rank {rank}: round 1 done", flush=True)
    return dict(rank=rank, times=times, loads=loads, actions=actions, outputs=outputs, held=held, read=read,
                model_load_s=model_load_s, window=dict(system=window.system, own=window.own, wall=window.wall))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default=str(DEFAULT_FOLDER))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before each variant's timed ones")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--no-wait", action="store_true", help="do not wait for other processes to go quiet")
    args = parser.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    started = time.time()
    folder = Path(args.folder)
    info = ensure_checkpoint(folder)
    loras = run_ranks(_ensure_loras_rank, 1, timeout_s=600, folder=str(LORA_FOLDER))[0]
    file_bytes = {name: Path(path).stat().st_size for name, path in loras.items()}
    print(f"checkpoint: {folder} ({info['parameters'] / 1e6:.0f}M params fp32); adapters {loras}", flush=True)

    results = {}
    for which in configs:
        label, world = CONFIGS[which]
        busy = None if args.no_wait else wait_for_quiet(timeout_s=60)
        ranks = run_ranks(lora_worker, world, timeout_s=1800, folder=str(folder), loras=loras, rounds=args.rounds,
                          steps=args.steps, warmup=args.warmup)
        results[which] = ranks
        print(f"  {label}: other processes {foreign_cpu([r['window'] for r in ranks]):.1f} CPU-s over "
              f"{max(r['window']['wall'] for r in ranks):.0f} s" +
              (f" (busy cores before start {busy:.2f})" if busy is not None else ""), flush=True)

    def slowest(ranks: list[dict], key: str, variant: str) -> list[float]:
        return [max(r[key][variant][i] for r in ranks) for i in range(len(ranks[0][key][variant]))]

    def quiet_steps(ranks: list[dict], variant: str) -> list[float]:
        """The variant's step times (slowest rank) in which other processes used under 0.1 core on average (the
        machine's busy CPU time minus every rank's own); all of them when fewer than 2 were that quiet."""
        times = slowest(ranks, "times", variant)
        foreign = [max(0.0, ranks[0]["loads"][variant][i][0] - sum(r["loads"][variant][i][1] for r in ranks))
                   for i in range(len(times))]
        quiet = [t for t, f in zip(times, foreign) if f < 0.1 * t]
        return quiet if len(quiet) >= 2 else times

    medians = {which: {v: statistics.median(quiet_steps(results[which], v)) for v in VARIANTS}
               for which in configs}
    rows = []
    for which in configs:
        base = medians[which]["no adapter"]
        reference = results["single"][0]["outputs"] if "single" in results else None
        for variant in VARIANTS:
            every = slowest(results[which], "times", variant)
            times = quiet_steps(results[which], variant)
            out = results[which][0]["outputs"][variant]
            diff = "n/a"
            if reference is not None:
                expected = reference[variant]
                diff = f"{float(abs(out - expected).max() / abs(expected).max()):.1e}"
            rows.append([CONFIGS[which][0], variant, f"{medians[which][variant]:.3f}",
                         f"{min(times):.3f}–{max(times):.3f}", f"{len(times)} of {len(every)}",
                         f"{100 * (medians[which][variant] / base - 1):+.1f}%", diff])
    print()
    print(f"machine: {machine_line()}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {args.rounds} round(s) x ({args.warmup} warm-up + "
          f"{args.steps} timed steps) per variant; total {time.time() - started:.0f}s")
    print()
    print(markdown_table(["configuration", "variant", "step s (median)", "min–max s", "quiet steps", "vs no adapter",
                          "rel max diff vs single process"], rows))
    print()

    def cpu_steps(ranks: list[dict], variant: str) -> list[float]:
        """Each timed step's CPU seconds on the busiest rank: what the step costs, less sensitive than wall time to
        other processes sharing the cores (they take turns, they do not add work)."""
        return [max(r["loads"][variant][i][1] for r in ranks) for i in range(len(ranks[0]["loads"][variant]))]

    cpu = {which: {v: statistics.median(cpu_steps(results[which], v)) for v in VARIANTS} for which in configs}
    cpu_rows = [[CONFIGS[which][0], variant, f"{cpu[which][variant]:.3f}",
                 f"{100 * (cpu[which][variant] / cpu[which]['no adapter'] - 1):+.1f}%"]
                for which in configs for variant in VARIANTS]
    print(markdown_table(["configuration", "variant", "CPU s per step, busiest rank (median)", "vs no adapter"],
                         cpu_rows))
    print()
    byte_rows = []
    for which in configs:
        for rank_result in results[which]:
            read = rank_result["read"]["first"]
            byte_rows.append([CONFIGS[which][0], rank_result["rank"], f"{rank_result['held']['first'] / 1e6:.1f}",
                              f"{rank_result['held']['both'] / 1e6:.1f}",
                              f"{read / 1e6:.1f}" if read is not None else f"(whole file: {file_bytes['first'] / 1e6:.1f})"])
    print(markdown_table(["configuration", "rank", "first adapter MB held", "both adapters MB held",
                          "first adapter MB read from its file"], byte_rows))
    print()
    action_rows = []
    for which in configs:
        for action in results[which][0]["actions"]:
            values = slowest(results[which], "actions", action)
            action_rows.append([CONFIGS[which][0], action, f"{statistics.median(values):.3f}",
                                " ".join(f"{v:.3f}" for v in values)])
    print(markdown_table(["configuration", "action", "s (median)", "every round"], action_rows))
    print()
    figures = []
    for which in configs:
        ranks = results[which]
        reload = max(r["model_load_s"] for r in ranks) + statistics.median(slowest(ranks, "actions", "load first"))
        for action in ("set_adapters switch", "hot-swap first"):
            share = 100 * statistics.median(slowest(ranks, "actions", action)) / reload
            print(f"{CONFIGS[which][0]}: {action} = {share:.2f}% of a reload (model load "
                  f"{max(r['model_load_s'] for r in ranks):.1f} s + first adapter load) -> "
                  f"{'MET' if share < 1 else 'MISSED'} (goal < 1%)")
            figures.append(figure(f"{action} / a reload, {CONFIGS[which][0]}", round(share, 2), "%", "< 1"))
    print()
    if set(configs) >= {"single", "tp2"}:
        for measure, table in (("wall", medians), ("CPU", cpu)):
            for variant in ("1 adapter", "2 adapters"):
                single = 100 * (table["single"][variant] / table["single"]["no adapter"] - 1)
                tp2 = 100 * (table["tp2"][variant] / table["tp2"]["no adapter"] - 1)
                print(f"target ({measure}): overhead of {variant} at tp2 <= single + 2 points: {tp2:+.1f}% vs "
                      f"{single:+.1f}% -> {'MET' if tp2 <= single + 2 else 'MISSED'}")
                if measure == "CPU":
                    figures.append(figure(f"unfused overhead of {variant}, tp2 minus single (CPU)",
                                          round(tp2 - single, 1), "points", "<= 2",
                                          note=f"{tp2:+.1f}% vs {single:+.1f}%"))
        held = [r["held"]["first"] for r in results["tp2"]]
        ratio = max(held) / results["single"][0]["held"]["first"]
        print(f"target: adapter bytes per rank at tp2 <= 0.6 x single: {ratio:.2f} -> "
              f"{'MET' if ratio <= 0.6 else 'MISSED'}")
        read = max(r["read"]["first"] for r in results["tp2"]) / file_bytes["first"]
        print(f"target: adapter bytes read from its file per rank at tp2 <= 0.6 x single (whole file): {read:.2f} -> "
              f"{'MET' if read <= 0.6 else 'MISSED'}")
        load = (statistics.median(slowest(results["tp2"], "actions", "load first"))
                / statistics.median(slowest(results["single"], "actions", "load first")))
        print(f"target: adapter load time at tp2 <= 0.6 x single: {load:.2f} -> {'MET' if load <= 0.6 else 'MISSED'}")
        figures += [figure("adapter bytes a rank, tp2 / single", round(ratio, 3), "x", "<= 0.6"),
                    figure("adapter load time, tp2 / single", round(load, 3), "x", "<= 0.6")]
    for which in configs:
        fused = 100 * (medians[which]["2 fused"] / medians[which]["no adapter"] - 1)
        fused_cpu = 100 * (cpu[which]["2 fused"] / cpu[which]["no adapter"] - 1)
        print(f"{CONFIGS[which][0]}: fused vs no adapter {fused:+.1f}% wall, {fused_cpu:+.1f}% CPU")
    if figures:
        write_result("bench_lora", "LoRA adapters on a split FLUX.2-shaped transformer (294 M, rank-64 adapters)",
                     figures)


def _ensure_loras_rank(rank: int, world_size: int, folder: str) -> dict[str, str]:
    return ensure_loras(Path(folder))


if __name__ == "__main__":
    main()
