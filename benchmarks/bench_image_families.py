"""Image transformers at real widths, cut to a few blocks: load + forward under single, tp2 and ulysses2.

Families (random bf16 weights, seeded, saved once as safetensors under --folder):
  SD3Transformer2DModel at SD3.5-large widths (38 heads x 64, joint_attention_dim 4096, pooled 2048,
    caption_projection_dim 2432, qk_norm rms_norm, no dual attention), 2 layers;
  HiDreamImageTransformer2DModel at HiDream-I1 widths (20 heads x 128, caption channels 4096/4096, text_emb_dim 2048,
    4 routed experts / 2 active), 1 double + 1 single block;
  ZImageTransformer2DModel at Z-Image widths (dim 3840, 30 heads, cap_feat_dim 2560), 2 layers + 1 refiner each.
Each mode runs in fresh processes, one thread per rank: paradiff.from_pretrained (fp32 compute from the bf16
checkpoint; tp2 = TensorParallelConfig(2) shard-on-read, ulysses2 = ContextParallelConfig(ulysses_degree=2)).
Reported: load wall (slowest rank), local parameter bytes / model bytes, peak RssAnon growth during the load over the
local parameter bytes (sampled every 5 ms from /proc/self/status), median forward ms, CPU-seconds per forward of the
busiest rank, other processes' CPU-seconds during the forwards, max relative difference to single.

    .venv/bin/python benchmarks/bench_image_families.py [--grid 32] [--text 128] [--steps 2] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paradiff.config import mode_world_size  # noqa: E402
from _common import (  # noqa: E402
    GB, LoadWindow, MemorySampler, cpu_seconds, foreign_cpu, machine_line, markdown_table, quiet_diffusers,
    read_status, run_ranks,
)
from results import figure, write_result  # noqa: E402

FAMILIES = {
    "SD3.5-large": ("SD3Transformer2DModel", dict(
        sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=64,
        num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048,
        pos_embed_max_size=192, qk_norm="rms_norm", dual_attention_layers=())),
    "HiDream-I1": ("HiDreamImageTransformer2DModel", dict(
        patch_size=2, in_channels=16, out_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=20, caption_channels=[4096, 4096], text_emb_dim=2048, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(64, 32, 32), max_resolution=(128, 128), llama_layers=[0, 1])),
    "Z-Image": ("ZImageTransformer2DModel", dict(
        in_channels=16, dim=3840, n_layers=2, n_refiner_layers=1, n_heads=30, n_kv_heads=30, cap_feat_dim=2560,
        axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512])),
}
QUICK = {
    "SD3.5-large": dict(num_attention_heads=4, attention_head_dim=16, joint_attention_dim=32,
                        caption_projection_dim=64, pooled_projection_dim=32),
    "HiDream-I1": dict(num_attention_heads=4, attention_head_dim=32, caption_channels=[32, 32], text_emb_dim=32,
                       axes_dims_rope=(16, 8, 8)),
    "Z-Image": dict(dim=192, n_heads=4, n_kv_heads=4, cap_feat_dim=32, axes_dims=[16, 16, 16]),
}
MODES = ("single", "tp2", "ulysses2")


def build_checkpoint(rank: int, world_size: int, cls_name: str, config: dict, folder: str) -> dict:
    """Random bf16 weights without an fp32 copy (bf16 default dtype), then a seeded normal_ over every parameter.

    Built on the CPU rather than on meta so persistent buffers (SD3's sin-cos position table) get real values.
    """
    import torch
    import diffusers

    quiet_diffusers()
    torch.set_default_dtype(torch.bfloat16)
    model = getattr(diffusers, cls_name)(**config)
    torch.set_default_dtype(torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(folder, safe_serialization=True)
    return dict(params=sum(p.numel() for p in model.parameters()))


def make_inputs(cls_name: str, config, grid: int, text: int):
    import torch

    g = torch.Generator().manual_seed(1)
    side = 2 * grid  # patch size 2 everywhere
    if cls_name == "SD3Transformer2DModel":
        return dict(hidden_states=torch.randn(1, config.in_channels, side, side, generator=g),
                    encoder_hidden_states=torch.randn(1, text, config.joint_attention_dim, generator=g),
                    pooled_projections=torch.randn(1, config.pooled_projection_dim, generator=g),
                    timestep=torch.tensor([500.0]), return_dict=False)
    if cls_name == "HiDreamImageTransformer2DModel":
        return dict(hidden_states=torch.randn(1, config.in_channels, side, side, generator=g),
                    timesteps=torch.tensor([500.0]),
                    encoder_hidden_states_t5=torch.randn(1, text, config.caption_channels[0], generator=g),
                    encoder_hidden_states_llama3=torch.randn(len(config.llama_layers), 1, text,
                                                             config.caption_channels[1], generator=g),
                    pooled_embeds=torch.randn(1, config.text_emb_dim, generator=g), return_dict=False)
    return dict(x=[torch.randn(config.in_channels, 1, side, side, generator=g)], t=torch.tensor([0.5]),
                cap_feats=[torch.randn(text, config.cap_feat_dim, generator=g)], return_dict=False)


def run_mode(rank: int, world_size: int, cls_name: str, folder: str, mode: str, grid: int, text: int,
             steps: int) -> dict:
    import torch
    import torch.distributed as dist
    import diffusers
    from torch.distributed.tensor import DTensor

    import paradiff

    quiet_diffusers()
    cls = getattr(diffusers, cls_name)
    config = None if mode == "single" else paradiff.ParallelConfig.from_mode(mode)
    gc.collect()
    if world_size > 1:
        dist.barrier()
    baseline = read_status()[0]["RssAnon"]
    with MemorySampler() as sampler:
        start = time.perf_counter()
        model = paradiff.from_pretrained(cls, folder, torch_dtype=torch.float32, parallel_config=config,
                                         progress=False).eval()
        load_s = time.perf_counter() - start
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    local_bytes = sum(t.numel() * t.element_size() for t in local)
    inputs = make_inputs(cls_name, model.config, grid, text)
    with torch.no_grad():
        output = model(**inputs)[0]  # warm-up
        times, cpu = [], []
        with LoadWindow() as window:
            for _ in range(steps):
                begin, cpu_begin = time.perf_counter(), cpu_seconds()
                output = model(**inputs)[0]
                times.append(time.perf_counter() - begin)
                cpu.append(cpu_seconds() - cpu_begin)
    if isinstance(output, list):
        output = torch.stack(output)
    return dict(load_s=load_s, local_bytes=local_bytes, load_growth=sampler.peak["RssAnon"] - baseline,
                ms=1000 * statistics.median(times), cpu_s=statistics.median(cpu),
                window=dict(system=window.system, own=window.own, wall=window.wall),
                output=output.float().numpy().copy() if rank == 0 else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", type=int, default=32, help="image tokens per side after patchifying")
    parser.add_argument("--text", type=int, default=128, help="text tokens (per text encoder stream)")
    parser.add_argument("--steps", type=int, default=2, help="timed forwards after one warm-up (median)")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--folder", default="/tmp/paradiff-bench-image-families")
    parser.add_argument("--quick", action="store_true", help="tiny widths, seconds: checks the script runs")
    args = parser.parse_args()
    started = time.time()
    rows = []
    figures = []
    for family in [f.strip() for f in args.families.split(",") if f.strip()]:
        if family not in FAMILIES:
            parser.error(f"unknown family {family!r}; known: {list(FAMILIES)}")
        cls_name, config = FAMILIES[family]
        config = dict(config, **(QUICK[family] if args.quick else {}))
        folder = Path(args.folder) / (family + ("-quick" if args.quick else ""))
        marker = folder / "BENCH_CONFIG.json"
        if not marker.is_file() or json.loads(marker.read_text()) != json.loads(json.dumps(config)):
            info = run_ranks(build_checkpoint, 1, timeout_s=1200, cls_name=cls_name, config=config,
                             folder=str(folder))[0]
            marker.write_text(json.dumps(config))
            print(f"{family}: built {info['params'] / 1e9:.2f}B params in {folder}", flush=True)
        results = {}
        for mode, world in ((mode, mode_world_size(mode)) for mode in MODES):
            results[mode] = run_ranks(run_mode, world, timeout_s=1800, cls_name=cls_name, folder=str(folder),
                                      mode=mode, grid=args.grid, text=args.text, steps=args.steps)
            r = results[mode]
            print(f"  {family} {mode}: load {max(x['load_s'] for x in r):.1f}s, forward "
                  f"{max(x['ms'] for x in r):.0f} ms", flush=True)
        single = results["single"][0]
        reference = single["output"]
        for mode, by_rank in results.items():
            ms = max(r["ms"] for r in by_rank)
            cpu = max(r["cpu_s"] for r in by_rank)
            diff = float(abs(by_rank[0]["output"] - reference).max() / abs(reference).max())
            growth = max(r["load_growth"] / r["local_bytes"] for r in by_rank)
            rows.append([family, mode, f"{max(r['load_s'] for r in by_rank):.1f}",
                         f"{max(r['local_bytes'] for r in by_rank) / single['local_bytes']:.3f}",
                         f"{max(r['local_bytes'] for r in by_rank) / GB:.2f}", f"{growth:.2f}",
                         f"{ms:.0f}", f"{ms / single['ms']:.2f}", f"{cpu:.2f}", f"{cpu / single['cpu_s']:.2f}",
                         f"{foreign_cpu([r['window'] for r in by_rank]):.1f}", f"{diff:.1e}"])
            if mode != "single":
                figures.append(figure(f"{family} {mode} / single", round(ms / single["ms"], 3), "x", "<= 0.6",
                                      note=f"CPU {cpu / single['cpu_s']:.2f}x; max rel diff {diff:.1e}"))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M %Z')}; {machine_line()}")
    print(f"fp32 compute (bf16 checkpoint), batch 1, {args.grid}x{args.grid} = {args.grid ** 2} image tokens + "
          f"{args.text} text tokens per stream, median of {args.steps} forwards after 1 warm-up; "
          f"total {time.time() - started:.0f}s{' (QUICK: tiny widths)' if args.quick else ''}\n")
    print(markdown_table(["family", "mode", "load s (slowest rank)", "local params / model", "local params GB (fp32)",
                          "peak RssAnon growth in load / local params", "ms / forward", "x single",
                          "CPU s / forward (busiest rank)", "CPU x single", "other processes' CPU s",
                          "max rel diff"], rows))
    if not args.quick:
        write_result("bench_image_families", f"Image transformers at real widths, {args.grid ** 2} image + "
                     f"{args.text} text tokens", figures)


if __name__ == "__main__":
    main()
