"""One rank of `paradiff generate`: join the process group, load the pipeline on the mesh, generate, report."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

import paradiff

from paradiff.distributed.comm import all_gather_object, all_true
from paradiff.distributed.store import open_store
from paradiff.distributed.mesh import default_device
from paradiff.api.load_spec import Loaded, LoadSpec, LoraSpec, load  # noqa: F401 - Loaded: public here
from paradiff.api.load_spec import quantization_config as spec_quantization_config
from paradiff.api.pipeline_call import accepted_kwargs, call_parameters, is_modular_pipeline
from paradiff.api.pipeline_call import call_kwargs as pipeline_call_kwargs
from paradiff.vae import get_vae_runtime
from paradiff.cli.args import gguf_files, lora_specs, prompt_adapters, quantize_skip, read_prompts
from paradiff.cli.common import flag_error
from paradiff.cli.conditioning import conditioning_kwargs, requested_pipeline_class
from paradiff.cli.compare import compare_single_process, picture_rows, write_compare_png
from paradiff.cli.embedded import embedded_call_kwargs, embedded_default
from paradiff.io.outputs import Output, outputs_of, sampling_rate, save_output
from paradiff.cli.pipeline_options import load_adapters, set_guider  # noqa: F401 - public here
from paradiff.cli.report import write_report
from paradiff.errors import LoadSpecError, ParallelConfigError
from paradiff.runtime.console import console_is_terminal, quiet_other_ranks
from paradiff.runtime.memory import peak_memory_bytes
from paradiff.runtime.progress import StepClock, StepEvent, step_progress

# Called with (pipeline, rank) once the pipeline is loaded, before the first generation.
PipelineHook = Callable[[Any, int], None]


def run_worker(args: argparse.Namespace, on_pipeline_loaded: PipelineHook | None = None) -> None:
    if os.environ.get("PARADIFF_WORKER") or "RANK" in os.environ:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # the store as env:// would open it, but on 127.0.0.1 only under the local launcher (distributed/store.py)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, store=open_store(rank, world, args.timeout), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        if not os.environ.get("PARADIFF_WORKER"):  # started by torchrun: no launcher fetched a Hub id before
            fetch_hub_model_once(args, device)
        generate(args, device, on_pipeline_loaded)
    finally:
        dist.destroy_process_group()


def fetch_hub_model_once(args: argparse.Namespace, device: torch.device) -> None:
    """A Hub id under torchrun: each node's local rank 0 fetches the repository while the other ranks wait, then
    they all read the node's cached copy; a fetch that fails is said by that rank, in one line naming the repository
    and how to get it, and every rank stops before loading."""
    from paradiff.cli import preflight
    from paradiff.cli.args import CliError

    if args.model is None or Path(args.model).exists() or not preflight.looks_like_hub_id(args.model):
        return
    error = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            preflight.fetch_hub_pipeline(args.model)
        except CliError as exc:
            error = exc
    if not all_true(error is None, None, device):
        raise error or CliError(f"{args.model}: not fetched; the first rank of a node could not fetch it (its line "
                                "says why)")


def parallel_config(args: argparse.Namespace) -> paradiff.ParallelConfig:
    return paradiff.ParallelConfig.from_degrees(tp=args.tp, ulysses=args.ulysses, ring=args.ring, cfg=args.cfg,
                                                data=args.dp, fsdp=getattr(args, "fsdp", 1),
                                                fsdp_offload=getattr(args, "fsdp_offload", False))


def call_kwargs(args: argparse.Namespace) -> dict:
    """The pipeline call's arguments of `generate`'s flags (api/pipeline_call.py: call_kwargs), with the
    conditioning inputs read from their files."""
    kwargs = pipeline_call_kwargs(args.height, args.width, args.steps, args.guidance_scale, args.true_cfg_scale,
                                  args.negative_prompt, args.frames,
                                  embedded_call_kwargs() if args.model is None else None)
    kwargs.update(conditioning_kwargs(args))
    return kwargs


# the guidance options a Modular Diffusers pipeline takes as its guider's settings, not as call arguments
GUIDER_OPTIONS = {"guidance_scale": "--guidance-scale", "true_cfg_scale": "--true-cfg-scale"}


def guider_settings(kwargs: dict, pipeline: Any) -> dict:
    """The guidance options of `kwargs` that a modular pipeline's guider takes (its call does not): popped from
    `kwargs`, returned as the guider's settings. A modular pipeline without a guider refuses them."""
    if not is_modular_pipeline(pipeline):
        return {}
    inputs = set(pipeline._blocks.input_names)
    settings = {}
    for key, flag in GUIDER_OPTIONS.items():
        if key in kwargs and key not in inputs:
            if getattr(pipeline, "guider", None) is None:
                raise ParallelConfigError(f"{flag}: {type(pipeline).__name__} has no guider and its call takes no "
                                          f"{key} (guidance-distilled); drop {flag}")
            settings["guidance_scale"] = kwargs.pop(key)
    return settings


def step_callback(pipeline: Any, on_step: Callable) -> dict:
    """`on_step` as the pipeline takes a per-step callback: callback_on_step_end, or the older callback(step,
    timestep, latents) with callback_steps=1 (Stable Audio); none when it takes neither."""
    parameters = call_parameters(pipeline)
    if "callback_on_step_end" in parameters:
        return {"callback_on_step_end": on_step}
    if "callback" in parameters:
        return {"callback": lambda step, timestep, latents: on_step(pipeline, step, timestep, {}),
                "callback_steps": 1}
    return {}


def generate(args: argparse.Namespace, device: torch.device,
             on_pipeline_loaded: PipelineHook | None = None) -> dict | None:
    """`paradiff generate` on this rank, in the initialised default process group; the report on rank 0."""
    rank = dist.get_rank()
    quiet_other_ranks(rank)
    model = model_of(args)
    dtype = getattr(torch, args.dtype)
    quantize = getattr(args, "quantize", None) or ("gguf" if gguf_files(args) else None)
    pipeline_cls = requested_pipeline_class(args)
    loaded = load_from_args(args, device)
    pipeline, loras, transformers, monitors, load_s = (loaded.pipeline, loaded.loras, loaded.transformers,
                                                       loaded.monitors, loaded.load_s)
    pipeline.set_progress_bar_config(disable=True)  # paradiff's bar of steps (below) over every call instead
    rate = sampling_rate(pipeline)
    if on_pipeline_loaded is not None:
        on_pipeline_loaded(pipeline, rank)
    prompts = read_prompts(args)
    indexed = list(enumerate(prompts))
    outputs: dict[int, dict] = {}
    out = Path(args.out)
    kwargs = call_kwargs(args)
    guidance = guider_settings(kwargs, pipeline)  # a modular pipeline's guider takes the guidance scale
    set_guider(pipeline, guidance)
    kwargs = accepted_kwargs(kwargs, pipeline)
    made: list[tuple[int, str, Output]] = []  # rank 0's outputs, for --compare
    made_without_lora: list[tuple[int, str, Output]] = []  # --also-without-lora: the same with the adapters off
    without_lora = bool(getattr(args, "also_without_lora", False))
    computed_steps: dict[int, dict[str, list[int]]] = {}  # prompt index -> cache context -> steps computed
    bar = contextlib.ExitStack()
    column = prompt_adapters(args) if getattr(args, "prompts_file", None) else None  # an adapter per prompt
    with paradiff.split_between_processes(indexed, pipeline) as share:
        # staged: the replica's prompts form one batch (each with its own seed), so each stage loads once; with an
        # adapter column, batches of --batch prompts, each prompt with its own adapter (or none)
        share = list(share)
        batches = [share] if args.stages and share else [[item] for item in share]
        if column is not None:
            batches = [share[start:start + args.batch] for start in range(0, len(share), args.batch)]
        calls = len(batches) * (2 if without_lora else 1)
        advance = bar.enter_context(step_progress(calls * args.steps if args.steps else None, "paradiff: denoising",
                                                  console_is_terminal()))
        # every step's event (runtime/progress.py, as the server's replicas make them): the bar reads it, and its
        # times are report.json's per-step times
        clock = StepClock()
        listeners = [lambda event: advance(1)]
        for batch in batches:
            clock.begin()

            def on_step(pipe, step, _timestep, callback_kwargs):
                event = StepEvent(step + 1, int(getattr(pipe, "num_timesteps", 0) or args.steps or 0), clock.tick(),
                                  callback_kwargs.get("latents"))
                for listener in listeners:
                    listener(event)
                return callback_kwargs

            if column is not None:
                from paradiff.api.lora_slots import set_sample_adapters

                set_sample_adapters(pipeline.transformer, [column[index] for index, _ in batch])
            if args.stages or column is not None:
                generators = [torch.Generator("cpu").manual_seed(args.seed + index) for index, _ in batch]
                result = pipeline(prompt=[prompt for _, prompt in batch], generator=generators,
                                  **step_callback(pipeline, on_step), **kwargs)
            else:
                (index, prompt), = batch
                if without_lora:  # the same prompt and seed first with the adapters off, on the same pipeline
                    pipeline.disable_lora()
                    plain = pipeline(prompt=prompt, seed=args.seed + index, **step_callback(pipeline, on_step),
                                     **kwargs)
                    pipeline.enable_lora()
                    clock.begin()
                    (plain_output,) = outputs_of(plain)
                    if args.compare and rank == 0:
                        made_without_lora.append((index, prompt, plain_output))
                result = pipeline(prompt=prompt, seed=args.seed + index, **step_callback(pipeline, on_step), **kwargs)
            for name, monitor in monitors.items():
                for context in sorted({decision.context for decision in monitor.decisions}):
                    key = context if name == "transformer" else f"{name}:{context}"
                    for index, _ in batch:
                        computed_steps.setdefault(index, {})[key] = monitor.computed_steps(context)
                monitor.clear()
            for (index, prompt), output in zip(batch, outputs_of(result)):
                if args.compare and rank == 0:
                    made.append((index, prompt, output))
                if pipeline.is_output_rank:
                    outputs[index] = {"prompt": prompt, **save_output(output, out, index, args.fps, rate)}
                    if column is not None:
                        outputs[index]["adapter"] = column[index]
                    if without_lora:
                        outputs[index]["without_lora"] = save_output(plain_output, out, index, args.fps, rate,
                                                                     suffix="-without-lora")
    bar.close()
    step_times = clock.times
    stats = {
        "rank": rank,
        "pid": os.getpid(),
        "load_s": load_s,
        "step_s_median": float(np.median(step_times)) if step_times else None,
        "step_s": [round(seconds, 6) for seconds in step_times],  # every denoising step's wall time, in order
        "peak_memory_bytes": peak_memory_bytes(device),
        "outputs": outputs,
        "stages": pipeline.stage_report(),
        "cache_computed_steps": computed_steps,
        # per component (transformers, text encoders, VAE), as held while its stage ran: scheme, quantized and
        # full-precision bytes
        "quantization": pipeline.quantization_report(),
    }
    gathered = all_gather_object(stats)
    if rank == 0:
        # after the last collective: the other ranks are done while rank 0 runs the references
        compare = None
        if made:
            compare, references = compare_single_process(model, dtype, kwargs, args.seed, made,
                                                         gguf=gguf_files(args),
                                                         quantization=quantization_config(args)
                                                         if getattr(args, "quantize", None) else None,
                                                         cache=args.cache, loras=loras,
                                                         lora_weight_name=args.lora_weight_name,
                                                         pipeline_cls=pipeline_cls, guider=guidance,
                                                         without_lora=made_without_lora if without_lora else None)
            # --also-without-lora: the adapters off in the left column, on in the right
            ordered = made_without_lora + made if without_lora else made
            references = references[len(made):] + references[:len(made)] if without_lora else references
            pairs, captions = picture_rows(references, ordered)
            if pairs:  # images, or a video's first, middle and last frames; none for sounds
                compare["picture"] = str(out / "compare.png")
                write_compare_png(out / "compare.png", pairs, captions=captions,
                                  column_titles=("without LoRA", "with LoRA") if without_lora else None)
        run = {"world_size": dist.get_world_size(), "backend": dist.get_backend(), "device": device.type,
               "parallel_vae": get_vae_runtime(pipeline.vae) is not None if hasattr(pipeline, "vae") else False}
        return write_report(args, out, model, prompts, run, gathered, compare)
    return None


def model_of(args: argparse.Namespace) -> str:
    return args.model if args.model is not None else str(embedded_default())


def load_spec_of(args: argparse.Namespace) -> LoadSpec:
    """The flags of `generate` / `serve` as the typed LoadSpec the ranks load (the one place a parser's namespace
    becomes one); a value the spec refuses is a CliError naming its flag."""
    try:
        return LoadSpec(
            model=model_of(args), dtype=args.dtype, parallel=parallel_config(args),
            pipeline=getattr(args, "pipeline", None), plan=args.plan, cp_plan=args.cp_plan,
            parallel_vae=not args.no_parallel_vae, stages=args.stages, shard_text_encoders=not args.whole_text_encoders,
            quantize=getattr(args, "quantize", None), quantize_skip=quantize_skip(args),
            quantize_text_encoders=bool(getattr(args, "quantize_text_encoders", False)),
            gguf=tuple(gguf_files(args).items()),
            loras=tuple(LoraSpec(lora["path"], lora["scale"], lora["adapter_name"]) for lora in lora_specs(args)),
            lora_weight_name=args.lora_weight_name,
            adapter_slots=bool(getattr(args, "prompts_file", None)) and prompt_adapters(args) is not None,
            compile=args.compile, compile_backend=args.compile_backend, cache=args.cache,
            attention_backend=getattr(args, "attention_backend", None))
    except LoadSpecError as exc:
        raise flag_error(exc) from None


def load_from_args(args: argparse.Namespace, device: torch.device) -> Loaded:
    """The pipeline of `generate` / `serve` on the mesh, as the flags ask (api/load_spec.py: load)."""
    return load(load_spec_of(args), device)


def quantization_config(args: argparse.Namespace) -> Any:
    """--quantize (with --quantize-skip, --quantize-text-encoders) as diffusers' PipelineQuantizationConfig: what
    the workers load with, and what --compare's single-process reference loads with."""
    return spec_quantization_config(load_spec_of(args))
