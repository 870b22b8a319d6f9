"""`paradiff generate --dry-run`: the per-rank memory of the requested mesh, from the transformers' configs alone
(plan_tools/memory.py), and the flag to add when `--device-memory GB` would not hold it. Reads no weight, starts no
process."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from paradiff.cli.args import CliError


def dry_run(args: argparse.Namespace) -> int:
    from paradiff.cli.embedded import embedded_default
    from paradiff.cli.worker import parallel_config
    from paradiff.io.folders import resolve_folder
    from paradiff.plan_tools.memory import GIB, fsdp_to_fit, image_tokens_of, per_rank_bytes, size

    folder = embedded_default() if args.model is None else resolve_folder(args.model, pipeline=True)
    transformers = _transformers(folder)
    if not transformers:
        raise CliError(f"{folder}: model_index.json names no transformer; --dry-run estimates the transformers")
    parallel = parallel_config(args)
    dtype = getattr(torch, args.dtype)
    bytes_per = 1.0 if getattr(args, "quantize", None) in ("int8", "fp8") else None
    print(f"paradiff dry run: {args.model or 'embedded pipeline'}, {args.height}x{args.width}"
          f"{f' x {args.frames} frames' if args.frames else ''}, {args.dtype}"
          f"{f', {args.quantize} weights' if getattr(args, 'quantize', None) else ''}; per rank of "
          f"{parallel.world_size} (fsdp={parallel.fsdp_degree} tp={parallel.tp_degree} ulysses={args.ulysses} "
          f"ring={args.ring} cfg={args.cfg} dp={args.dp}):")
    peak, worst, models = 0, None, []
    for name, model in transformers.items():
        kwargs = dict(dtype=dtype, tp_plan=_tp_plan(model, parallel, args.plan), weight_bytes_per_element=bytes_per,
                      image_tokens=image_tokens_of(model.config, args.height, args.width, args.frames),
                      text_tokens=512)
        memory = per_rank_bytes(model, parallel, **kwargs)
        models.append((name, model, kwargs, memory))
        print(f"  {name} ({type(model).__name__}):")
        for line in memory.lines():
            print(f"    {line}")
    # every transformer's shards stay resident; one runs at a time
    held = sum(memory.weights for *_, memory in models)
    running = max(memory.gathered + memory.activations for *_, memory in models)
    peak = held + running
    print(f"  per-rank peak: {size(peak).strip()} (all transformers' weights held, the largest running)")
    budget = getattr(args, "device_memory", None)
    if budget is not None:
        budget_bytes = int(budget * GIB)
        if peak <= budget_bytes:
            print(f"  fits --device-memory {budget:g} GB")
        else:
            name, model, kwargs, _memory = max(models, key=lambda item: item[3].peak)
            share = budget_bytes * per_rank_bytes(model, parallel, **kwargs).peak // max(1, peak)
            degree = fsdp_to_fit(model, parallel, share, **kwargs)
            if degree is not None and degree != parallel.fsdp_degree:
                advice = f"add --fsdp {degree}"
            elif parallel.fsdp_degree > 1 and not parallel.fsdp_offload:
                advice = "add --fsdp-offload (each rank's shards in CPU memory, a block gathered at a time)"
            elif getattr(args, "quantize", None) is None and parallel.fsdp_degree == 1:
                advice = "add --quantize int8 (or more --tp / --fsdp ranks)"
            else:
                advice = "add more ranks (--ulysses / --ring split the activations, --tp the weights too)"
            print(f"  does not fit --device-memory {budget:g} GB: {advice}")
    return 0


def _transformers(folder: Path) -> dict:
    from paradiff.api.pipeline_components import library_module
    from paradiff.plans import model_config
    from paradiff.plan_tools.memory import meta_model

    index = json.loads((folder / "model_index.json").read_text())
    found = {}
    for name, entry in index.items():
        if name.startswith("transformer") and isinstance(entry, list) and entry[0] is not None:
            cls = getattr(library_module(entry[0]), entry[1])
            config = model_config(cls, cls.load_config(folder / name))
            found[name] = meta_model(cls, config)
    return found


def _tp_plan(model, parallel, plan):
    if parallel.tp_degree == 1:
        return None
    from paradiff.plans import plan_for
    from paradiff.tensor_parallel.plan import as_plan, resolve_plan

    return resolve_plan(model, as_plan(plan_for(model, plan, "tensor")), 0, parallel.tp_degree)
