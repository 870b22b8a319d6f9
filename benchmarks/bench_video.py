"""A video transformer at a long sequence: single vs ulysses2 vs ring2 vs tp2, and the cost of the norm-across-heads
style (Wan's QK-norm under TP).

Model: WanTransformer3DModel at Wan2.1-1.3B widths (12 heads x 128, ffn 8960), 2 blocks, fp32, batch 1, random
weights (seeded, identical on every rank); input: 8 x 32 x 33 latent tokens after patchifying (8448) + 512 text
tokens. Each configuration runs in fresh processes, one thread per rank (so 2 ranks use 2 cores where the single
process uses 1: the ratio is the parallel speed-up). Reported: median ms per forward over --steps timed forwards
after one warm-up, and the CPU-seconds of the busiest rank per forward (all its threads: on a shared machine the wall
time also measures other processes, the CPU time does not; "other processes' CPU s" says how much they used while the
ranks ran); TP parameter bytes per rank; the max relative difference to the single-process output; for tp2,
the bytes the norm-across-heads all-reduces move per layer and the time spent in those norms.

    .venv/bin/python benchmarks/bench_video.py [--steps 2] [--frames 8] [--height 32] [--width 33]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paradiff.config import mode_world_size  # noqa: E402
from _common import (  # noqa: E402
    LoadWindow, cpu_seconds, foreign_cpu, machine_line, markdown_table, quiet_diffusers, run_ranks,
)
from results import figure, write_result  # noqa: E402

CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
              text_dim=1536, freq_dim=256, ffn_dim=8960, num_layers=2, rope_max_seq_len=1024)
MODES = ("single", "ulysses2", "ring2", "tp2")


def run_mode(rank: int, world_size: int, mode: str, steps: int, frames: int, height: int, width: int) -> dict:
    import torch
    from diffusers import WanTransformer3DModel

    import paradiff
    from paradiff.distributed.comm import CommStats
    from paradiff.tensor_parallel.layers import RowwiseLinear, ShardedNorm

    quiet_diffusers()
    torch.manual_seed(0)
    model = WanTransformer3DModel(**CONFIG).eval()
    full_bytes = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    if mode != "single":
        paradiff.enable_parallelism(model, paradiff.ParallelConfig.from_mode(mode))
    generator = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 16, frames, 2 * height, 2 * width, generator=generator),
                  encoder_hidden_states=torch.randn(1, 512, CONFIG["text_dim"], generator=generator),
                  timestep=torch.tensor([500.0]), return_dict=False)
    norm_stats, rowwise_stats = CommStats(), CommStats()
    norm_seconds = [0.0]
    for module in model.modules():
        if isinstance(module, ShardedNorm):
            module.comm_stats = norm_stats
        elif isinstance(module, RowwiseLinear):
            module.comm_stats = rowwise_stats
    starts: dict[int, float] = {}
    norms = [m for n, m in model.named_modules() if n.endswith(("norm_q", "norm_k"))]
    for norm in norms:
        norm.register_forward_pre_hook(lambda m, a: starts.__setitem__(id(m), time.perf_counter()))
        norm.register_forward_hook(
            lambda m, a, o: norm_seconds.__setitem__(0, norm_seconds[0] + time.perf_counter() - starts[id(m)]))
    with torch.no_grad():
        output = model(**inputs)[0]  # warm-up
        times, cpu = [], []
        window = LoadWindow().__enter__()
        for _ in range(steps):
            norm_seconds[0] = 0.0
            for stats in (norm_stats, rowwise_stats):
                stats.calls.clear()
                stats.bytes.clear()
            begin, cpu_begin = time.perf_counter(), cpu_seconds()
            output = model(**inputs)[0]
            times.append(time.perf_counter() - begin)
            cpu.append(cpu_seconds() - cpu_begin)
        window.__exit__()
    return {
        "ms": 1000 * statistics.median(times), "cpu_ms": 1000 * statistics.median(cpu),
        "window": {"system": window.system, "own": window.own, "wall": window.wall}, "output": output.numpy().copy() if rank == 0 else None,
        "block_bytes": sum(p.numel() * p.element_size() for p in model.blocks.parameters()),
        "full_block_bytes": full_bytes, "norm_ms": 1000 * norm_seconds[0],
        "norm_bytes": sum(norm_stats.bytes.values()), "norm_calls": sum(norm_stats.calls.values()),
        "rowwise_bytes": sum(rowwise_stats.bytes.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--height", type=int, default=32)
    parser.add_argument("--width", type=int, default=33)
    args = parser.parse_args()
    results = {}
    for mode, world in ((mode, mode_world_size(mode)) for mode in MODES):
        print(f"running {mode} ...", flush=True)
        results[mode] = run_ranks(run_mode, world, timeout_s=3600, mode=mode, steps=args.steps, frames=args.frames,
                                  height=args.height, width=args.width)
    reference = results["single"][0]["output"]
    single_ms = results["single"][0]["ms"]
    rows = []
    figures = []
    for mode, by_rank in results.items():
        worst = max(r["ms"] for r in by_rank)
        diff = float(abs(by_rank[0]["output"] - reference).max() / abs(reference).max())
        worst_cpu = max(r["cpu_ms"] for r in by_rank)
        rows.append([mode, f"{worst:.0f}", f"{worst / single_ms:.2f}", f"{worst_cpu:.0f}",
                     f"{worst_cpu / results['single'][0]['cpu_ms']:.2f}",
                     f"{foreign_cpu([r['window'] for r in by_rank]):.1f}",
                     f"{by_rank[0]['block_bytes'] / by_rank[0]['full_block_bytes']:.3f}", f"{diff:.1e}"])
        if mode != "single":
            figures.append(figure(f"{mode} forward / single", round(worst / single_ms, 3), "x", "<= 0.6",
                                  note=f"CPU of the busiest rank {worst_cpu / results['single'][0]['cpu_ms']:.2f}x"))
    tokens = args.frames * args.height * args.width
    print(f"\n{time.strftime('%Y-%m-%d')}; {machine_line()}")
    print(f"WanTransformer3DModel 12 x 128, ffn 8960, 2 blocks, fp32, {tokens} video + 512 text tokens, "
          f"median of {args.steps} forwards\n")
    print(markdown_table(["mode", "ms / forward", "x single", "CPU ms / forward (busiest rank)", "CPU x single",
                          "other processes' CPU s", "block bytes per rank / full", "max rel diff"], rows))
    write_result("bench_video", f"Wan-shaped video transformer at {tokens + 512} tokens: 2-rank modes vs single", figures)
    tp = results["tp2"][0]
    layers = CONFIG["num_layers"]
    print(f"\nnorm-across-heads under tp2: {tp['norm_calls'] // layers} all-reduces and "
          f"{tp['norm_bytes'] / layers / 1e3:.1f} kB per layer (rowwise projections: "
          f"{tp['rowwise_bytes'] / layers / 1e6:.1f} MB per layer); {tp['norm_ms'] / layers:.1f} ms per layer in "
          f"the QK norms, {tp['norm_ms'] / tp['ms'] * 100:.2f}% of the tp2 forward; single process: "
          f"{results['single'][0]['norm_ms'] / layers:.1f} ms per layer in the same norms.")


if __name__ == "__main__":
    main()
