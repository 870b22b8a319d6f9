"""What a model folder's configs already decide, checked by the launcher before any worker starts: a folder that
is not there, a pipeline asked for CFG parallelism that never guides (or is not classified yet, or is called without
guidance), context parallelism on a pipeline whose call replaces the attention it splits, a TP degree the transformer's heads cannot
take. Reads configs and checkpoint headers, no weight; every worker would otherwise start, build its process group
and then fail the same way on each rank."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from paradiff.cli.args import CliError


def check_model_folder(args: argparse.Namespace) -> None:
    if args.model is None:  # the embedded demo pipeline: only whether it takes --cfg
        if args.cfg > 1:
            from paradiff.cli.conditioning import pipeline_class_name
            from paradiff.plans.pipelines import cfg_refusal

            refusal = cfg_refusal(str(pipeline_class_name(args)))
            if refusal is not None:
                raise CliError(f"--cfg {args.cfg}: the embedded demo pipeline: {refusal}. Use --cfg 1")
        return
    path = Path(args.model)
    if not path.exists():
        if _looks_like_hub_id(args.model):
            return  # fetched by the workers; nothing local to read yet
        raise CliError(f"model folder {args.model} does not exist (and is not a Hub id of the form 'owner/name')")
    from paradiff.cli.conditioning import folder_index

    index = folder_index(args)
    pipeline_name = getattr(args, "pipeline", None) or str(index.class_name)
    if index.modular:
        _check_modular_flags(args, pipeline_name, path)
    if args.tp * args.ulysses * args.ring * args.cfg > 1:
        from paradiff.plans.pipelines import not_dit_refusal

        if not_dit_refusal(pipeline_name) is not None:
            raise CliError(f"{args.model}: {not_dit_refusal(pipeline_name)}")
    if args.cfg > 1 and index.modular:
        _check_modular_guides(args, pipeline_name, path)
    elif args.cfg > 1:
        from paradiff.plans.pipelines import CFG_RULES, cfg_refusal

        refusal = cfg_refusal(pipeline_name)
        if refusal is not None:
            raise CliError(f"--cfg {args.cfg}: {args.model}: {refusal}. Use --cfg 1")
        if pipeline_name in CFG_RULES:  # else guidance through a guider component: checked at the call
            branches = CFG_RULES[pipeline_name].branches
            if args.cfg != branches:
                raise CliError(f"--cfg {args.cfg}: {pipeline_name} runs {branches} guidance branches per step, one "
                               f"per cfg rank. Use --cfg {branches} or --cfg 1")
            _check_call_guides(args, pipeline_name, index.entries())
    if args.ulysses * args.ring > 1:
        from paradiff.plans.pipelines import cp_refusal

        refusal = cp_refusal(pipeline_name)
        if refusal is not None:
            raise CliError(f"--ulysses / --ring: {args.model}: {refusal}")
    if args.tp > 1 or getattr(args, "gguf", None):
        _check_transformers_split(args, index)


def _check_modular_flags(args: argparse.Namespace, pipeline_name: str, folder: Path) -> None:
    """A Modular Diffusers pipeline takes its blocks' inputs: a flag they do not take (and, for the guidance scale,
    no guider takes either) is refused by name, as the workers would."""
    from paradiff.cli.conditioning import modular_blocks, pipeline_class

    blocks = modular_blocks(pipeline_class(pipeline_name), folder)
    if blocks is None:
        return
    inputs = set(blocks.input_names)
    has_guider = any(spec.name.startswith("guider") for spec in blocks.expected_components)
    for flag, key, value in (("--negative-prompt", "negative_prompt", args.negative_prompt),
                             ("--guidance-scale", "guidance_scale", args.guidance_scale),
                             ("--true-cfg-scale", "true_cfg_scale", args.true_cfg_scale)):
        guider_takes = key != "negative_prompt" and has_guider
        if value is not None and key not in inputs and not guider_takes:
            raise CliError(f"{flag}: {pipeline_name} (a modular pipeline) takes no {key}"
                           f"{' and has no guider' if key != 'negative_prompt' else ''}; its blocks take "
                           f"{', '.join(sorted(inputs))}")


def _check_modular_guides(args: argparse.Namespace, pipeline_name: str, folder: Path) -> None:
    """--cfg N on a Modular Diffusers pipeline splits its guider's branches: it must have a guider, guide the way CFG
    parallelism follows, and (for the default guider its blocks create) run at least N branches per step."""
    from paradiff.cli.conditioning import modular_blocks, pipeline_class
    from paradiff.plans.pipelines import modular_cfg_refusal

    blocks = modular_blocks(pipeline_class(pipeline_name), folder)
    if blocks is None:
        return  # custom blocks: the workers check the guider at the call
    specs = {spec.name: spec for spec in blocks.expected_components if spec.name.startswith("guider")}
    refusal = modular_cfg_refusal(pipeline_name, bool(specs))
    if refusal is not None:
        raise CliError(f"--cfg {args.cfg}: {args.model}: {refusal}. Use --cfg 1")
    index = json.loads((folder / "modular_model_index.json").read_text()) \
        if (folder / "modular_model_index.json").is_file() else {}
    for name, spec in specs.items():
        if name in index or spec.default_creation_method != "from_config":
            continue  # a guider saved with the pipeline: the workers check it at the call
        from paradiff.runtime.cfg import guider_branch_count

        guider = spec.create()
        if args.guidance_scale is not None and "guidance_scale" in guider.config:
            guider = guider.new(guidance_scale=args.guidance_scale)
        count = guider_branch_count(guider)
        if count is not None and count < args.cfg:
            what = "no guidance (one branch)" if count == 1 else f"{count} guidance branches"
            raise CliError(f"--cfg {args.cfg}: {pipeline_name}'s {name} ({type(guider).__name__}, guidance_scale "
                           f"{guider.config.get('guidance_scale')}) runs {what} per step; each cfg rank computes one. "
                           f"Use --cfg {count if count > 1 else 1}")


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


def _check_transformers_split(args: argparse.Namespace, index) -> None:
    """Resolve each transformer's TP plan for the first TP rank on the meta device, as every worker will; a
    transformer read from a --gguf file is checked against the file (its types, names and blocks)."""
    import torch

    from paradiff.api.model import prepare_model
    from paradiff.cli.args import gguf_files
    from paradiff.cli.worker import _plan_argument
    from paradiff.errors import ParadiffError

    plan = _plan_argument(args.plan, "tensor")
    files = gguf_files(args)
    names = sorted(name for name in index.components if name.startswith("transformer"))
    unknown = sorted(set(files) - set(names))
    if unknown:
        raise CliError(f"--gguf {unknown[0]}=...: {args.model} has no such transformer; its transformers are {names}")
    for name in names:
        library, class_name = index.components[name][:2]
        repository, subfolder = index.location(name)
        folder = Path(repository) / (subfolder or "")
        if not folder.is_dir():
            continue  # a modular component on the Hub: fetched by the workers
        model_cls = getattr(importlib.import_module(library), class_name)
        tp_shard = (0, args.tp) if args.tp > 1 else None
        try:
            if name in files:
                from diffusers import GGUFQuantizationConfig

                from paradiff.api.single_file import prepare_gguf_model
                from paradiff.quant.schemes import gguf_scheme

                scheme = gguf_scheme(GGUFQuantizationConfig(compute_dtype=getattr(torch, args.dtype)))
                prepared = prepare_gguf_model(model_cls, Path(files[name]), config=str(folder), subfolder=None,
                                              hub_kwargs={}, dtype=getattr(torch, args.dtype),
                                              device=torch.device("cpu"), tp_shard=tp_shard, plan=plan, context=False,
                                              cp_plan=None, scheme=scheme)
            elif tp_shard is None:
                continue
            else:
                prepared = prepare_model(model_cls, folder, dtype=torch.float32, device=torch.device("cpu"),
                                         tp_shard=tp_shard, plan=plan)
        except ParadiffError as exc:
            flag = f"--gguf {files[name]}" if name in files else f"--tp {args.tp}"
            where = f" at --tp {args.tp}" if name in files and args.tp > 1 else ""
            raise CliError(f"{flag}{where}: {name} ({class_name}): {str(exc).splitlines()[0]}") from None
        prepared.checkpoint.close()
