"""The GPU fast path measured on one GPU, in one run that fits 8 minutes (issue 42, item 3).

    python tools/gpu_bench.py [--out benchmarks/results] [--models flux,qwen,wan] [--budget-s 420]
    python tools/gpu_bench.py --dry-run          # on CPU, tiny configs: checks that every part runs end to end

Models: FLUX.1-dev at 1024^2 (4096 + 512 tokens), Qwen-Image at 1024^2 (4096 + 512), Wan2.1-I2V-14B at 480p x 81
frames (32760 + 512 tokens, 257 image tokens), built from their published configs (`plans/reference_configs.py`)
with random weights directly on the GPU in bf16: no checkpoint is read or written. Batch 1 per call.

Variants, each timed on the same model (CUDA events, warm-up first, median of --repeats forwards):
- `diffusers`: diffusers' own model, eager, torch's default SDPA choice;
- `diffusers sdpa=BACKEND`: the same under one SDPA backend (flash, cuDNN, efficient); the fastest is "best";
- `paradiff world 1`: `paradiff.enable_parallelism` on a one-rank mesh (NCCL), the public API, best backend;
- `paradiff compile`: + `paradiff.compile` (inductor, the block stack), and `... cudagraphs` (mode reduce-overhead);
- `paradiff fp8 compile`: + torchao float8 dynamic rowwise GEMMs (`Float8DynamicActivationFloat8WeightConfig`,
  PerRow), where torchao imports.
Per variant: seconds per forward, per step (the pipeline's calls per step: Wan and Qwen-Image guide, 2 calls; FLUX.1
is guidance-distilled, 1), 50 steps (transformer only: text encoders and VAE left out), the FLOPs of a forward (the
cost model's count, `plan_tools/cost.py`) and MFU against the datasheet's dense bf16 peak and against the GEMM rate
measured first in the same run (8192^3 bf16). Goals (issue 42): paradiff world 1 no slower than diffusers; MFU >= 50%
on the FLUX.1 block stack at 4096 tokens; FLUX.1-dev and Qwen-Image at 50 steps at or under SGLang's 1xH100 figures
(6.69 s, 12.77 s); on an H200 the comparison is indicative only (same compute, faster memory).

Each variant is guarded: an error is recorded and the run goes on; once --budget-s is spent the remaining variants
are recorded as skipped. Results: OUT/gpu_bench-<device>-<UTC time>.json, and a table printed last.

On the lent GPU machines (no network): carry wheels of diffusers and torchao and this repository's src on
PYTHONPATH, e.g. `PYTHONPATH=src python3 tools/gpu_bench.py` (docs/testing.md, "On a GPU").
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from paradiff.plan_tools.cost import forward_cost, model_shape  # noqa: E402
from paradiff.plans.reference_configs import REFERENCE_CONFIGS  # noqa: E402
from paradiff.testing.models import Lengths, make_inputs, model_class, tiny_config  # noqa: E402

# name -> (reference config, testing family, latent grid (frames, height, width) in tokens, calls per step,
#          SGLang's published 50-step seconds on 1xH100, or None)
MODELS = {
    "flux": ("flux.1-dev", "flux", (1, 64, 64), 1, 6.69),
    "qwen": ("qwen-image", "qwenimage", (1, 64, 64), 2, 12.77),
    "wan": ("wan2.1-i2v-14b", "wan", (21, 30, 52), 2, None),
}
TEXT_TOKENS = 512
IMAGE_TOKENS = 257  # Wan I2V: CLIP image tokens
DATASHEET_BF16 = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}


class Clock:
    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def time(self, fn, repeats: int, warmup: int = 1) -> list[float]:
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                began = time.perf_counter()
                fn()
                times.append(time.perf_counter() - began)
        return times

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def gemm_rate(device: str, dtype: torch.dtype, size: int, clock: Clock) -> float:
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(size, size, device=device, generator=generator).to(dtype) for _ in range(2))
    return 2 * size ** 3 / statistics.median(clock.time(lambda: a @ b, repeats=10, warmup=3))


def build(family: str, config: dict, device: str, dtype: torch.dtype):
    """diffusers' class of `config`, random weights, made on `device` in `dtype` (never in float32 first)."""
    cls = model_class(family)
    import inspect

    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {key: value for key, value in config.items() if key in accepted}
    previous = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = cls(**kwargs)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(dtype)
    keep = getattr(cls, "_keep_in_fp32_modules", None) or []  # as from_pretrained(torch_dtype=bf16) keeps them
    for module_name, module in model.named_modules():
        if any(part in keep for part in module_name.split(".")):
            module.float()
    return model.eval()


def inputs_for(family: str, model, grid: tuple[int, int, int], text: int, device: str, dtype: torch.dtype) -> dict:
    frames, height, width = grid
    inputs = make_inputs(family, model.config, lengths=Lengths(height=height, width=width, text=text, frames=frames))
    if family == "wan" and model.config.image_dim:
        generator = torch.Generator().manual_seed(2)
        inputs["encoder_hidden_states_image"] = torch.randn(1, IMAGE_TOKENS, model.config.image_dim,
                                                            generator=generator)
    if family == "qwenimage":
        inputs["encoder_hidden_states_mask"] = torch.ones_like(inputs["encoder_hidden_states_mask"])
    return {key: (value.to(device, dtype if value.is_floating_point() else value.dtype)
                  if torch.is_tensor(value) else value) for key, value in inputs.items()}


def sdpa_backends(device: str) -> dict[str, object]:
    from torch.nn.attention import SDPBackend

    if not device.startswith("cuda"):
        return {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def one_rank_group(device: str) -> None:
    import torch.distributed as dist

    from paradiff.distributed.spawn import free_port

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    if device.startswith("cuda"):
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device(device))
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)


def bench_model(name: str, args, device: str, dtype: torch.dtype, clock: Clock, peaks: dict, deadline: float) -> dict:
    reference, family, grid, calls, sglang = MODELS[name]
    config = dict(REFERENCE_CONFIGS[reference][1])
    text = TEXT_TOKENS
    if args.dry_run:  # tiny configs of the same classes: checks every part, measures nothing meaningful
        config = dict(tiny_config(family, heads=2, head_dim=32), _class_name=config["_class_name"])
        if family == "wan":
            config.update(image_dim=16, added_kv_proj_dim=64)
        grid, text = ((2, 4, 6) if family == "wan" else (1, 4, 6)), 8
    shape = model_shape(config, text_tokens=text)
    latent = grid[0] * grid[1] * grid[2]
    flops = forward_cost(shape, latent, 2).flops
    row = {"model": reference, "latent_tokens": latent, "text_tokens": text, "calls_per_step": calls,
           "parameters": shape.params, "forward_flops": flops, "sglang_1xh100_50_steps_s": sglang, "variants": {}}
    started = time.monotonic()
    model = build(family, config, device, dtype)
    row["build_s"] = round(time.monotonic() - started, 1)
    inputs = inputs_for(family, model, grid, text, device, dtype)

    def forward():
        with torch.inference_mode():
            return model(**inputs, return_dict=False)[0]

    # Wan's forward takes seconds on one GPU: fewer repeats keep the three models inside the budget
    repeats, warmup = (max(2, args.repeats // 2), 1) if latent > 16384 and not args.dry_run else \
        (args.repeats, args.warmup)

    def record(variant: str, run, context=contextlib.nullcontext):
        if time.monotonic() > deadline:
            row["variants"][variant] = {"skipped": "time budget spent"}
            return
        try:
            with context():
                times = clock.time(run, repeats=repeats, warmup=warmup)
            seconds = statistics.median(times)
            row["variants"][variant] = {
                "forward_s": seconds, "forward_s_all": times, "step_s": seconds * calls,
                "steps_50_s": 50 * seconds * calls, "mfu_datasheet": flops / seconds / peaks["datasheet"]
                if peaks["datasheet"] else None, "mfu_measured_gemm": flops / seconds / peaks["measured"]}
        except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
            row["variants"][variant] = {"error": f"{type(exc).__name__}: {exc}"[:400],
                                        "trace": traceback.format_exc()[-1500:]}
        print(f"  {name} {variant}: {_short(row['variants'][variant])}", flush=True)

    from torch.nn.attention import sdpa_kernel

    record("diffusers", forward)
    for backend, kind in sdpa_backends(device).items():
        record(f"diffusers sdpa={backend}", forward, lambda kind=kind: sdpa_kernel(kind))
    timed = {variant: value["forward_s"] for variant, value in row["variants"].items() if "forward_s" in value}
    best = min((v for v in timed if v.startswith("diffusers sdpa=")), key=timed.get, default=None)
    row["best_sdpa"] = best.split("=")[1] if best else None
    best_context = (lambda: sdpa_kernel(sdpa_backends(device)[row["best_sdpa"]])) if best else contextlib.nullcontext

    import paradiff
    from paradiff.config import ParallelConfig

    try:
        one_rank_group(device)
        paradiff.enable_parallelism(model, ParallelConfig.from_degrees())
        record("paradiff world 1", forward, best_context)
        paradiff.compile(model, backend=args.compile_backend)
        record("paradiff compile", forward, best_context)
    except Exception as exc:  # noqa: BLE001 - recorded
        row["variants"]["paradiff world 1"] = row["variants"].get("paradiff world 1") or {
            "error": f"{type(exc).__name__}: {exc}"[:400], "trace": traceback.format_exc()[-1500:]}
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    if args.cudagraphs and device.startswith("cuda") and time.monotonic() < deadline:
        model = build(family, config, device, dtype)
        paradiff.enable_parallelism(model, ParallelConfig.from_degrees())
        try:
            paradiff.compile(model, backend="inductor", mode="reduce-overhead")
            record("paradiff compile cudagraphs", forward, best_context)
        except Exception as exc:  # noqa: BLE001 - recorded
            row["variants"]["paradiff compile cudagraphs"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        del model
        gc.collect()
        torch.cuda.empty_cache()
    row["variants"]["paradiff fp8 compile"] = {"skipped": "float8 GEMMs need CUDA (sm_89+)"}
    if device.startswith("cuda") and time.monotonic() < deadline:
        try:
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

            model = build(family, config, device, dtype)
            paradiff.enable_parallelism(model, ParallelConfig.from_degrees())
            blocks = [module for module in model.modules() if isinstance(module, torch.nn.ModuleList)]
            for stack in blocks:  # the block stack's linears; embedders and the final layer stay bf16
                quantize_(stack, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
            paradiff.compile(model, backend=args.compile_backend)
            record("paradiff fp8 compile", forward, best_context)
            del model
        except Exception as exc:  # noqa: BLE001 - recorded: torchao missing or refusing
            row["variants"]["paradiff fp8 compile"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        gc.collect()
        torch.cuda.empty_cache()
    return row


def _short(value: dict) -> str:
    if "forward_s" in value:
        mfu = value["mfu_datasheet"] if value["mfu_datasheet"] is not None else value["mfu_measured_gemm"]
        return f"{value['forward_s'] * 1e3:.1f} ms/forward, {value['steps_50_s']:.2f} s/50 steps, MFU {mfu:.0%}"
    return value.get("error") or value.get("skipped", "")


def table(results: dict) -> str:
    kind = "fp32 (dry run)" if results["dry_run"] else "bf16"
    lines = [f"device: {results['device']}  (GEMM {kind} measured {results['gemm_bf16_flops'] / 1e12:.0f} TFLOP/s, "
             f"datasheet {(results['datasheet_bf16_flops'] or 0) / 1e12:.0f})",
             f"{'model':<16} {'variant':<30} {'ms/fwd':>9} {'s/50 steps':>11} {'MFU':>6} {'SGLang':>7}"]
    for row in results["models"]:
        for variant, value in row["variants"].items():
            if "forward_s" in value:
                mfu = value["mfu_datasheet"] if value["mfu_datasheet"] is not None else value["mfu_measured_gemm"]
                sglang = f"{row['sglang_1xh100_50_steps_s']:.2f}" if row["sglang_1xh100_50_steps_s"] else "-"
                lines.append(f"{row['model']:<16} {variant:<30} {value['forward_s'] * 1e3:>9.1f} "
                             f"{value['steps_50_s']:>11.2f} {mfu:>6.0%} {sglang:>7}")
            else:
                lines.append(f"{row['model']:<16} {variant:<30} {_short(value)[:60]}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--models", default="flux,qwen,wan")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting variants after this")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--cudagraphs", action="store_true", help="also compile with mode=reduce-overhead")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny configs, one repeat, compile with the 'eager' backend: checks the script")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("gpu_bench: no CUDA device; run with --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if args.dry_run:
        args.repeats, args.warmup, args.compile_backend = 1, 1, "eager"
    clock = Clock(device)
    name = torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or platform.machine()})"
    datasheet = next((rate for key, rate in DATASHEET_BF16.items() if key in name), None) if cuda else None
    measured = gemm_rate(device, dtype, 8192 if cuda else 256, clock)
    results = {"device": name, "torch": torch.__version__, "dry_run": args.dry_run,
               "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "gemm_bf16_flops": measured, "datasheet_bf16_flops": datasheet, "models": []}
    try:
        import diffusers

        results["diffusers"] = diffusers.__version__
    except ImportError:
        pass
    peaks = {"datasheet": datasheet, "measured": measured}
    for model in [m for m in args.models.split(",") if m]:
        if model not in MODELS:
            parser.error(f"--models: unknown {model!r}; known: {', '.join(MODELS)}")
        print(f"{model}:", flush=True)
        try:
            results["models"].append(bench_model(model, args, device, dtype, clock, peaks, deadline))
        except Exception as exc:  # noqa: BLE001 - recorded (out of memory, a class refusing the config)
            results["models"].append({"model": MODELS[model][0], "error": f"{type(exc).__name__}: {exc}"[:400],
                                      "variants": {}, "sglang_1xh100_50_steps_s": None})
    results["seconds"] = round(args.budget_s - (deadline - time.monotonic()), 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(ch if ch.isalnum() else "-" for ch in name).strip("-").lower()
    path = out / f"gpu_bench-{'dry-run-' if args.dry_run else ''}{slug}-{results['started'][:16].replace(':', '')}.json"
    path.write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
