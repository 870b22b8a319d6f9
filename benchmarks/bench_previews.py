"""What an x0 preview costs on the trained demo pipeline: the linear latent-to-RGB map against the VAE itself.

The embedded demo pipeline (a tiny FLUX.2, paradiff/assets/demo) draws its first default prompt; at every step end
(from step 2, where x0 has two latents to come from) the step callback renders the x0 preview both ways. Figures:
the median time of a denoising step without previews, of a linear-map preview and of a VAE preview, each preview's
share of a step, the map's fit (time at load, RMS error on a held-out random latent and on the final image's latents
against their VAE decode, per latent cell). Single process: the server renders previews on one rank per replica
(the output rank), the same work. Rounds interleave the three kinds of run.

    .venv/bin/python benchmarks/bench_previews.py [--steps 8] [--rounds 3] [--size 64]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import quiet_diffusers  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "bench_previews.json"


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--no-write", action="store_true", help="print, do not write benchmarks/results")
    args = parser.parse_args()

    import os

    import torch
    import torch.nn.functional as F
    from diffusers import DiffusionPipeline

    from paradiff.demo import CALL_KWARGS, DEFAULT_PROMPTS, pipeline_path
    from paradiff.plans.previews import preview_layout
    from paradiff.runtime import previews

    quiet_diffusers()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    pipeline = DiffusionPipeline.from_pretrained(str(pipeline_path()))
    pipeline.set_progress_bar_config(disable=True)
    layout = preview_layout(pipeline)
    start = time.perf_counter()
    linear = previews.fit_linear_map(pipeline, layout)
    fit_s = time.perf_counter() - start
    kwargs = {**CALL_KWARGS, "height": args.size, "width": args.size, "num_inference_steps": args.steps}

    def run(mode: str | None) -> tuple[list[float], list[float], torch.Tensor]:
        """(step times, preview times, final latents) of one call; the step time excludes the preview's."""
        maker = None if mode is None else previews.PreviewMaker(pipeline, layout, mode, linear)
        steps, renders = [], []
        last = [time.perf_counter()]

        def on_step(_pipe, _step, _timestep, callback_kwargs):
            now = time.perf_counter()
            steps.append(now - last[0])
            if maker is not None:
                if maker.can_render():
                    maker.render(callback_kwargs["latents"], args.size, args.size)
                    renders.append(time.perf_counter() - now)
                maker.observe(callback_kwargs["latents"])
            last[0] = time.perf_counter()
            return {}

        latents = pipeline(prompt=DEFAULT_PROMPTS[0], generator=torch.Generator().manual_seed(0), output_type="latent",
                           callback_on_step_end=on_step, **kwargs).images
        return steps, renders, latents

    step_s, linear_s, vae_s = [], [], []
    latents = None
    for _ in range(args.rounds):
        plain, _, latents = run(None)
        step_s += plain[1:]  # the first step carries the call's warm-up
        linear_s += run("linear")[1]
        vae_s += run("vae")[1]
    cell = layout.cell(pipeline)
    grid = layout.grid(latents, args.size // cell, args.size // cell)
    with torch.no_grad():
        pooled = F.avg_pool2d(previews._decode(pipeline.vae, layout, grid), cell)
    real_error = float((linear(grid).clamp(0, 1) - pooled).pow(2).mean().sqrt())
    step, lin, vae = (statistics.median(values) for values in (step_s, linear_s, vae_s))
    note = (f"median over {args.rounds} interleaved rounds of {args.steps} steps at {args.size}x{args.size}; "
            "measured under load")
    figures = [
        {"name": "denoising step (no previews)", "value": round(step * 1e3, 3), "unit": "ms", "note": note},
        {"name": "linear-map preview", "value": round(lin * 1e3, 3), "unit": "ms", "note": note},
        {"name": "VAE preview", "value": round(vae * 1e3, 3), "unit": "ms", "note": note},
        {"name": "linear-map preview / step", "value": round(lin / step, 4), "unit": "x", "goal": "<= 0.05",
         "met": lin / step <= 0.05, "note": note},
        {"name": "VAE preview / step", "value": round(vae / step, 4), "unit": "x", "note": note},
        {"name": "linear map fit at load", "value": round(fit_s, 3), "unit": "s",
         "note": f"{previews.FIT_SAMPLES} VAE decodes of {previews.FIT_CELLS}x{previews.FIT_CELLS}-cell random "
                 "latents; measured under load"},
        {"name": "linear map RMS error, held-out random latent", "value": linear.fit_error, "unit": "of 1",
         "note": "per latent cell against the VAE decode's cell mean, RGB in [0, 1]"},
        {"name": "linear map RMS error, final latents of the prompt", "value": round(real_error, 4), "unit": "of 1",
         "note": "per latent cell against the VAE decode's cell mean, RGB in [0, 1]"},
    ]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"benchmark": "bench_previews",
              "title": "x0 preview cost per step: linear latent-to-RGB map vs the VAE (demo FLUX.2, 1 process)",
              "command": " ".join(["python benchmarks/bench_previews.py", *sys.argv[1:]]),
              "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "device": "cpu"}, "figures": figures}
    for figure in figures:
        print(f"{figure['name']:<52} {figure['value']:>10} {figure['unit']}")
    if not args.no_write:
        RESULT.parent.mkdir(exist_ok=True)
        RESULT.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
