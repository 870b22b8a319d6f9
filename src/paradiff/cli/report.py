"""What a run tells its user: report.json and its summary lines (one-line messages: runtime/console.py, say)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from paradiff.cli.common import lora_specs, quantize_skip


OUTPUT_SUFFIXES = (".png", ".mp4", ".wav", ".gif", ".webp", ".jpg")  # what a run writes besides report.json


def clear_previous_run(out: Path) -> int:
    """The files a previous run wrote into `out`, as its report.json names them (images, videos, sounds, the
    comparison, a video's frames), and that report: removed, so that a run into the same folder leaves no stale output
    beside its own. Only files inside `out` with an output's suffix go; anything else stays. Returns how many went."""
    report = out / "report.json"
    try:
        old = json.loads(report.read_text())
    except (OSError, ValueError):
        return 0
    named: set[str] = set()

    def walk(value) -> None:
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, str) and value.endswith(OUTPUT_SUFFIXES):
            named.add(value)

    walk(old)
    removed = 0
    folder = out.resolve()
    for name in sorted(named):
        path = Path(name) if Path(name).is_absolute() else out / name
        try:
            if path.resolve().is_relative_to(folder) and path.is_file():
                path.unlink()
                removed += 1
        except OSError:
            pass
    report.unlink(missing_ok=True)
    return removed


def write_report(args: argparse.Namespace, out: Path, model: str, prompts: list[str], run: dict,
                 gathered: list[dict], compare: dict | None) -> dict:
    """Write report.json from every rank's statistics (`gathered`) and print the summary lines; returns the report.

    `outputs` maps each prompt's index to what was written for it: kind ("image" or "video"), frame count, the PNG
    or MP4 path and, for a video, every frame's PNG; for a sound its WAV path, sampling rate and length in seconds.
    `images` (index -> PNG) and `audios` (index -> WAV) list the image and the sound outputs alone.
    """
    import numpy as np

    # keyed by the prompt's index as a string, as JSON has it
    outputs = {str(index): entry for index, entry in sorted(
        (int(index), entry) for stats in gathered for index, entry in stats["outputs"].items())}
    report = {
        "model": model,
        "config": {"tp": args.tp, "ulysses": args.ulysses, "ring": args.ring, "cfg": args.cfg, "dp": args.dp,
                   "fsdp": getattr(args, "fsdp", 1),
                   "stages": args.stages, "whole_text_encoders": args.whole_text_encoders,
                   "quantize": getattr(args, "quantize", None),
                   "quantize_skip": list(quantize_skip(args)),
                   "quantize_text_encoders": bool(getattr(args, "quantize_text_encoders", False)),
                   "gguf": getattr(args, "gguf", None), **run},
        "resolution": [args.height, args.width],
        "frames": args.frames,
        "steps": args.steps,
        "dtype": args.dtype,
        "seed": args.seed,
        "prompts": prompts,
        "ranks": gathered,
        "outputs": outputs,
        "images": {index: entry["path"] for index, entry in outputs.items() if entry["kind"] == "image"},
        "audios": {index: entry["path"] for index, entry in outputs.items() if entry["kind"] == "audio"},
    }
    if any("without_lora" in entry for entry in outputs.values()):  # --also-without-lora
        report["without_lora"] = {index: entry["without_lora"]["path"] for index, entry in outputs.items()}
    if compare is not None:
        report["max_abs_diff_vs_single_process"] = compare["max_abs_diff"]
        report["compared_outputs"] = compare["compared"]
        if compare.get("picture"):
            report["compare_png"] = compare["picture"]
        if "max_abs_diff_per_frame" in compare:
            report["max_abs_diff_per_frame_vs_single_process"] = compare["max_abs_diff_per_frame"]
        if "max_abs_diff_audio" in compare:
            report["max_abs_diff_audio_vs_single_process"] = compare["max_abs_diff_audio"]
        if "max_abs_diff_without_lora" in compare:
            report["max_abs_diff_without_lora_vs_single_process"] = compare["max_abs_diff_without_lora"]
    report["compile"] = bool(getattr(args, "compile", False))
    report["loras"] = lora_specs(args)  # adapter name, path or repo, scale: the --lora adapters, in order
    if getattr(args, "cache", None):
        # the ranks of one forward agree by construction; under CFG parallelism each half holds one context
        per_image: dict[str, dict[str, list[int]]] = {}
        for stats in gathered:
            for index, contexts in stats.get("cache_computed_steps", {}).items():
                per_image.setdefault(str(index), {}).update(contexts)
        report["cache"] = {"spec": args.cache, "computed_steps": per_image}
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    steps = [s["step_s_median"] for s in gathered if s["step_s_median"] is not None]
    load_s = gathered[0]["load_s"]
    videos = [entry for entry in outputs.values() if entry["kind"] == "video"]
    counts = {kind: sum(entry["kind"] == kind for entry in outputs.values()) for kind in ("image", "audio")}
    made = [f"{len(videos)} video(s) ({sum(v['frames'] for v in videos)} frames"
            f"{', with sound' if any('audio_path' in v for v in videos) else ''})"] if videos else []
    made += [f"{counts['image']} image(s)"] * bool(counts["image"]) + [f"{counts['audio']} sound(s)"] * bool(counts["audio"])
    made = " and ".join(made)
    print(f"paradiff: {made} in {out}; load {load_s:.2f} s; "
          f"median step {np.median(steps):.3f} s; world {run['world_size']} "
          f"(tp={args.tp} ulysses={args.ulysses} ring={args.ring} cfg={args.cfg} dp={args.dp}"
          f"{f' fsdp={args.fsdp}' if getattr(args, 'fsdp', 1) > 1 else ''})")
    for index, entry in outputs.items():
        plain = f" (without LoRA: {Path(entry['without_lora']['path']).name})" if "without_lora" in entry else ""
        print(f"paradiff:   {Path(entry['path']).name}  {prompts[int(index)]}{plain}")
    if compare is not None:
        what = "video (every frame)" if "max_abs_diff_per_frame" in compare else "image" if counts["image"] else "sound"
        worst = compare["max_abs_diff"]
        picture = f"; side by side in {compare['picture']}" if compare.get("picture") else ""
        print(f"paradiff: max |difference| to the single-process {what}: {worst:.2e} ({worst * 255:.2g} of a 255 "
              f"level, over {compare['compared']} output(s) of rank 0){picture}")
        if "max_abs_diff_audio" in compare:
            print(f"paradiff: max |difference| to the single-process soundtrack: {compare['max_abs_diff_audio']:.2e}")
    for index, contexts in report.get("cache", {}).get("computed_steps", {}).items():
        for context, computed in sorted(contexts.items()):
            print(f"paradiff: cache {args.cache}: output {int(index):04d} ({context}) computed steps {computed}, "
                  f"{len(computed)} of {args.steps}")
    print(stage_table(gathered, run.get("device", "cpu")))
    return report


def stage_table(gathered: list[dict], device: str) -> str:
    """Per rank and stage: load and run time, peak memory, parameter bytes held (report.json's `stages`), and what
    the stage's components held while it ran: quantized bytes, full-precision bytes, each component's scheme."""
    peak = "CUDA max allocated" if device == "cuda" else "peak RssAnon"
    lines = [f"paradiff: per-stage figures (peak: {peak}; quant / full: the stage's own components, quantized and "
             "full-precision bytes)",
             f"{'rank':>4}  {'stage':<14}{'load s':>8}{'run s':>8}{'peak MiB':>10}{'params MiB':>12}"
             f"{'quant MiB':>11}{'full MiB':>10}  schemes"]
    for stats in gathered:
        for stage in stats.get("stages", []):
            components = stage.get("components", {})
            schemes = " ".join(f"{name}={entry['scheme'] or '-'}" for name, entry in sorted(components.items()))
            lines.append(f"{stats['rank']:>4}  {stage['stage']:<14}{stage['load_s']:>8.2f}{stage['run_s']:>8.2f}"
                         f"{stage['peak_bytes'] / 2**20:>10.1f}{stage['parameter_bytes'] / 2**20:>12.2f}"
                         f"{stage.get('quantized_bytes', 0) / 2**20:>11.2f}"
                         f"{stage.get('full_precision_bytes', 0) / 2**20:>10.2f}  {schemes}")
    return "\n".join(lines)
