"""End-to-end pipelines through the real `paradiff generate` command: time per image, steps/s, peak memory per rank
and the max difference to the single-process image, for every composed mode that fits 4 ranks.

    .venv/bin/python benchmarks/bench_pipelines.py                  # all sections (~13 min on 2 cores)
    .venv/bin/python benchmarks/bench_pipelines.py --sections tiny  # one section
    .venv/bin/python benchmarks/bench_pipelines.py --quick          # tiny section, 3 modes: checks the script

Sections (each starts with its own single-process run, the reference of every ratio in that section):

- tiny:  the embedded default (`paradiff generate` with no MODEL: tiny FLUX.2 pipeline, 4 heads x 16), 64x64.
- large: a FLUX.2 pipeline folder built here with a bigger transformer (8 heads x 64, 2 double + 4 single blocks,
         ~32 M parameters), 128x128 (1024 image tokens).
- cfg:   a Qwen-Image pipeline folder built here (8 heads x 64, 4 blocks, ~39 M parameters), 128x128 (1024 image
         tokens), with a negative prompt and true_cfg_scale 4: true CFG, so cfg=2 applies (FLUX.2 runs no true CFG).

Per mode two runs of the command: one timed (no --compare, so rank 0's peak RSS is not inflated by the reference
pipeline), one with --compare for the max abs difference of the first image to the single-process diffusers
pipeline. From the timed run's report.json: the median step time (slowest rank), peak memory (max over ranks,
CPU max RSS of each worker process), load time; the command's wall time is measured around it. The wall time of
each pipeline call (text encoding + denoising + VAE decode) is not in report.json: a `sitecustomize` put on the
workers' PYTHONPATH by this script wraps the pipeline's `__call__` with a timer and writes one line per call; it
changes nothing else. dp modes get 2 prompts (one per replica); their per-image times are throughput (wall / images).

The launcher gives each worker one torch thread (OMP_NUM_THREADS unset here), so the single process uses one of the
2 cores, 2-rank modes use both, and 4-rank modes oversubscribe them 2x.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
TESTKIT = str(Path(__file__).resolve().parents[1] / "testkit")  # paradiff_testkit (docs/testing.md)
sys.path.insert(0, TESTKIT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTKIT, os.environ.get("PYTHONPATH")]))  # and its children

from _common import ForeignLoad, foreign_benchmarks, wait_for_quiet  # noqa: E402
from results import figure, write_result  # noqa: E402

from paradiff.config import parse_mode  # noqa: E402
PARADIFF = [sys.executable, "-m", "paradiff.cli"]
MiB = 2**20
FOREIGN_CPU_LIMIT = 0.10  # other processes' CPU time, as a fraction of the run's wall time, above which we re-measure

FLUX_MODES = ["single", "tp=2", "ulysses=2", "ring=2", "tp=2+ulysses=2", "tp=2+ring=2", "ulysses=2+ring=2", "dp=2",
              "dp=2+tp=2"]
CFG_MODES = ["single", "tp=2", "ulysses=2", "cfg=2", "cfg=2+tp=2", "cfg=2+ulysses=2", "dp=2", "dp=2+cfg=2"]
PROMPTS = ["a red cube on a blue table", "a small red fox running through the snow"]

LARGE_FLUX2 = dict(num_attention_heads=8, attention_head_dim=64, num_layers=2, num_single_layers=4)
LARGE_QWEN = dict(num_attention_heads=8, attention_head_dim=64, num_layers=4)

SECTIONS = {
    "tiny": dict(family="flux2", overrides=None, height=64, width=64, steps=4, modes=FLUX_MODES, extra=[]),
    "large": dict(family="flux2", overrides=LARGE_FLUX2, height=128, width=128, steps=3, modes=FLUX_MODES, extra=[]),
    "cfg": dict(family="qwenimage", overrides=LARGE_QWEN, height=128, width=128, steps=3, modes=CFG_MODES,
                extra=["--negative-prompt", "blurry, low quality", "--true-cfg-scale", "4"]),
}

# Put on the workers' PYTHONPATH: times each call of the parallel pipeline (ParallelPipelineMixin.__call__), one
# JSON line per call in $PARADIFF_BENCH_TIMES/rank<RANK>.jsonl. Only active in worker processes.
SITECUSTOMIZE = r'''
import importlib.abc, importlib.util, json, os, sys, time

class _TimePipelineCalls(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "paradiff.api.pipeline":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            mixin = module.ParallelPipelineMixin
            call = mixin.__call__

            def timed_call(self, *args, **kwargs):
                start = time.time()
                result = call(self, *args, **kwargs)
                end = time.time()
                path = os.path.join(os.environ["PARADIFF_BENCH_TIMES"], "rank%s.jsonl" % os.environ.get("RANK", "0"))
                with open(path, "a") as handle:
                    handle.write(json.dumps({"start": start, "end": end}) + "\n")
                return result

            mixin.__call__ = timed_call

        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("PARADIFF_BENCH_TIMES") and os.environ.get("PARADIFF_WORKER"):
    sys.meta_path.insert(0, _TimePipelineCalls())
'''


def degrees_of(mode: str) -> dict[str, int]:
    """The CLI flags of a mode spelled as `paradiff bench` spells it ("single", "dp=2+tp=2"), above 1 only."""
    degrees = parse_mode(mode.replace("+", "x"))
    return {("dp" if name == "data" else name): value for name, value in degrees.items() if value > 1}


def build_folder(family: str, overrides: dict | None, root: Path) -> str | None:
    """None for the embedded default; otherwise a pipeline folder (built once, reused when already there)."""
    if overrides is None and family == "flux2":
        return None
    name = f"{family}-" + "-".join(f"{k}{v}" for k, v in sorted((overrides or {}).items()))
    folder = root / "models" / name
    if not (folder / "model_index.json").is_file():
        code = (
            "import sys, json; from paradiff_testkit.pipelines import build_pipeline\n"
            "pipe = build_pipeline(sys.argv[1], seed=0, transformer_overrides=json.loads(sys.argv[2]))\n"
            "pipe.save_pretrained(sys.argv[3], safe_serialization=True)\n"
            "print(sum(p.numel() for p in pipe.transformer.parameters()))\n"
        )
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=folder.parent))
        subprocess.run([sys.executable, "-c", code, family, json.dumps(overrides or {}), str(staging)], check=True,
                       cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.move(str(staging), folder)
    return str(folder)


def transformer_params(folder: str | None) -> int:
    from safetensors import safe_open

    path = Path(folder) if folder else REPO / ".cache/paradiff/tiny-flux2-pipeline"
    total = 0
    for file in sorted((path / "transformer").glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            for key in handle.keys():
                count = 1
                for size in handle.get_slice(key).get_shape():
                    count *= size
                total += count
    return total


def run_generate(model: str | None, mode: str, section: dict, out: Path, shim: Path, compare: bool) -> dict:
    """One run of the command; retried once if it failed before writing report.json (the first failure is kept)."""
    result = _run_generate(model, mode, section, out, shim, compare)
    if "step_s" not in result:
        retry = _run_generate(model, mode, section, out, shim, compare)
        retry["first_attempt"] = {k: result[k] for k in ("rc", "wall_s", "stderr_tail")}
        result = retry
    return result


def _run_generate(model: str | None, mode: str, section: dict, out: Path, shim: Path, compare: bool) -> dict:
    degrees = degrees_of(mode)
    prompts = PROMPTS[: degrees.get("dp", 1)]
    argv = ["generate"] + ([model] if model else [])
    for prompt in prompts:
        argv += ["--prompt", prompt]
    for key, value in degrees.items():
        argv += [f"--{key}", str(value)]
    argv += ["--steps", str(section["steps"]), "--height", str(section["height"]), "--width", str(section["width"]),
             *section["extra"], "--out", str(out)]
    if compare:
        argv.append("--compare")
    shutil.rmtree(out, ignore_errors=True)
    times = out / "call-times"
    times.mkdir(parents=True)
    env = dict(os.environ, PARADIFF_BENCH_TIMES=str(times),
               PYTHONPATH=os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")])))
    env.pop("OMP_NUM_THREADS", None)
    overlap = foreign_benchmarks()
    start = time.perf_counter()
    with ForeignLoad() as foreign:
        proc = subprocess.run(PARADIFF + argv, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    overlap += foreign_benchmarks()
    if foreign.seconds > FOREIGN_CPU_LIMIT * wall:
        overlap.append(f"{foreign.seconds:.1f} CPU s of other processes during {wall:.1f} s")
    result = {"mode": mode, "argv": argv, "rc": proc.returncode, "wall_s": wall, "overlapping_benchmarks": overlap,
              "foreign_cpu_s": foreign.seconds,
              "stderr_tail": proc.stderr.strip().splitlines()[-3:], "stdout": proc.stdout.strip().splitlines()}
    report_path = out / "report.json"
    if not report_path.is_file():  # failed before the report; a report with rc != 0 is kept (see exit_note)
        return result
    if proc.returncode != 0:
        result["exit_note"] = f"exit {proc.returncode} after writing report.json: {' / '.join(result['stderr_tail'])}"
    report = json.loads(report_path.read_text())
    ranks = report["ranks"]
    calls = {}
    for file in times.glob("rank*.jsonl"):
        calls[int(file.stem[4:])] = [json.loads(line) for line in file.read_text().splitlines()]
    result.update(
        world=report["config"]["world_size"],
        images=len(report["images"]),
        step_s=max(r["step_s_median"] for r in ranks),
        step_s_per_rank=[r["step_s_median"] for r in ranks],
        peak_bytes=max(r["peak_memory_bytes"] for r in ranks),
        peak_bytes_per_rank=[r["peak_memory_bytes"] for r in ranks],
        load_s=max(r["load_s"] for r in ranks),
        generation_wall_s=generation_wall(calls, report["config"]["world_size"], report["config"]["dp"]),
        calls_per_rank={k: v for k, v in sorted(calls.items())},
        max_abs_diff=report.get("max_abs_diff_vs_single_process"),
    )
    return result


def generation_wall(calls: dict[int, list[dict]], world: int, dp: int) -> float | None:
    """Wall time of the pipeline calls once every rank of a replica is in: per call, from the last rank's start to
    the last rank's end (ranks that finished loading early wait for the others in the first collective; that wait is
    load skew, not generation). Summed over a replica's calls; the slowest replica counts (replicas run at once)."""
    if len(calls) != world or any(not c for c in calls.values()):
        return None
    per_replica = world // dp  # data is the outermost mesh dimension: replica r holds ranks r*per_replica, ...
    walls = []
    for replica in range(dp):
        ranks = [calls[r] for r in range(replica * per_replica, (replica + 1) * per_replica)]
        walls.append(sum(max(c[i]["end"] for c in ranks) - max(c[i]["start"] for c in ranks)
                         for i in range(len(ranks[0]))))
    return max(walls)


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def section_table(name: str, section: dict, rows: list[dict]) -> str:
    steps = section["steps"]
    base = next((r for r in rows if r["mode"] == "single" and "step_s" in r), None)
    lines = [
        "| mode | ranks | median step (ms) | steps/s | denoise / image (ms) | vs single | generation wall / image (ms) "
        "| vs single | command wall (s) | load (s) | peak RSS / rank, max (MiB) | max abs diff vs single |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "step_s" not in row:
            why = "; ".join(row.get("stderr_tail") or []) or f"exit code {row['rc']}"
            lines.append(f"| {row['mode']} | failed: {why} |" + " |" * 10)
            continue
        images = row["images"]
        dp = degrees_of(row["mode"]).get("dp", 1)
        denoise = row["step_s"] * steps / dp  # throughput: the dp replicas denoise their images at the same time
        gen = row["generation_wall_s"] / images if row["generation_wall_s"] else None
        if base is not None:
            base_denoise = base["step_s"] * steps
            base_gen = base["generation_wall_s"] / base["images"] if base.get("generation_wall_s") else None
            ratio = f"{denoise / base_denoise:.2f}x"
            gen_ratio = f"{gen / base_gen:.2f}x" if gen and base_gen else "-"
        else:
            ratio = gen_ratio = "-"
        diff = row.get("compare_diff")
        diff_text = row.get("compare_error") or fmt(diff, ".1e")
        lines.append(
            f"| {row['mode']} | {row['world']} | {row['step_s'] * 1000:.1f} | {1 / row['step_s']:.2f} "
            f"| {denoise * 1000:.1f} | {ratio} | {fmt(gen and gen * 1000, '.1f')} | {gen_ratio} "
            f"| {row['wall_s']:.1f} | {row['load_s']:.2f} | {row['peak_bytes'] / MiB:.0f} | {diff_text} |"
        )
    return "\n".join(lines)


def machine() -> str:
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), {mem:.0f} GiB RAM, "
            f"Python {platform.python_version()}, torch {torch.__version__}, gloo")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="tiny,large,cfg", help=f"comma-separated, from {list(SECTIONS)}")
    parser.add_argument("--modes", default="", help="comma-separated subset of modes (default: all of a section)")
    parser.add_argument("--out", default="out/bench_pipelines", help="work folder (models, outputs, results.json)")
    parser.add_argument("--no-compare", action="store_true", help="skip the --compare runs (half the time)")
    parser.add_argument("--quick", action="store_true", help="tiny section, modes single,tp=2,dp=2+tp=2")
    parser.add_argument("--wait", type=float, default=1800.0,
                        help="seconds to wait at start for other benchmarks/bench_* processes to finish")
    parser.add_argument("--overlap-retries", type=int, default=3,
                        help="re-measure a mode (after waiting) when another benchmark ran during it")
    args = parser.parse_args()
    wait_for_quiet(timeout_s=args.wait, window_s=5.0, quiet_s=30.0, alone=True)
    if args.quick:
        args.sections, args.modes = "tiny", "single,tp=2,dp=2+tp=2"
    root = (REPO / args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    shim = root / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE)
    started = time.perf_counter()
    print(f"# {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {machine()}", flush=True)
    subprocess.run(PARADIFF + ["generate", "--steps", "1", "--out", str(root / "warmup")], cwd=REPO,
                   capture_output=True)  # builds the embedded default once and warms the page cache
    results = {}
    for name in args.sections.split(","):
        section = SECTIONS[name]
        model = build_folder(section["family"], section["overrides"], root)
        modes = [m for m in section["modes"] if not args.modes or m in args.modes.split(",")]
        print(f"\n## {name}: {model or 'embedded default'}; {transformer_params(model) / 1e6:.1f} M transformer "
              f"parameters; {section['height']}x{section['width']}, {section['steps']} steps", flush=True)
        rows = []
        for mode in modes:
            for attempt in range(args.overlap_retries + 1):
                row = run_generate(model, mode, section, root / name / mode.replace("=", "").replace("+", "_"),
                                   shim, compare=False)
                if not row["overlapping_benchmarks"] or attempt == args.overlap_retries:
                    break
                print(f"  {mode}: another benchmark ran meanwhile {row['overlapping_benchmarks']}; measuring again",
                      flush=True)
                wait_for_quiet(timeout_s=args.wait, window_s=5.0, quiet_s=30.0, alone=True)
            if not args.no_compare and "step_s" in row:
                checked = run_generate(model, mode, section, root / name / (mode.replace("=", "").replace("+", "_")
                                                                            + "-compare"), shim, compare=True)
                row["compare_diff"] = checked.get("max_abs_diff")
                row["compare_rc"] = checked["rc"]
                if row["compare_diff"] is None:
                    row["compare_error"] = f"failed (exit {checked['rc']}: {' '.join(checked['stderr_tail'])})"
                row["compare_wall_s"] = checked["wall_s"]
                for key in ("exit_note", "first_attempt"):
                    if key in checked:
                        row[f"compare_{key}"] = checked[key]
            rows.append(row)
            status = (f"step {row['step_s'] * 1000:.1f} ms, wall {row['wall_s']:.1f} s, peak "
                      f"{row['peak_bytes'] / MiB:.0f} MiB, diff {row.get('compare_diff')}") if "step_s" in row \
                else f"FAILED rc={row['rc']}: {row['stderr_tail']}"
            print(f"  {mode:18s} {status}", flush=True)
        results[name] = {"model": model, "section": section, "rows": rows}
        print(f"\ncommand: paradiff {shlex.join(rows[0]['argv'][:-2] if rows else [])} --out DIR "
              f"[--tp/--ulysses/--ring/--cfg/--dp N] [--prompt P2 for dp] [--compare]\n")
        print(section_table(name, section, rows), flush=True)
    (root / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"\ntotal {time.perf_counter() - started:.0f} s; raw results in {root / 'results.json'}")
    incidents = [(name, r["mode"], key, r[key]) for name, sec in results.items() for r in sec["rows"]
                 for key in ("exit_note", "first_attempt", "compare_exit_note", "compare_first_attempt") if key in r]
    incidents += [(name, r["mode"], "overlapping_benchmarks", sorted(set(r["overlapping_benchmarks"])))
                  for name, sec in results.items() for r in sec["rows"] if r.get("overlapping_benchmarks")]
    for incident in incidents:
        print("incident:", *incident)
    failed = [r["mode"] for sec in results.values() for r in sec["rows"]
              if "step_s" not in r or (not args.no_compare and r.get("compare_diff") is None)]
    if failed:
        print(f"failed runs: {failed}")
    figures = []
    for name, section in results.items():
        base = next((r for r in section["rows"] if r["mode"] == "single" and "step_s" in r), None)
        for row in section["rows"]:
            if base is not None and row is not base and "step_s" in row:
                ratio = row["step_s"] / degrees_of(row["mode"]).get("dp", 1) / base["step_s"]
                figures.append(figure(f"{name}: {row['mode']} denoise per image / single", round(ratio, 3), "x"))
    diffs = [r["compare_diff"] for sec in results.values() for r in sec["rows"] if r.get("compare_diff") is not None]
    if diffs:
        figures.append(figure("max abs diff vs single-process diffusers, any mode", float(f"{max(diffs):.2g}"), "abs",
                              "<= 1e-05", note="on [0, 1] images"))
    if figures:
        write_result("bench_pipelines", f"End-to-end paradiff generate ({args.sections}) on 1, 2 and 4 ranks", figures)
    return 1 if failed or incidents else 0


if __name__ == "__main__":
    sys.exit(main())
