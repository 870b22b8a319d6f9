"""The `paradiff` command: `generate` images on the mesh, `bench` a list of configurations.

Outside torchrun, `generate` launches and supervises its own worker processes (the product of the degrees) and ends
every worker when one fails; under torchrun (multi-node included) it uses the given ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("PARADIFF_CACHE", ".cache/paradiff"))
DTYPES = ("float32", "bfloat16", "float16")


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {number}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paradiff", description="Parallel diffusion inference with diffusers models.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate images (PNG) and a JSON run report")
    gen.add_argument("model", nargs="?", default=None,
                     help="pipeline folder or Hub id; omitted: the embedded tiny FLUX.2 pipeline (random weights)")
    gen.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", default=None, help="a text file with one prompt per line")
    gen.add_argument("--negative-prompt", default=None)
    gen.add_argument("--tp", type=_positive, default=1)
    gen.add_argument("--ulysses", type=_positive, default=1)
    gen.add_argument("--ring", type=_positive, default=1)
    gen.add_argument("--cfg", type=_positive, default=1)
    gen.add_argument("--dp", type=_positive, default=1)
    gen.add_argument("--steps", type=_positive, default=4)
    gen.add_argument("--height", type=_positive, default=64)
    gen.add_argument("--width", type=_positive, default=64)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--guidance-scale", type=float, default=None)
    gen.add_argument("--true-cfg-scale", type=float, default=None)
    gen.add_argument("--dtype", choices=DTYPES, default="float32")
    gen.add_argument("--out", default="out", help="output folder (PNG files and report.json)")
    gen.add_argument("--compare", action="store_true",
                     help="also run the single-process pipeline on rank 0 and print the max difference")
    gen.add_argument("--timeout", type=float, default=600.0, help="collective timeout in seconds")
    bench = commands.add_parser("bench", help="time a list of configurations on one model")
    bench.add_argument("model", nargs="?", default=None)
    bench.add_argument("--configs", default="single,tp=2,ulysses=2,ring=2",
                       help="comma-separated list of configs; each is '+'-joined degrees, e.g. tp=2+ulysses=2")
    bench.add_argument("--steps", type=_positive, default=4)
    bench.add_argument("--height", type=_positive, default=64)
    bench.add_argument("--width", type=_positive, default=64)
    bench.add_argument("--out", default="out/bench")
    return parser


def world_size_of(args: argparse.Namespace) -> int:
    return args.tp * args.ulysses * args.ring * args.cfg * args.dp


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            text = Path(args.prompts_file).read_text()
        except OSError as exc:
            raise CliError(f"cannot read --prompts-file {args.prompts_file}: {exc.strerror}") from None
        prompts += [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        prompts = ["a red cube on a blue table"]
    return prompts


def check_args(args: argparse.Namespace) -> None:
    """Everything a user can get wrong, checked before any process starts or any weight is read."""
    if args.model is not None:
        path = Path(args.model)
        if (path.exists() or args.model.startswith((".", "/"))) and not (path / "model_index.json").is_file():
            raise CliError(f"model folder {args.model} does not exist or has no model_index.json")
    read_prompts(args)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".paradiff-write-test-{os.getpid()}"  # one per process: every worker checks too
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise CliError(f"output folder {args.out} is not writable: {exc.strerror}") from None
    if args.height % 16 or args.width % 16:
        raise CliError(f"--height {args.height} and --width {args.width} must be multiples of 16 (VAE x patch size)")
    if args.cfg > 2:
        raise CliError(f"--cfg must be 1 or 2, got {args.cfg}")
    import torch

    world = world_size_of(args)
    if torch.cuda.is_available() and "RANK" not in os.environ and world > torch.cuda.device_count():
        raise CliError(f"{world} processes requested but only {torch.cuda.device_count()} GPU(s) are visible")


def embedded_default(cache: Path = DEFAULT_CACHE) -> Path:
    from .testing.pipelines import save_pipeline

    return save_pipeline("flux2", cache / "tiny-flux2-pipeline")


def launch(argv: list[str], world: int, grace_s: float = 10.0) -> int:
    """Start `world` local workers and supervise them; returns 0, or non-zero if any worker failed.

    When one worker exits non-zero, the others get `grace_s` to notice (their collectives fail as soon as the peer's
    connections close, and they report which rank failed and why), then are terminated (SIGTERM, then SIGKILL), so a
    failure never leaves processes behind or peers waiting in a collective.
    """
    from .testing.dist import free_port

    port = free_port()
    base_env = dict(os.environ, PARADIFF_WORKER="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                    LOCAL_WORLD_SIZE=str(world))
    workers = [
        subprocess.Popen([sys.executable, "-m", "paradiff.cli", *argv],
                         env=dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank)))
        for rank in range(world)
    ]
    failed: tuple[int, int] | None = None
    try:
        while any(worker.poll() is None for worker in workers):
            for rank, worker in enumerate(workers):
                code = worker.poll()
                if code not in (None, 0) and failed is None:
                    failed = (rank, code)
            if failed is not None:
                deadline = time.monotonic() + grace_s
                while time.monotonic() < deadline and any(worker.poll() is None for worker in workers):
                    time.sleep(0.05)
                break
            time.sleep(0.05)
    finally:
        _stop(workers, 5.0)
    failures = [(rank, w.returncode) for rank, w in enumerate(workers) if w.returncode]
    if failed is not None or failures:
        first = failed or failures[0]
        others = ", ".join(f"rank {rank}: {code}" for rank, code in failures if rank != first[0])
        _say(f"paradiff: rank {first[0]} exited with code {first[1]} first; stopped the run"
             + (f" (exit codes of the others: {others})." if others else "."))
        return 1
    return 0


def _stop(workers: list[subprocess.Popen], grace_s: float) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.terminate()
    deadline = time.monotonic() + grace_s
    for worker in workers:
        try:
            worker.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def _peak_memory_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import paradiff
    from .mesh import default_device

    if os.environ.get("PARADIFF_WORKER") or "RANK" in os.environ:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        _generate(args, device, np, torch, dist, paradiff)
    finally:
        dist.destroy_process_group()


def _parallel_config(args: argparse.Namespace):
    import paradiff

    tp = paradiff.TensorParallelConfig(args.tp) if args.tp > 1 else None
    cp = (paradiff.ContextParallelConfig(ring_degree=args.ring, ulysses_degree=args.ulysses)
          if args.ring * args.ulysses > 1 else None)
    return paradiff.ParallelConfig(tensor_parallel_config=tp, context_parallel_config=cp, cfg_degree=args.cfg,
                                   data_degree=args.dp)


def _call_kwargs(args: argparse.Namespace, pipeline) -> dict:
    kwargs = dict(height=args.height, width=args.width, num_inference_steps=args.steps, output_type="np")
    if args.guidance_scale is not None:
        kwargs["guidance_scale"] = args.guidance_scale
    if args.true_cfg_scale is not None:
        kwargs["true_cfg_scale"] = args.true_cfg_scale
    if args.negative_prompt is not None:
        kwargs["negative_prompt"] = args.negative_prompt
    if args.model is None:
        from .testing.pipelines import default_call_kwargs

        defaults = default_call_kwargs("flux2")
        for key in ("max_sequence_length", "text_encoder_out_layers"):
            if key in defaults:
                kwargs[key] = defaults[key]
    return kwargs


def _generate(args, device, np, torch, dist, paradiff) -> None:
    from PIL import Image

    from .comm import all_gather_object, barrier

    rank = dist.get_rank()
    if rank != 0 or not sys.stderr.isatty():
        _quiet_libraries()
    model = args.model
    if model is None:
        if rank == 0:
            embedded_default()
        barrier()
        model = str(embedded_default())
    config = _parallel_config(args)
    dtype = getattr(torch, args.dtype)
    start = time.perf_counter()
    pipeline = paradiff.load_pipeline(model, parallel_config=config, torch_dtype=dtype, device=device)
    load_s = time.perf_counter() - start
    pipeline.set_progress_bar_config(disable=rank != 0 or not sys.stderr.isatty())
    _maybe_inject_fault(pipeline.transformer, rank)
    prompts = read_prompts(args)
    indexed = list(enumerate(prompts))
    step_times: list[float] = []
    images: dict[int, str] = {}
    out = Path(args.out)
    kwargs = _call_kwargs(args, pipeline)
    first_image = None
    with paradiff.split_between_processes(indexed, pipeline) as share:
        for index, prompt in share:
            stamps = [time.perf_counter()]

            def on_step(_pipe, _step, _timestep, callback_kwargs):
                stamps.append(time.perf_counter())
                return callback_kwargs

            result = pipeline(prompt=prompt, seed=args.seed + index, callback_on_step_end=on_step, **kwargs)
            step_times += [b - a for a, b in zip(stamps, stamps[1:])]
            array = np.asarray(result.images[0])
            if first_image is None:
                first_image = (index, prompt, array)
            if pipeline.is_output_rank:
                path = out / f"{index:04d}.png"
                Image.fromarray((np.clip(array, 0, 1) * 255).round().astype("uint8")).save(path)
                images[index] = str(path)
    compare = None
    if args.compare and rank == 0 and first_image is not None:
        compare = _compare_single_process(model, dtype, kwargs, args.seed, first_image, np, torch)
    stats = {
        "rank": rank,
        "load_s": load_s,
        "step_s_median": float(np.median(step_times)) if step_times else None,
        "peak_memory_bytes": _peak_memory_bytes(device),
        "images": images,
    }
    gathered = all_gather_object(stats)
    if rank == 0:
        report = {
            "model": model,
            "config": {"tp": args.tp, "ulysses": args.ulysses, "ring": args.ring, "cfg": args.cfg, "dp": args.dp,
                       "world_size": dist.get_world_size(), "backend": dist.get_backend(), "device": device.type},
            "resolution": [args.height, args.width],
            "steps": args.steps,
            "dtype": args.dtype,
            "seed": args.seed,
            "prompts": prompts,
            "ranks": gathered,
            "images": {k: v for s in gathered for k, v in s["images"].items()},
        }
        if compare is not None:
            report["max_abs_diff_vs_single_process"] = compare
        (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
        steps = [s["step_s_median"] for s in gathered if s["step_s_median"] is not None]
        print(f"paradiff: {len(report['images'])} image(s) in {out}; load {load_s:.2f} s; "
              f"median step {np.median(steps):.3f} s; world {dist.get_world_size()} "
              f"(tp={args.tp} ulysses={args.ulysses} ring={args.ring} cfg={args.cfg} dp={args.dp})")
        if compare is not None:
            print(f"paradiff: max |difference| to the single-process image: {compare:.2e}")


def _maybe_inject_fault(transformer, rank: int) -> None:
    import torch

    """Chaos hook for reliability tests and the fault benchmark; never set in normal runs.

    PARADIFF_INJECT_FAULT="RANK:raise|exit" makes that rank fail in its second forward (in the first block); "RANK:seed" makes it
    start from other latents. PARADIFF_FAULT_STAMP=FILE records the moment of the fault (time.time()).
    """
    spec = os.environ.get("PARADIFF_INJECT_FAULT")
    if not spec:
        return
    target, _, kind = spec.partition(":")
    if int(target) != rank:
        return
    calls = []

    def stamp() -> None:
        if os.environ.get("PARADIFF_FAULT_STAMP"):
            Path(os.environ["PARADIFF_FAULT_STAMP"]).write_text(repr(time.time()))

    def inject(_module, args, kwargs):
        calls.append(1)
        if kind == "seed" and len(calls) == 1:
            stamp()
            kwargs["hidden_states"] = kwargs["hidden_states"] + 1.0
            return args, kwargs
        return None

    def inject_in_block(_module, _args):
        # inside the forward (first transformer block), where a real fault would happen
        block_calls.append(1)
        if len(block_calls) == 2:
            stamp()
            if kind == "exit":
                os._exit(9)
            raise RuntimeError(f"injected fault on rank {rank}")

    block_calls: list[int] = []
    transformer.register_forward_pre_hook(inject, with_kwargs=True, prepend=True)
    if kind in ("raise", "exit"):
        blocks = next(m for m in transformer.modules() if isinstance(m, torch.nn.ModuleList))
        blocks[0].register_forward_pre_hook(inject_in_block)


def _quiet_libraries() -> None:
    """Only rank 0 on a terminal shows progress; the libraries' own loading bars would repeat once per rank."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.set_verbosity_error()


def _compare_single_process(model, dtype, kwargs, seed, first_image, np, torch) -> float:
    from diffusers import DiffusionPipeline

    index, prompt, array = first_image
    reference = DiffusionPipeline.from_pretrained(model, dtype=dtype)
    reference.set_progress_bar_config(disable=True)
    expected = reference(prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed + index), **kwargs).images[0]
    return float(np.abs(np.asarray(expected) - array).max())


def bench(args: argparse.Namespace) -> int:
    rows = []
    for spec in args.configs.split(","):
        degrees = {"tp": 1, "ulysses": 1, "ring": 1, "cfg": 1, "dp": 1}
        if spec.strip() != "single":
            for part in spec.split("+"):
                key, _, value = part.partition("=")
                if key.strip() not in degrees or not value.strip().isdigit():
                    raise CliError(f"bad config {spec!r}: use '+'-joined key=value with keys {sorted(degrees)}")
                degrees[key.strip()] = int(value)
        out = Path(args.out) / spec.replace("=", "").replace("+", "_")
        argv = ["generate"] + ([args.model] if args.model else []) + [
            "--steps", str(args.steps), "--height", str(args.height), "--width", str(args.width), "--out", str(out)]
        for key, value in degrees.items():
            argv += [f"--{key}", str(value)]
        code = main(argv)
        if code:
            rows.append((spec, "failed", "failed", "failed"))
            continue
        report = json.loads((out / "report.json").read_text())
        step = max(s["step_s_median"] for s in report["ranks"])
        peak = max(s["peak_memory_bytes"] for s in report["ranks"]) / 2**30
        rows.append((spec, f"{step * args.steps * 1000:.1f}", f"{1 / step:.2f}", f"{peak:.2f}"))
    print(f"| mode | time / image, denoising (ms) | steps / s | peak memory / rank (GiB) | resolution |")
    print("|---|---|---|---|---|")
    for spec, ms, sps, peak in rows:
        print(f"| {spec} | {ms} | {sps} | {peak} | {args.height}x{args.width} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "bench":
            return bench(args)
        check_args(args)
        under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        if under_launcher:
            import torch.distributed as dist  # noqa: F401

            if int(os.environ["WORLD_SIZE"]) != world_size_of(args):
                raise CliError(
                    f"the degrees multiply to {world_size_of(args)} but torchrun started {os.environ['WORLD_SIZE']} "
                    "processes; they must match"
                )
            code = 0
            try:
                worker(args)
            except Exception as exc:  # noqa: BLE001 - one line per failing rank; PARADIFF_DEBUG=1 for tracebacks
                if os.environ.get("PARADIFF_DEBUG"):
                    raise
                first_line = str(exc).splitlines()[0] if str(exc) else ""
                _say(f"paradiff: rank {os.environ.get('RANK')} failed: {type(exc).__name__}: {first_line}")
                code = 1
            # Skip interpreter finalisation: gloo's background threads may still release Python objects of the last
            # collectives, and doing that while the interpreter shuts down aborts the process (seen in ~5% of runs).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        if args.model is None:
            embedded_default()  # build the tiny pipeline once, before the workers start
        return launch(argv, world_size_of(args))
    except CliError as exc:
        _say(f"paradiff: error: {exc}")
        return 2


def _say(line: str) -> None:
    """One write per line, so lines of concurrent ranks never interleave mid-line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def entry_point() -> None:
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
