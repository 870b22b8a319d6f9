"""The cost model against this machine (issue 42, items 2 and 4): calibrate, then predict and measure step time and
per-rank memory of single, tp2, ulysses2, ring2, cfg2, tp2 x ulysses2 and ulysses2 + fsdp2 (FSDP2 over the Ulysses
ranks, read from a checkpoint of the same weights, as users load), for two model shapes and two token counts, and the
efficiency table (a step's FLOPs over step time x ranks x the GEMM rate measured in the same run).

    .venv/bin/python benchmarks/bench_cost_model.py            # the 28 rows, 3 passes (about 140 s a pass idle)
    .venv/bin/python benchmarks/bench_cost_model.py --passes 1 --rounds 2 --meshes single,ring2   # a quick look
    .venv/bin/python benchmarks/bench_cost_model.py --only wan:512 --meshes single,ulysses2,ring2 --out /tmp/x.json

Models (random weights, fp32, batch 1, gloo on 127.0.0.1): a FLUX.2-architecture Flux2Transformer2DModel (joint +
single blocks) and a Wan-architecture WanTransformer3DModel (self + cross attention), 4 heads x 64, 2 + 2 blocks /
4 blocks (--large: 8 heads x 64 and 4x the tokens, minutes per row). A step is the two calls of a guided pipeline
(cond and uncond): two forwards per rank, except cfg2 (one forward per rank, each its branch, and the exchange).

Measured per mesh, in fresh rank processes, each rank pinned to one core (rank mod cores) with one torch thread.
Memory first: per rank the parameter bytes it holds plus the peak rise of anonymous memory during a step (2 steps,
glibc's mmap threshold at 128 KiB so freed activations go back to the OS and the peak is visible). Then the time,
with glibc's thresholds raised to 32 MiB (at 128 KiB every activation costs fresh zeroed pages: the forwards ran
1.7-1.8x slower, which the step-time rows of runs before 2026-12-06 16:00 UTC measured): --rounds interleaved
rounds, each calibration's own micro-benchmarks on every rank at once (GEMM, attention, the elementwise mix, the
sequence ranks' copies, the per-op probe, the reference block of the block factor; at its sizes) right before one timed step, so that probe and step see the same load; the step time is
the median over rounds of the slowest rank's step, the rates the median over rounds of the slowest rank's, and
`step_cpu_s` the slowest rank's CPU seconds in the step (its compute without what other processes took of its core
nor its waits on the other ranks: a check of the compute terms under load). Predicted: by
`plan_tools/planner.predict` with the links of the profile `plan_tools/calibrate.calibrate` measured at the start of
the run and again after the rows (2 ranks; the mean of the two) and the rates probed in that row's rounds (tp2 x ulysses2's 4 ranks share the 2 cores, which the
profile's concurrent_ranks accounts for). --passes runs every row that many times, the order reversed on every other
pass, and each row's figures are medians over all its passes' rounds: two idle single-pass runs had moved some rows'
steps by up to 30% (a slow minute of the machine lands on a few rows of one pass).
Writes every row to benchmarks/results/raw/cost_model.json, the headline figures to
benchmarks/results/bench_cost_model.json, and prints the tables.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import system_busy_seconds, wait_for_quiet  # noqa: E402
from results import figure, write_result  # noqa: E402

from paradiff.distributed.spawn import run_ranks  # noqa: E402
from paradiff.plan_tools.calibrate import calibrate  # noqa: E402
from paradiff.plan_tools.cost import Mesh, forward_cost, model_shape  # noqa: E402
from paradiff.plan_tools.hardware import Link  # noqa: E402
from paradiff.plan_tools.planner import predict  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MESHES = ("single", "tp2", "ulysses2", "ring2", "cfg2", "ulysses2xtp2", "ulysses2+fsdp2")
EFFICIENCY_MESHES = ("single", "tp2", "ulysses2", "ring2")


def configs(quick: bool) -> dict[str, tuple[str, dict]]:
    """quick: the benchmark's default shapes; not quick: --large."""
    heads, head_dim = (4, 64) if quick else (8, 64)
    d = heads * head_dim
    return {
        "flux2": ("Flux2Transformer2DModel", dict(
            patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=head_dim,
            num_attention_heads=heads, joint_attention_dim=d, timestep_guidance_channels=64,
            axes_dims_rope=(head_dim // 4,) * 4, guidance_embeds=True)),
        "wan": ("WanTransformer3DModel", dict(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=16,
            out_channels=16, text_dim=d, freq_dim=64, ffn_dim=3 * d, num_layers=4, rope_max_seq_len=256)),
    }


def grids(quick: bool) -> dict[str, tuple[int, int, int, int]]:
    """name -> (frames, height, width, text tokens), in tokens."""
    return {"small": (1, 16, 32, 64), "large": (1, 32, 32, 64)} if quick else \
        {"small": (1, 32, 32, 128), "large": (1, 64, 64, 128)}


def _set_malloc_thresholds(threshold: int) -> None:
    """glibc's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD, then free what the heap holds.

    128 KiB for the memory steps: every activation gets its own mapping, so freed ones go back to the OS and a step's
    peak shows in RssAnon. Not for the timed steps: there each activation then costs fresh, zeroed pages (page
    faults), which made a CPU forward of these shapes 1.7-1.8x slower (CPU time, 2026-12-06) than under glibc's own
    thresholds, which rise as large blocks are freed and keep a long-running process's activations in its heap; the
    timed steps raise both to 32 MiB, that steady state without the first steps' page faults.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, threshold)  # M_TRIM_THRESHOLD
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _pin(rank: int) -> None:
    """One core per rank (rank mod the cores this process may use): ranks sharing a core take turns on it instead
    of migrating between cores under the scheduler."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def step_worker(rank: int, world_size: int, family: str, class_name: str, config: dict, grid: tuple, mesh: str,
                rounds: int, probe: dict) -> dict:
    import torch
    import torch.distributed as dist

    import paradiff
    from paradiff.distributed import comm
    from paradiff.fsdp.apply import held_weight_bytes
    from paradiff.plan_tools.calibrate import measure_local
    from paradiff.runtime.memory import PeakSampler
    from paradiff.testing.models import Lengths, make_inputs, model_class

    _pin(rank)
    torch.set_num_threads(1)
    _set_malloc_thresholds(128 * 1024)
    torch.manual_seed(0)
    model = model_class(family)(**config).eval()
    frames, height, width, text = grid
    inputs = make_inputs(family, model.config, lengths=Lengths(height=height, width=width, text=text, frames=frames))
    degrees = Mesh.parse(mesh)
    if degrees.cfg > 1:
        from paradiff.runtime.cfg import install_cfg_parallel

        install_cfg_parallel(model, dist.new_group(list(range(world_size))))
    elif degrees.fsdp > 1:  # FSDP2 shards as it reads: through a checkpoint of the same weights, as users load
        import tempfile

        with tempfile.TemporaryDirectory(prefix=f"paradiff-cost-{rank}-") as folder:
            model.save_pretrained(folder, safe_serialization=True)
            model = paradiff.from_pretrained(type(model), folder, parallel_config=paradiff.ParallelConfig.from_degrees(
                tp=degrees.tp, ulysses=degrees.ulysses, ring=degrees.ring, fsdp=degrees.fsdp)).eval()
    elif world_size > 1:
        paradiff.enable_parallelism(model, paradiff.ParallelConfig.from_degrees(
            tp=degrees.tp, ulysses=degrees.ulysses, ring=degrees.ring))
    calls = 2  # cond and uncond; under cfg2 each rank computes one of them
    held = held_weight_bytes(model)  # FSDP2's parameters are DTensors: this rank's rows of them
    uncond = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"] * 0.5)

    def step():
        with torch.no_grad():
            for call in range(calls):
                model(**(inputs if call == 0 else uncond), return_dict=False)

    def barrier():
        if world_size > 1:
            comm.barrier()

    barrier()
    step()
    peaks = []
    for _ in range(MEMORY_STEPS):  # the memory steps, at the 128 KiB threshold
        barrier()
        sampler = PeakSampler(interval_s=0.002)
        sampler.reset()
        before = sampler.peak.get("RssAnon", 0)
        with sampler:
            step()
        peaks.append(max(sampler.peak.values()) - before)
    _set_malloc_thresholds(32 * 2 ** 20)
    step()
    times, cpu_times, gemm, attention, elementwise, op_overhead, copy, factor = [], [], [], [], [], [], [], []
    for _ in range(rounds):
        barrier()  # every rank probes at once, as the ranks of the step will compute
        rates = measure_local("cpu", ("float32",), probe["gemm_size"], probe["attention_tokens"], probe["repeats"],
                              copy_numel=2 ** 16)
        gemm.append(rates["gemm"]["float32"])
        attention.append(rates["attention"]["float32"])
        elementwise.append(rates["elementwise_bandwidth"])
        op_overhead.append(rates["op_overhead_s"])
        copy.append(rates["copy_bandwidth"])
        factor.append(rates["block_factor"])
        barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.thread_time() - start_cpu)
    return {"rank": rank, "times": times, "cpu_times": cpu_times, "gemm": gemm, "attention": attention,
            "elementwise": elementwise, "op_overhead": op_overhead, "copy": copy, "block_factor": factor,
            "weights": held,
            "activation_peak": max(peaks)}


PROBE = dict(gemm_size=512, attention_tokens=1024, repeats=3)
MEMORY_STEPS = 2


def measure(family, class_name, config, grid, mesh: str, rounds: int) -> dict:
    world = Mesh.parse(mesh).world
    busy = system_busy_seconds()
    started = time.monotonic()
    ranks = run_ranks(step_worker, world, kwargs=dict(family=family, class_name=class_name, config=config, grid=grid,
                                                      mesh=mesh, rounds=rounds, probe=PROBE),
                      gloo_timeout_s=300.0 if world > 1 else None, timeout_s=1800)
    wall = time.monotonic() - started
    steps = [max(rank["times"][i] for rank in ranks) for i in range(rounds)]
    # the slowest rank's CPU seconds in the step's main thread: its compute without the time the scheduler gave
    # other processes (what a loaded machine adds to the wall time) nor the time it waited on the other ranks
    cpu = [max(rank["cpu_times"][i] for rank in ranks) for i in range(rounds)]
    gemm = [min(rank["gemm"][i] for rank in ranks) for i in range(rounds)]
    attention = [min(rank["attention"][i] for rank in ranks) for i in range(rounds)]
    elementwise = [min(rank["elementwise"][i] for rank in ranks) for i in range(rounds)]
    op_overhead = [max(rank["op_overhead"][i] for rank in ranks) for i in range(rounds)]
    copy = [min(rank["copy"][i] for rank in ranks) for i in range(rounds)]
    factor = [statistics.median(rank["block_factor"][i] for rank in ranks) for i in range(rounds)]
    return {"step_s": statistics.median(steps), "steps": steps, "step_cpu_s": statistics.median(cpu),
            "gemm_flops": statistics.median(gemm), "attention_flops": statistics.median(attention),
            "elementwise_bandwidth": statistics.median(elementwise), "op_overhead_s": statistics.median(op_overhead),
            "copy_bandwidth": statistics.median(copy), "block_factor": statistics.median(factor),
            "memory": max(rank["weights"] + rank["activation_peak"] for rank in ranks),
            "weights": max(rank["weights"] for rank in ranks),
            "activations": max(rank["activation_peak"] for rank in ranks),
            "machine_busy_cores": (system_busy_seconds() - busy) / wall, "wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--large", action="store_true", help="8 heads and 4x the tokens (minutes per row)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved probe + step rounds per mesh")
    parser.add_argument("--passes", type=int, default=3,
                        help="passes over every row (the row order reversed on every other pass); each row's figures "
                             "are medians over the passes' rounds, so a slow minute of the machine moves one pass")
    parser.add_argument("--meshes", default=",".join(MESHES))
    parser.add_argument("--only", default="",
                        help="only these models and sizes, comma-separated MODEL:TOKENS (flux2 or wan; 512 / 1024 "
                             "latent tokens, or small / large), e.g. wan:512; the headline JSON is then not written")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "raw" / "cost_model.json"))
    parser.add_argument("--no-wait", action="store_true", help="do not wait for the machine to go quiet")
    parser.add_argument("--note", default="", help="added to every figure's note (e.g. what else ran beside it)")
    args = parser.parse_args()
    quick = not args.large
    if not args.no_wait:
        wait_for_quiet(timeout_s=120.0)
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    profile = calibrate(2, dtypes=("float32",), repeats=5, **{k: PROBE[k] for k in ("gemm_size", "attention_tokens")})
    links = _links_line(profile)
    print(f"profile: {profile.source}; GEMM {profile.gemm_flops['float32'] / 1e9:.1f} GFLOP/s per rank, attention "
          f"{profile.attention_flops['float32'] / 1e9:.1f} GFLOP/s, concurrent ranks {profile.concurrent_ranks}; "
          f"{links}", flush=True)
    rows = []
    only = parse_only(args.only, quick)
    order = [(family, class_name, config, size, grid, mesh) for family, (class_name, config) in configs(quick).items()
             for size, grid in grids(quick).items() for mesh in args.meshes.split(",")
             if not only or (family, size) in only]
    passes: dict[tuple, list[dict]] = {}
    for number in range(args.passes):
        for family, class_name, config, size, grid, mesh in (order if number % 2 == 0 else order[::-1]):
            try:
                measured = measure(family, class_name, config, grid, mesh, args.rounds)
            except Exception as exc:  # noqa: BLE001 - recorded, the others still run
                measured = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            passes.setdefault((family, size, mesh), []).append(measured)
            print(f"pass {number + 1}/{args.passes} {family} {size} {mesh}: "
                  + (f"step {measured['step_s']:.3f} s" if "step_s" in measured else measured["error"]), flush=True)
    # the links once more after the rows, and the mean of both calibrations: one calibration's all-to-all moved
    # 0.99-1.46 ms between runs minutes apart, a few seconds of the machine deciding every row's communication
    profile = _mean_links(profile, calibrate(2, dtypes=("float32",), repeats=5,
                                             **{k: PROBE[k] for k in ("gemm_size", "attention_tokens")}))
    print(f"links, mean of the calibrations before and after the rows: {_links_line(profile)}", flush=True)
    for family, class_name, config, size, grid, mesh in order:
        frames, height, width, text = grid
        shape_t = model_shape(dict(config, _class_name=class_name), text_tokens=text)
        latent = frames * height * width  # make_inputs' grid is in tokens (after the patch)
        measured = combine_passes(passes[(family, size, mesh)])
        # the rates probed in this row's rounds, beside its steps; the links from the run's calibration.
        # Every rank probes at once: with more ranks than cores (tp2 x ulysses2: 4 on 2) each probe had a
        # share of a core, while a profile's rates are one rank's on a core of its own (predict divides them
        # by that share itself): the probes are brought back to a core's rate, not counted shared twice
        share = max(1.0, Mesh.parse(mesh).world / profile.concurrent_ranks)
        rates = replace(profile, gemm_flops={"float32": share * measured.get("gemm_flops",
                                                                             profile.gemm_flops["float32"])},
                        attention_flops={"float32": share * measured.get("attention_flops",
                                                                         profile.attention_flops["float32"])},
                        elementwise_bandwidth=share * measured.get("elementwise_bandwidth",
                                                                   profile.elementwise_bandwidth),
                        copy_bandwidth=share * measured.get("copy_bandwidth", profile.copy_bandwidth),
                        op_overhead_s=measured.get("op_overhead_s", profile.op_overhead_s) / share,
                        block_factor=measured.get("block_factor", profile.block_factor))
        predicted = predict(shape_t, latent, Mesh.parse(mesh), rates, steps=1, dtype="float32", branches=2)
        row = {"model": family, "size": size, "latent_tokens": latent, "text_tokens": text, "mesh": mesh,
               "predicted_step_s": predicted.step_s, "predicted_compute_s": predicted.compute_s,
               "predicted_comm_s": predicted.comm_s, "predicted_memory": predicted.memory.total,
               "predicted_weights": predicted.memory.weights,
               "predicted_activations": predicted.memory.activations,
               "step_flops": 2 * forward_cost(shape_t, latent, 4).flops, **measured}
        rows.append(row)
        print(_line(row), flush=True)
    single = {(r["model"], r["size"]): r for r in rows if r["mesh"] == "single" and "step_s" in r}
    for row in rows:
        if "step_s" in row:
            ranks = min(Mesh.parse(row["mesh"]).world, profile.concurrent_ranks)  # the cores the ranks share
            row["efficiency"] = row["step_flops"] / (row["step_s"] * ranks * row["gemm_flops"])
            base = single.get((row["model"], row["size"]))
            row["efficiency_vs_single"] = row["efficiency"] / base["efficiency"] if base else None
    wall = time.monotonic() - started
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "large": args.large, "rounds": args.rounds, "passes": args.passes, "cpus": len(os.sched_getaffinity(0)), "wall_s": wall,
              "profile": json.loads(profile.to_json()), "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(tables(rows))
    print(f"written: {out} ({wall:.0f} s)")
    measured = [r for r in rows if "step_s" in r]
    if measured and not args.large and args.meshes == ",".join(MESHES) and not only:
        # the busy cores count the row's own ranks (up to one core each): what is beyond them ran beside the steps
        others = max(r["machine_busy_cores"] - min(Mesh.parse(r["mesh"]).world, profile.concurrent_ranks)
                     for r in measured)
        loads = (f"load average {load_before:.0f} at the start, {os.getloadavg()[0]:.0f} at the end on "
                 f"{os.cpu_count()} cores")
        load = (f"measured under load: up to {others:.1f} busy cores beside the ranks', {loads}; on a quiet "
                "machine: python benchmarks/bench_cost_model.py" if others > 0.3
                else f"quiet machine (at most {max(others, 0.0):.1f} busy cores beside the ranks'), {loads}")
        load += f"; {args.note}" if args.note else ""
        memory = sum(abs(r["predicted_memory"] / r["memory"] - 1) <= 0.1 for r in measured)
        step = sum(abs(r["predicted_step_s"] / r["step_s"] - 1) <= 0.2 for r in measured)
        ratios = [r["predicted_memory"] / r["memory"] for r in measured]
        figures = [figure("memory rows predicted within 10%", memory, f"of {len(measured)}", f">= {len(measured)}",
                          note=f"predicted / measured {min(ratios):.2f}-{max(ratios):.2f}; rows: "
                               "benchmarks/results/raw/cost_model.json"),
                   figure("step-time rows predicted within 20%", step, f"of {len(measured)}", f">= {len(measured)}",
                          note=f"{load}; medians of {args.passes} passes x {args.rounds} rounds per row; one run "
                               f"{wall:.0f} s")]
        for mesh in EFFICIENCY_MESHES:
            values = [r["efficiency"] for r in measured if r["mesh"] == mesh]
            if values:
                figures.append(figure(f"efficiency {mesh}, median of {len(values)} shapes",
                                      round(statistics.median(values), 3), "of the GEMM rate",
                                      note="step FLOPs / (step s x ranks x the GEMM rate probed beside the steps); "
                                           + load))
        pairs = [(ring["efficiency"] / ulysses["efficiency"]) for ring in measured for ulysses in measured
                 if ring["mesh"] == "ring2" and ulysses["mesh"] == "ulysses2"
                 and (ring["model"], ring["size"]) == (ulysses["model"], ulysses["size"])]
        if pairs:
            figures.append(figure("ring2 efficiency / ulysses2 efficiency, lowest of the shapes", round(min(pairs), 3),
                                  "x", ">= 0.95", note=f"per shape {', '.join(f'{v:.2f}' for v in pairs)}; {load}"))
        write_result("bench_cost_model", "Cost model: predicted vs measured step time and memory, FLUX.2- and "
                     f"Wan-shaped, {len(MESHES)} meshes; efficiency of single, tp2, ulysses2, ring2", figures,
                     notes="rows: benchmarks/results/raw/cost_model.json",
                     timed=False)  # its notes say the load themselves: the load average counts its own ranks
    return 0


def _links_line(profile) -> str:
    return ", ".join(f"{op} {link.latency_s * 1e3:.2f} ms + {link.bandwidth / 1e9:.2f} GB/s"
                     for op, link in profile.link_by_world.get("2", {}).items()) \
        + f"; FSDP {profile.fsdp_unit_s * 1e3:.2f} ms a unit + {1e-9 / max(profile.fsdp_byte_s, 1e-30):.2f} GB/s"


def _mean_links(first, second):
    """`first` with every link the mean of its two calibrations' (latency and seconds per byte), and FSDP's
    costs per unit and per byte the mean of both."""
    def mean(a: Link, b: Link) -> Link:
        return Link((a.latency_s + b.latency_s) / 2, 2 / (1 / a.bandwidth + 1 / b.bandwidth))
    by_world = {world: {op: mean(link, second.link_by_world[world][op]) for op, link in ops.items()}
                for world, ops in first.link_by_world.items()}
    return replace(first, link_by_world=by_world, links=dict(by_world.get("2", first.links)),
                   fsdp_unit_s=(first.fsdp_unit_s + second.fsdp_unit_s) / 2,
                   fsdp_byte_s=(first.fsdp_byte_s + second.fsdp_byte_s) / 2,
                   source=f"{first.source}; links: mean with a second calibration after the rows")


def parse_only(text: str, quick: bool) -> set[tuple[str, str]]:
    """`--only`'s MODEL:TOKENS pairs as (model, size) keys of `configs` and `grids`; the size by name or by its
    latent token count."""
    sizes = {name: name for name in grids(quick)}
    sizes.update({str(frames * height * width): name for name, (frames, height, width, _) in grids(quick).items()})
    pairs = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        model, _, size = part.partition(":")
        if model not in configs(quick) or size not in sizes:
            raise SystemExit(f"--only {part!r}: write MODEL:TOKENS with MODEL one of {', '.join(configs(quick))} and "
                             f"TOKENS one of {', '.join(sizes)}.")
        pairs.add((model, sizes[size]))
    return pairs


def combine_passes(results: list[dict]) -> dict:
    """One row's figures over its passes: the median of every pass's step rounds and probed rates, the median
    memory, the busiest the machine was; an error only if every pass failed."""
    done = [r for r in results if "step_s" in r]
    if not done:
        return results[0]
    steps = [step for r in done for step in r["steps"]]
    combined = dict(done[0], steps=steps, step_s=statistics.median(steps), passes=len(done),
                    wall_s=sum(r["wall_s"] for r in done),
                    machine_busy_cores=max(r["machine_busy_cores"] for r in done))
    for key in ("step_cpu_s", "gemm_flops", "attention_flops", "elementwise_bandwidth", "op_overhead_s",
                "copy_bandwidth", "block_factor", "memory",
                "weights", "activations"):
        combined[key] = statistics.median(r[key] for r in done)
    return combined


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['model']} {row['size']} {row['mesh']}: {row['error']}"
    return (f"{row['model']} {row['size']} {row['mesh']}: step {row['step_s']:.3f} s (predicted "
            f"{row['predicted_step_s']:.3f}; CPU {row['step_cpu_s']:.3f} s), memory {row['memory'] / 1e6:.1f} MB "
            f"(predicted "
            f"{row['predicted_memory'] / 1e6:.1f}), machine busy {row['machine_busy_cores']:.1f} cores")


def tables(rows: list[dict]) -> str:
    lines = ["| model | tokens | mesh | step s measured | predicted | ratio | MB/rank measured | predicted | ratio | "
             "busy cores |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "step_s" not in r:
            lines.append(f"| {r['model']} | {r['latent_tokens']}+{r['text_tokens']} | {r['mesh']} | "
                         f"{r.get('error', '')} |||||||")
            continue
        lines.append(f"| {r['model']} | {r['latent_tokens']}+{r['text_tokens']} | {r['mesh']} | {r['step_s']:.3f} | "
                     f"{r['predicted_step_s']:.3f} | {r['predicted_step_s'] / r['step_s']:.2f} | "
                     f"{r['memory'] / 1e6:.1f} | {r['predicted_memory'] / 1e6:.1f} | "
                     f"{r['predicted_memory'] / r['memory']:.2f} | {r['machine_busy_cores']:.1f} |")
    lines += ["", "| model | tokens | mesh | efficiency | vs single |", "|---|---|---|---|---|"]
    for r in rows:
        if r["mesh"] in EFFICIENCY_MESHES and "efficiency" in r:
            lines.append(f"| {r['model']} | {r['latent_tokens']}+{r['text_tokens']} | {r['mesh']} | "
                         f"{r['efficiency']:.2f} | " + (f"{r['efficiency_vs_single']:.2f} |"
                                                         if r["efficiency_vs_single"] is not None else "- |"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
