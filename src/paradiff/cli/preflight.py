"""What a model folder's configs already decide, checked by the launcher before any worker starts: a folder that
is not there, a pipeline asked for CFG parallelism that never guides (or is not classified yet, or is called without
guidance), a TP degree the transformer's heads cannot
take. Reads configs and checkpoint headers, no weight; every worker would otherwise start, build its process group
and then fail the same way on each rank."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from paradiff.cli.args import CliError


def check_model_folder(args: argparse.Namespace) -> None:
    if args.model is None:
        return
    path = Path(args.model)
    if not path.exists():
        if _looks_like_hub_id(args.model):
            return  # fetched by the workers; nothing local to read yet
        raise CliError(f"model folder {args.model} does not exist (and is not a Hub id of the form 'owner/name')")
    index = json.loads((path / "model_index.json").read_text())
    pipeline_name = getattr(args, "pipeline", None) or str(index.get("_class_name"))
    if args.cfg > 1:
        from paradiff.plans.pipelines import cfg_refusal

        refusal = cfg_refusal(pipeline_name)
        if refusal is not None:
            raise CliError(f"--cfg {args.cfg}: {args.model}: {refusal}. Use --cfg 1")
        _check_call_guides(args, pipeline_name, index)
    if args.tp > 1 or getattr(args, "gguf", None):
        _check_transformers_split(args, path, index)


def _check_call_guides(args: argparse.Namespace, pipeline_name: str, index: dict) -> None:
    """--cfg 2 splits the guidance branches: the call the options make must run them (the pipeline's CfgRule)."""
    from types import SimpleNamespace

    from paradiff.plans.pipelines import CFG_RULES

    rule = CFG_RULES[pipeline_name]
    options = {"guidance_scale": args.guidance_scale, "true_cfg_scale": args.true_cfg_scale,
               "negative_prompt": args.negative_prompt}
    call = {name: value for name, value in options.items() if value is not None}
    config = SimpleNamespace(**{key: value for key, value in index.items() if not key.startswith("_")})
    if not rule.runs_cfg(call, config):
        scale = "--" + rule.scale_argument.replace("_", "-")
        need = f"{scale} above 1" + (" and --negative-prompt" if rule.needs_negative_prompt else "")
        if rule.disabled_by_config and getattr(config, rule.disabled_by_config, False):
            need = f"a checkpoint without {rule.disabled_by_config}"
        raise CliError(f"--cfg {args.cfg}: {pipeline_name} runs no classifier-free guidance with these options "
                       f"(it needs {need}; {rule.scale_argument} defaults to {rule.default_scale:g}). Use --cfg 1")


def _looks_like_hub_id(name: str) -> bool:
    owner, slash, repo = name.partition("/")
    return bool(slash and owner and repo and "/" not in repo and not name.startswith((".", "/", "~")))


def _check_transformers_split(args: argparse.Namespace, folder: Path, index: dict) -> None:
    """Resolve each transformer's TP plan for the first TP rank on the meta device, as every worker will; a
    transformer read from a --gguf file is checked against the file (its types, names and blocks)."""
    import torch

    from paradiff.api.model import prepare_model
    from paradiff.cli.args import gguf_files
    from paradiff.cli.worker import _plan_argument
    from paradiff.errors import ParadiffError

    plan = _plan_argument(args.plan, "tensor")
    files = gguf_files(args)
    names = [name for name, entry in sorted(index.items()) if name.startswith("transformer")
             and isinstance(entry, list) and len(entry) == 2 and all(isinstance(part, str) for part in entry)]
    unknown = sorted(set(files) - set(names))
    if unknown:
        raise CliError(f"--gguf {unknown[0]}=...: {args.model} has no such transformer; its transformers are {names}")
    for name in names:
        entry = index[name]
        model_cls = getattr(importlib.import_module(entry[0]), entry[1])
        tp_shard = (0, args.tp) if args.tp > 1 else None
        try:
            if name in files:
                from diffusers import GGUFQuantizationConfig

                from paradiff.api.single_file import prepare_gguf_model
                from paradiff.quant.schemes import gguf_scheme

                scheme = gguf_scheme(GGUFQuantizationConfig(compute_dtype=getattr(torch, args.dtype)))
                prepared = prepare_gguf_model(model_cls, Path(files[name]), config=str(folder), subfolder=name,
                                              hub_kwargs={}, dtype=getattr(torch, args.dtype),
                                              device=torch.device("cpu"), tp_shard=tp_shard, plan=plan, context=False,
                                              cp_plan=None, scheme=scheme)
            elif tp_shard is None:
                continue
            else:
                prepared = prepare_model(model_cls, folder / name, dtype=torch.float32, device=torch.device("cpu"),
                                         tp_shard=tp_shard, plan=plan)
        except ParadiffError as exc:
            flag = f"--gguf {files[name]}" if name in files else f"--tp {args.tp}"
            where = f" at --tp {args.tp}" if name in files and args.tp > 1 else ""
            raise CliError(f"{flag}{where}: {name} ({entry[1]}): {str(exc).splitlines()[0]}") from None
        prepared.checkpoint.close()
