"""Loading benchmark: a FLUX.2-dev-width Flux2Transformer2DModel checkpoint (bf16, 4 safetensors shards + index).

Methods, each in fresh processes (gloo, torch.set_num_threads(1)), one after another, with a warm page cache:
  paradiff tp=1, paradiff tp=2, diffusers tp=1 (plain from_pretrained, reference),
  diffusers tp=2 sharded load (from_pretrained(parallel_config=...)),
  diffusers tp=2 full load + enable_parallelism.
Per rank: wall time of the load call(s), peak RssAnon (sampled every 5 ms), bytes read (/proc/self/io), and the
bytes of the parameters the rank ends up holding.

    .venv/bin/python benchmarks/bench_tp_load.py [--repeats N] [--methods a,b] [--folder DIR]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    GB,
    LoadWindow,
    MemorySampler,
    foreign_cpu,
    machine_line,
    markdown_table,
    patch_diffusers_for_cpu_tp,
    quiet_diffusers,
    read_io,
    read_status,
    run_ranks,
    wait_for_quiet,
)
from results import figure, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FOLDER = ROOT / ".cache" / "bench" / "flux2-wide"
NUM_SHARDS = 4
# FLUX.2-dev widths; depth cut to 1 double + 2 single blocks (~2.78B parameters, ~5.56 GB in bf16).
CONFIG = dict(
    num_attention_heads=48, attention_head_dim=128, joint_attention_dim=15360, mlp_ratio=3.0, num_layers=1,
    num_single_layers=2, in_channels=128, timestep_guidance_channels=256, axes_dims_rope=(32, 32, 32, 32),
    guidance_embeds=True, patch_size=1,
)
MARKER = "BENCH_COMPLETE.json"
# One colwise, one packed-colwise and one packed-rowwise weight: their per-rank shards are fingerprinted so the
# methods can be checked to have read the same numbers.
FINGERPRINT = (
    "transformer_blocks.0.attn.to_q.weight",
    "single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight",
    "single_transformer_blocks.0.attn.to_out.weight",
)

METHODS = {
    "paradiff_tp1": ("paradiff tp=1", 1),
    "paradiff_tp2": ("paradiff tp=2", 2),
    "diffusers_tp1": ("diffusers tp=1 (plain from_pretrained)", 1),
    "diffusers_tp2_sharded": ("diffusers tp=2 from_pretrained(parallel_config)", 2),
    "diffusers_tp2_full_enable": ("diffusers tp=2 full load + enable_parallelism", 2),
}


# ----------------------------------------------------------------------------------------------------------------
# checkpoint


def build_checkpoint(rank: int, world_size: int, folder: str) -> dict:
    """Random bf16 weights built without an fp32 copy: construct on meta, allocate in bf16, fill with normal_."""
    import torch
    from diffusers import Flux2Transformer2DModel
    from huggingface_hub import split_torch_state_dict_into_shards

    quiet_diffusers()
    start = time.perf_counter()
    with torch.device("meta"):
        model = Flux2Transformer2DModel(**CONFIG)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    state = model.state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())
    # the smallest max_shard_size (in MB steps) that gives exactly NUM_SHARDS files
    shard_size = None
    for mb in range(total // NUM_SHARDS // 10**6, total // 10**6 + 1, 10):
        split = split_torch_state_dict_into_shards(state, max_shard_size=mb * 10**6)
        if len(split.filename_to_tensors) == NUM_SHARDS:
            shard_size = mb * 10**6
            break
        if len(split.filename_to_tensors) < NUM_SHARDS:
            break
    if shard_size is None:
        raise RuntimeError(f"no max_shard_size gives exactly {NUM_SHARDS} shards")
    target = Path(folder)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, max_shard_size=shard_size, safe_serialization=True)
    files = sorted(p.name for p in staging.glob("*.safetensors"))
    if len(files) != NUM_SHARDS or not (staging / "diffusion_pytorch_model.safetensors.index.json").is_file():
        raise RuntimeError(f"expected {NUM_SHARDS} shards + index, got {files}")
    info = dict(config=CONFIG, parameters=sum(p.numel() for p in model.parameters()), bytes=total,
                max_shard_size=shard_size, files=files, build_s=round(time.perf_counter() - start, 1))
    (staging / MARKER).write_text(json.dumps(info, indent=2))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return info


def ensure_checkpoint(folder: Path) -> dict:
    marker = folder / MARKER
    if marker.is_file():
        info = json.loads(marker.read_text())
        if info.get("config") == json.loads(json.dumps(CONFIG)):
            return info
    print(f"building the synthetic checkpoint in {folder} (once) ...", flush=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    return run_ranks(build_checkpoint, 1, timeout_s=1200, folder=str(folder))[0]


def warm_page_cache(folder: Path) -> float:
    """Read every file once (like `cat * > /dev/null`), so each method reads from the page cache."""
    start = time.perf_counter()
    buffer = bytearray(64 << 20)
    for path in sorted(folder.iterdir()):
        if path.is_file():
            with open(path, "rb", buffering=0) as handle:
                while handle.readinto(buffer):
                    pass
    return time.perf_counter() - start


# ----------------------------------------------------------------------------------------------------------------
# one load, inside a rank


def _local(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def touch_pages(tensors) -> None:
    """Read one element per 4 KiB page of every tensor: an mmap-backed (lazily loaded) tensor becomes resident.

    Part of every method's timed region, so "materialised" means the same for all; for tensors already in anonymous
    memory it costs milliseconds.
    """
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
        step = max(1, 4096 // tensor.element_size())
        flat[::step].float().sum()


def load_worker(rank: int, world_size: int, method: str, folder: str) -> dict:
    import torch
    import torch.distributed as dist
    import diffusers
    from diffusers import Flux2Transformer2DModel

    import paradiff

    quiet_diffusers()
    patches = patch_diffusers_for_cpu_tp().applied if method.startswith("diffusers") else []
    dtype = torch.bfloat16
    gc.collect()
    if world_size > 1:
        dist.barrier()
    baseline = read_status()[0]
    io_before = read_io()
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    phases: dict[str, float] = {}
    with MemorySampler() as sampler, LoadWindow() as window:
        start = time.perf_counter()
        if method == "paradiff_tp1":
            model = paradiff.from_pretrained(Flux2Transformer2DModel, folder, torch_dtype=dtype, progress=False)
        elif method == "paradiff_tp2":
            model = paradiff.from_pretrained(
                Flux2Transformer2DModel, folder, torch_dtype=dtype, progress=False,
                parallel_config=paradiff.TensorParallelConfig(2),
            )
        elif method == "diffusers_tp1":
            model = Flux2Transformer2DModel.from_pretrained(folder, torch_dtype=dtype)
        elif method == "diffusers_tp2_sharded":
            model = Flux2Transformer2DModel.from_pretrained(
                folder, torch_dtype=dtype, parallel_config=diffusers.TensorParallelConfig(tp_degree=2)
            )
        elif method == "diffusers_tp2_full_enable":
            model = Flux2Transformer2DModel.from_pretrained(folder, torch_dtype=dtype)
            phases["full load"] = time.perf_counter() - start
            model.enable_parallelism(config=diffusers.TensorParallelConfig(tp_degree=2))
            phases["enable_parallelism"] = time.perf_counter() - start - phases["full load"]
        else:
            raise ValueError(method)
        loaded = time.perf_counter()
        local_tensors = []
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            local = _local(tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor)
            if local.device.type == "meta" or tensor.device.type == "meta":
                raise RuntimeError(f"{method}: {name} is still on the meta device")
            local_tensors.append(local)
        touch_pages(local_tensors)
        phases["page touch"] = time.perf_counter() - loaded
        wall = time.perf_counter() - start
    io_after = read_io()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before

    local_bytes = sum(t.numel() * t.element_size() for t in local_tensors)
    state = dict(model.named_parameters())
    fingerprints = {}
    for name in FINGERPRINT:
        local = _local(state[name].data)
        fingerprints[name] = [list(local.shape), float(local.double().sum()), float(local.double().abs().sum())]
    after = read_status()[0]
    own_io = sampler.own_rchar + io_before["_self_bytes"]
    return dict(
        method=method, rank=rank, wall_s=wall, phases=phases, patches=patches,
        cpu_s=window.own, window=dict(system=window.system, own=window.own, wall=window.wall),
        baseline_anon=baseline["RssAnon"], peak_anon=sampler.peak["RssAnon"], after_anon=after["RssAnon"],
        peak_file=sampler.peak["RssFile"], samples=sampler.samples,
        rchar=io_after["rchar"] - io_before["rchar"] - own_io, read_bytes=io_after["read_bytes"] - io_before["read_bytes"],
        syscr=io_after["syscr"] - io_before["syscr"] - sampler.samples - 1,
        minflt=faults, local_bytes=local_bytes, fingerprints=fingerprints,
    )


# ----------------------------------------------------------------------------------------------------------------
# main


def _median_run(repeats: list[list[dict]]) -> list[dict]:
    walls = [max(r["wall_s"] for r in ranks) for ranks in repeats]
    return repeats[sorted(range(len(walls)), key=walls.__getitem__)[len(walls) // 2]]


def summarize(runs: dict[str, list[list[dict]]]) -> tuple[str, dict]:
    """One row per method and rank: medians over repeats of wall and CPU; memory and I/O from the median repeat."""
    rows = []
    best: dict[str, dict] = {}
    for method, repeats in runs.items():
        label, _ = METHODS[method]
        walls = [max(r["wall_s"] for r in ranks) for ranks in repeats]
        cpus = [max(r["cpu_s"] for r in ranks) for ranks in repeats]
        foreign = [foreign_cpu([r["window"] for r in ranks]) for ranks in repeats]
        chosen = _median_run(repeats)
        best[method] = dict(wall=statistics.median(walls), walls=walls, cpu=statistics.median(cpus), cpus=cpus,
                            foreign=foreign, ranks=chosen)
        for r in chosen:
            rank_walls = [ranks[r["rank"]]["wall_s"] for ranks in repeats]
            rank_cpus = [ranks[r["rank"]]["cpu_s"] for ranks in repeats]
            phases = {k: statistics.median(ranks[r["rank"]]["phases"][k] for ranks in repeats) for k in r["phases"]}
            extra = "; ".join(f"{k} {v:.2f}" for k, v in phases.items())
            rows.append([
                label, r["rank"], f"{statistics.median(rank_walls):.2f} ({min(rank_walls):.2f}–{max(rank_walls):.2f})",
                f"{statistics.median(rank_cpus):.2f}", extra,
                f"{r['peak_anon'] / GB:.2f}", f"{(r['peak_anon'] - r['baseline_anon']) / GB:.2f}",
                f"{r['local_bytes'] / GB:.2f}",
                f"{(r['peak_anon'] - r['baseline_anon'] - r['local_bytes']) / GB:+.2f}",
                f"{r['rchar'] / GB:.2f}", f"{r['read_bytes'] / GB:.2f}", f"{r['syscr']:,}",
                f"{r['peak_file'] / GB:.2f}", f"{r['minflt']:,}",
                " ".join(f"{f:.1f}" for f in foreign),
            ])
    header = ["method", "rank", "wall s median (min–max)", "CPU s (user+sys)", "phases s (median)",
              "peak RssAnon GB", "peak − pre-load RssAnon GB", "local params GB",
              "overhead GB (peak − pre-load − local)", "rchar GB", "read_bytes GB", "read syscalls",
              "peak RssFile GB", "minor faults", "other processes' CPU-s per repeat"]
    return markdown_table(header, rows), best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default=str(DEFAULT_FOLDER))
    parser.add_argument("--repeats", type=int, default=3, help="fresh-process repeats per method (median reported)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--no-wait", action="store_true", help="do not wait for other processes to go quiet")
    parser.add_argument("--json", default=None, help="also write raw per-rank results here")
    args = parser.parse_args()
    folder = Path(args.folder)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for method in methods:
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; known: {list(METHODS)}")
    if any(m.startswith("diffusers") for m in methods) and importlib.util.find_spec("accelerate") is None:
        print("note: diffusers' low_cpu_mem_usage loading (required by its tensor-parallel from_pretrained) needs "
              "`accelerate`, which is not installed: skipping the diffusers methods (pip install accelerate).")
        methods = [m for m in methods if not m.startswith("diffusers")]

    started = time.time()
    info = ensure_checkpoint(folder)
    warm_s = warm_page_cache(folder)
    print(f"checkpoint: {folder} — {info['parameters'] / 1e9:.2f}B params, {info['bytes'] / GB:.2f} GB bf16, "
          f"{len(info['files'])} shards (max_shard_size={info['max_shard_size'] / GB:.2f} GB); "
          f"page cache warmed in {warm_s:.1f}s", flush=True)

    runs: dict[str, list[list[dict]]] = {method: [] for method in methods}
    busy_before: list[float] = []
    for repeat in range(args.repeats):  # round-robin, so slow phases of a shared machine hit every method alike
        for method in methods:
            label, world = METHODS[method]
            if not args.no_wait:
                busy_before.append(wait_for_quiet(timeout_s=30))
            results = run_ranks(load_worker, world, timeout_s=900, method=method, folder=str(folder))
            runs[method].append(results)
            print(f"  #{repeat + 1} {label}: " + ", ".join(
                f"rank {r['rank']} {r['wall_s']:.2f}s (cpu {r['cpu_s']:.2f}s) peak RssAnon {r['peak_anon'] / GB:.2f} GB"
                for r in results
            ) + f"; other processes {foreign_cpu([r['window'] for r in results]):.1f} CPU-s", flush=True)

    table, best = summarize(runs)
    print()
    print(f"machine: {machine_line()}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; repeats per method: {args.repeats} (fresh processes, "
          f"round-robin); total {time.time() - started:.0f}s")
    if busy_before:
        print(f"busy cores from other processes just before each run (each run waits up to 30 s for < 0.3): "
              f"max {max(busy_before):.2f}, median {statistics.median(busy_before):.2f}")
    print()
    print(table)
    print()

    patches = sorted({p for ranks in sum(runs.values(), []) for r in ranks for p in r["patches"]})
    if patches:
        print("in-process patches in the diffusers workers: " + "; ".join(patches))
    tp2 = [m for m in ("paradiff_tp2", "diffusers_tp2_sharded", "diffusers_tp2_full_enable") if m in best]
    if len(tp2) > 1:
        reference = [r["fingerprints"] for r in best[tp2[0]]["ranks"]]
        same = all([r["fingerprints"] for r in best[m]["ranks"]] == reference for m in tp2[1:])
        print(f"shard fingerprints of {len(FINGERPRINT)} split weights identical across {tp2}: {same}")
    figures = []
    if "paradiff_tp2" in best:
        grown = max(r["peak_anon"] - r["baseline_anon"] - r["local_bytes"] for r in best["paradiff_tp2"]["ranks"])
        figures.append(figure("paradiff tp=2: peak RssAnon growth above local params", round(grown / GB, 2), "GB",
                              "<= 0.3", note="worst rank"))
        for r in best["paradiff_tp2"]["ranks"]:
            limit = r["local_bytes"] + 0.3 * GB
            grown = r["peak_anon"] - r["baseline_anon"]
            print(f"target peak RssAnon <= local params + 0.3 GB, paradiff tp=2 rank {r['rank']}: "
                  f"growth over pre-load {grown / GB:.2f} GB vs {limit / GB:.2f} GB -> "
                  f"{'MET' if grown <= limit else 'MISSED'}; absolute {r['peak_anon'] / GB:.2f} GB -> "
                  f"{'MET' if r['peak_anon'] <= limit else 'MISSED'} (pre-load process RssAnon "
                  f"{r['baseline_anon'] / GB:.2f} GB: python + torch + diffusers + gloo)")
        ours = best["paradiff_tp2"]
        for other in ("diffusers_tp2_sharded", "diffusers_tp2_full_enable"):
            if other in best:
                theirs = best[other]
                ratio, cpu_ratio = ours["wall"] / theirs["wall"], ours["cpu"] / theirs["cpu"]
                print(f"target paradiff tp=2 wall <= 1/3 x {METHODS[other][0]}: median slowest-rank wall "
                      f"{ours['wall']:.2f}s / {theirs['wall']:.2f}s = {ratio:.2f} -> "
                      f"{'MET' if ratio <= 1 / 3 else 'MISSED'}; slowest-rank CPU {ours['cpu']:.2f}s / "
                      f"{theirs['cpu']:.2f}s = {cpu_ratio:.2f}")
                figures.append(figure(f"paradiff tp=2 load / {METHODS[other][0]} (wall)", round(ratio, 3), "x",
                                      "<= 0.333", note=f"{ours['wall']:.2f} s vs {theirs['wall']:.2f} s; CPU "
                                      f"{cpu_ratio:.2f}x"))
    if figures:
        write_result("bench_tp_load", f"TP loading: {info['parameters'] / 1e9:.2f} B params, bf16, paradiff vs "
                     "diffusers", figures)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(info=info, runs=runs), indent=1))


if __name__ == "__main__":
    main()
