"""Parallel VAE decode on CPU: `paradiff.parallelize_vae` at 1, 2 and 4 ranks, in the same run.

Models (random weights, seeded; the architecture and widths are what decides time and memory):
- "flux-kl": `AutoencoderKL` at FLUX.1's widths (block_out_channels 128/256/512/512, 2 layers per block, 16 latent
  channels, 32 norm groups), decoding one image (`--kl-size`, pixels; latent = size / 8).
- "wan": `AutoencoderKLWan` at Wan 2.1's widths (base_dim 96, z_dim 16, dim_mult 1/2/4/4, 2 res blocks), decoding one
  clip (`--wan-size` HxW pixels, `--wan-frames` output frames = 1 + 4 * (latent frames - 1)).
- "dc": Sana's `AutoencoderDC` (DC-AE f32c32: widths 128 ... 1024, 3 layers per stage, linear attention in the last
  three stages, 32 latent channels), decoding one image (`--dc-size`, pixels; latent = size / 32).
- "cogvideox": `AutoencoderKLCogVideoX` at CogVideoX-2b's widths (128/256/256/512, 3 layers per block, 16 latent
  channels), decoding one clip (`--cogvideox-size` HxW pixels, `--cogvideox-frames` = 1 + 4 * (latent frames - 1);
  up to 3 latent frames are one frame batch of its decoder, more are batches of 2 through its frame cache).

fp32, batch 1, one torch thread per rank, gloo on 127.0.0.1, every world size in freshly spawned processes. Per case:
the median decode time over --repeats timed decodes after one warm-up (per decode the slowest rank counts), and the
median CPU-seconds of the busiest rank per decode (all its threads: torch and gloo; on a shared machine the wall time
measures the other processes as much as the decode, the CPU time does not); per rank
the peak bytes of the tensors one decode creates (paradiff_testkit.memory.PeakTensorMemory: activations, halos and the
gathered output; weights excluded) and the rise of the process's peak RSS over a decode (VmHWM reset through
/proc/self/clear_refs, glibc's mmap threshold at 128 KiB so freed buffers go back to the OS); the max abs difference
of the decoded output to the 1-rank output. The machine is shared: each case waits for other processes to go quiet
and reports the CPU-seconds other processes used while it ran.

    nice -n 10 .venv/bin/python benchmarks/bench_vae.py                         # defaults below
    nice -n 10 .venv/bin/python benchmarks/bench_vae.py --kl-size 1024 --models flux-kl
    .venv/bin/python benchmarks/bench_vae.py --models flux-kl --kl-size 2048 --single-pass    # one decode per case
    nice -n 10 .venv/bin/python benchmarks/bench_vae.py --models dc,cogvideox --worlds 1,2
    .venv/bin/python benchmarks/bench_vae.py --quick                             # checks the script (seconds)
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import statistics
import sys
import time
import numpy as np
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))  # paradiff_testkit (docs/testing.md)

from _common import (  # noqa: E402
    LoadWindow,
    foreign_cpu,
    machine_line,
    markdown_table,
    quiet_diffusers,
    read_status,
    run_ranks,
    wait_for_quiet,
)
from results import figure, write_result  # noqa: E402

MB = 1e6
MODELS = {
    "flux-kl": ("AutoencoderKL", dict(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
        latent_channels=16, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False)),
    "wan": ("AutoencoderKLWan", dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                     temperal_downsample=[False, True, True])),
    "dc": ("AutoencoderDC", dict(
        in_channels=3, latent_channels=32, attention_head_dim=32,
        encoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
        decoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
        encoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
        decoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
        encoder_layers_per_block=(2, 2, 2, 3, 3, 3), decoder_layers_per_block=(3, 3, 3, 3, 3, 3),
        encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)), decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
        upsample_block_type="interpolate", downsample_block_type="Conv", decoder_norm_types="rms_norm",
        decoder_act_fns="silu", scaling_factor=0.41407)),
    "cogvideox": ("AutoencoderKLCogVideoX", dict(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(128, 256, 256, 512), latent_channels=16,
        layers_per_block=3, norm_num_groups=32, temporal_compression_ratio=4)),
}
QUICK = {
    "flux-kl": ("AutoencoderKL", dict(MODELS["flux-kl"][1], block_out_channels=(16, 32, 32, 32), norm_num_groups=8)),
    "wan": ("AutoencoderKLWan", dict(MODELS["wan"][1], base_dim=8)),
    "dc": ("AutoencoderDC", dict(MODELS["dc"][1], encoder_block_out_channels=(8, 16, 16, 16, 32, 32),
                                 decoder_block_out_channels=(8, 16, 16, 16, 32, 32), attention_head_dim=8)),
    "cogvideox": ("AutoencoderKLCogVideoX", dict(MODELS["cogvideox"][1], block_out_channels=(8, 16, 16, 32),
                                                 norm_num_groups=4)),
}
VIDEO_MODELS = ("wan", "cogvideox")


def _latent(model: str, config: dict, height: int, width: int, frames: int):
    import torch

    generator = torch.Generator().manual_seed(1)
    if model == "wan":
        shape = (1, config["z_dim"], 1 + (frames - 1) // 4, height // 8, width // 8)
    elif model == "cogvideox":
        shape = (1, config["latent_channels"], 1 + (frames - 1) // 4, height // 8, width // 8)
    elif model == "dc":
        shape = (1, config["latent_channels"], height // 32, width // 32)
    else:
        shape = (1, config["latent_channels"], height // 8, width // 8)
    return torch.randn(shape, generator=generator)


def _limit_mmap_threshold() -> None:
    """Freed multi-MB buffers go back to the OS at once, so the RSS high-water mark follows the live tensors."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except OSError:
        pass


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def decode_worker(rank: int, world_size: int, model: str, config: dict, height: int, width: int, frames: int,
                  repeats: int, single_pass: bool = False) -> dict:
    import diffusers
    import torch
    import torch.distributed as dist

    import paradiff
    from paradiff_testkit.memory import PeakTensorMemory

    _limit_mmap_threshold()
    quiet_diffusers()
    torch.manual_seed(0)
    vae = getattr(diffusers, MODELS[model][0])(**config).eval()
    if world_size > 1:
        paradiff.parallelize_vae(vae)
    latent = _latent(model, config, height, width, frames)

    def decode():
        with torch.no_grad():
            return vae.decode(latent).sample

    def sync():
        if world_size > 1:
            dist.barrier()

    def measured_decode() -> tuple:
        """One decode with its time (wall, CPU), peak tensor bytes and peak RSS rise."""
        gc.collect()
        sync()
        status, _ = read_status()
        reset = _reset_peak_rss()
        with PeakTensorMemory() as memory:
            start, cpu_start = time.perf_counter(), time.process_time()
            output = decode()
            elapsed = (time.perf_counter() - start, time.process_time() - cpu_start)
        after, _ = read_status()
        rise = (after["VmHWM"] - status.get("RssAnon", 0) - status.get("RssFile", 0)
                - status.get("RssShmem", 0)) if reset else None
        return output, elapsed, memory.peak, rise

    times, cpu = [], []
    if single_pass:  # one decode, timed and memory-measured at once (no warm-up): for decodes of many minutes
        with LoadWindow() as window:
            output, (wall, cpu_s), peak, rise = measured_decode()
        times, cpu = [wall], [cpu_s]
    else:
        decode()  # warm-up (and, split, the first call learns its halo plans)
        with LoadWindow() as window:
            for _ in range(repeats):
                sync()
                start, cpu_start = time.perf_counter(), time.process_time()
                decode()
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - cpu_start)
        output, _, peak, rise = measured_decode()
    return {
        "times": times, "cpu": cpu, "peak_tensor_bytes": peak, "rss_rise_bytes": rise,
        "window": {"system": window.system, "own": window.own, "wall": window.wall},
        "output": output if rank == 0 else None,
    }


def run_case(model: str, config: dict, height: int, width: int, frames: int, world: int, repeats: int,
             wait_quiet: float, single_pass: bool = False) -> dict:
    busy_before = wait_for_quiet(timeout_s=wait_quiet)
    if single_pass:
        repeats = 1
    results = run_ranks(decode_worker, world, timeout_s=7200, model=model, config=config, height=height,
                        width=width, frames=frames, repeats=repeats, single_pass=single_pass)
    per_repeat = [max(r["times"][i] for r in results) for i in range(repeats)]
    cpu_per_repeat = [max(r["cpu"][i] for r in results) for i in range(repeats)]
    return {
        "world": world, "median_s": statistics.median(per_repeat), "times": per_repeat,
        "median_cpu_s": statistics.median(cpu_per_repeat),
        "peak_tensor_bytes": max(r["peak_tensor_bytes"] for r in results),
        "peak_tensor_per_rank": [r["peak_tensor_bytes"] for r in results],
        "rss_rise_bytes": max((r["rss_rise_bytes"] or 0) for r in results),
        "other_cpu_s": foreign_cpu([r["window"] for r in results]), "busy_before": busy_before,
        "output": results[0]["output"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="flux-kl,wan")
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--kl-size", type=int, default=512, help="FLUX KL output side in pixels (multiple of 8)")
    parser.add_argument("--wan-size", default="240x416", help="Wan output HxW in pixels (multiples of 8)")
    parser.add_argument("--wan-frames", type=int, default=5, help="Wan output frames, 1 + 4k")
    parser.add_argument("--dc-size", type=int, default=512, help="DC-AE output side in pixels (multiple of 32)")
    parser.add_argument("--cogvideox-size", default="120x176", help="CogVideoX output HxW in pixels (multiples of 8)")
    parser.add_argument("--cogvideox-frames", type=int, default=9, help="CogVideoX output frames, 1 + 4k")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--wait-quiet", type=float, default=60.0, help="seconds to wait for a quiet machine per case")
    parser.add_argument("--single-pass", action="store_true",
                        help="one decode per case, timed and memory-measured at once, no warm-up (for decodes of "
                             "minutes: 2048², 480p clips; the tracking's per-op cost is negligible at those sizes)")
    parser.add_argument("--quick", action="store_true", help="narrow models, small sizes (checks the script)")
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args(argv)
    models = QUICK if args.quick else MODELS
    wan_height, wan_width = (int(v) for v in args.wan_size.lower().split("x"))
    cog_height, cog_width = (int(v) for v in args.cogvideox_size.lower().split("x"))
    sizes = {"flux-kl": (args.kl_size, args.kl_size, 1), "wan": (wan_height, wan_width, args.wan_frames),
             "dc": (args.dc_size, args.dc_size, 1), "cogvideox": (cog_height, cog_width, args.cogvideox_frames)}
    if args.quick:
        sizes = {"flux-kl": (64, 64, 1), "wan": (48, 64, 5), "dc": (128, 128, 1), "cogvideox": (48, 64, 5)}
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"# bench_vae {datetime.datetime.now().isoformat(timespec='seconds')}\n# {machine_line()}", flush=True)
    report, rows, figures = {}, [], []
    for model in args.models.split(","):
        height, width, frames = sizes[model]
        config = models[model][1]
        cases = []
        for world in worlds:
            case = run_case(model, config, height, width, frames, world, args.repeats, args.wait_quiet,
                            args.single_pass)
            cases.append(case)
            print(f"{model} {height}x{width}x{frames} world {world}: {case['median_s']:.2f} s "
                  f"({case['median_cpu_s']:.2f} CPU-s per rank), "
                  f"peak tensors {case['peak_tensor_bytes'] / MB:.0f} MB, other CPU {case['other_cpu_s']:.1f} s",
                  flush=True)
        base = cases[0]
        scale = float(np.abs(base["output"]).max())  # random weights: the decoded values are not held to [-1, 1]
        for case in cases:
            case["max_abs_diff"] = float(np.abs(case["output"] - base["output"]).max())
            case["max_abs_output"] = scale
        for case in cases:
            diff = case.pop("max_abs_diff")
            rows.append([model, f"{height}x{width}" + (f"x{frames}" if model in VIDEO_MODELS else ""), case["world"],
                         f"{case['median_s']:.2f}", f"{case['median_s'] / base['median_s']:.2f}",
                         f"{case['median_cpu_s']:.2f}", f"{case['median_cpu_s'] / base['median_cpu_s']:.2f}",
                         f"{case['peak_tensor_bytes'] / MB:.0f}",
                         f"{case['peak_tensor_bytes'] / base['peak_tensor_bytes']:.2f}",
                         f"{case['rss_rise_bytes'] / MB:.0f}", f"{diff:.1e} ({diff / scale:.1e})",
                         f"{case['other_cpu_s']:.1f}"])
            case["max_abs_diff"] = diff
            del case["output"]
            if case["world"] == 2 and base["world"] == 1:
                output = f"{height}x{width}" + (f"x{frames}" if model in VIDEO_MODELS else "")
                figures += [
                    figure(f"{model} {output}, 2 ranks / 1: time", round(case["median_s"] / base["median_s"], 3), "x",
                           "<= 0.6", note=f"CPU a rank {case['median_cpu_s'] / base['median_cpu_s']:.2f}x"),
                    figure(f"{model} {output}, 2 ranks / 1: peak tensor memory",
                           round(case["peak_tensor_bytes"] / base["peak_tensor_bytes"], 3), "x", "<= 0.6"),
                    figure(f"{model} {output}, 2 ranks vs 1: max difference relative to the output",
                           float(f"{diff / scale:.2g}"), "rel", "<= 1e-05")]
        report[model] = {"size": [height, width, frames], "cases": cases}
    table = markdown_table(["model", "output", "ranks", "decode s (median)", "time vs 1", "CPU s/rank (median)",
                            "CPU vs 1", "peak tensors MB/rank",
                            "memory vs 1", "peak RSS rise MB/rank", "max abs diff vs 1 (relative to the largest output value)",
                            "other procs CPU s"], rows)
    print(table)
    if figures and not args.quick:
        write_result("bench_vae", f"Parallel VAE decode ({args.models}), 2 ranks against 1", figures)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_line(), "report": report}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
