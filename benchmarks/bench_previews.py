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
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import quiet_diffusers  # noqa: E402
from results import figure, write_result  # noqa: E402


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
    note = f"median over {args.rounds} interleaved rounds of {args.steps} steps at {args.size}x{args.size}"
    fit_note = "per latent cell against the VAE decode's cell mean, RGB in [0, 1]"
    figures = [
        figure("denoising step (no previews)", round(step * 1e3, 3), "ms", note=note),
        figure("linear-map preview", round(lin * 1e3, 3), "ms", note=note),
        figure("VAE preview", round(vae * 1e3, 3), "ms", note=note),
        figure("linear-map preview / step", round(lin / step, 4), "x", "<= 0.05", note=note),
        figure("VAE preview / step", round(vae / step, 4), "x", note=note),
        figure("linear map fit at load", round(fit_s, 3), "s",
               note=f"{previews.FIT_SAMPLES} VAE decodes of {previews.FIT_CELLS}x{previews.FIT_CELLS}-cell random "
                    "latents"),
        figure("linear map RMS error, held-out random latent", linear.fit_error, "of 1", note=fit_note),
        figure("linear map RMS error, final latents of the prompt", round(real_error, 4), "of 1", note=fit_note),
    ]
    for item in figures:
        print(f"{item['name']:<52} {item['value']:>10} {item['unit']}")
    if not args.no_write:
        write_result("bench_previews",
                     "x0 preview cost per step: linear latent-to-RGB map vs the VAE (demo FLUX.2, 1 process)", figures)


if __name__ == "__main__":
    main()
