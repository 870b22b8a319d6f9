"""What a model folder's configs already decide, checked by the launcher before any worker starts: a folder that
is not there, or a Hub id that cannot be fetched (fetched here, once); a pipeline asked for CFG parallelism that never
guides (or is not classified yet, or is called without guidance), context parallelism on a pipeline whose call
replaces the attention it splits, a TP degree the transformer's heads cannot take; a guidance flag its call does not
take, a frame count its VAE cannot make; a --lora file that is corrupt or made for another model; NF4 slices that
would cut a block, a --quantize-skip naming no module. For the embedded demo pipeline as for a folder given. Reads
configs and checkpoint headers, no weight; every worker would otherwise start, build its process group and then fail
the same way on each rank."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from paradiff.cli.args import CliError
from paradiff.cli.common import _plan_argument


def check_model_folder(args: argparse.Namespace) -> None:
    """Every check below, on the model folder given or, without one, on the embedded demo pipeline's folder."""
    label = args.model if args.model is not None else "the embedded demo pipeline"
    if args.model is not None and not Path(args.model).exists():
        if not looks_like_hub_id(args.model):
            raise CliError(f"model folder {args.model} does not exist (and is not a Hub id of the form "
                           "'owner/name')")
        # the launcher fetches the repository once (the workers then find it in the Hub cache) and checks the copy
        args = argparse.Namespace(**{**vars(args), "model": str(fetch_hub_pipeline(args.model))})
    from paradiff.cli.conditioning import folder_index, model_folder

    path = model_folder(args)
    index = folder_index(args)
    if index is None:
        raise CliError(f"{label} has no model_index.json (nor a Modular Diffusers modular_model_index.json): not a "
                       "diffusers pipeline")
    pipeline_name = getattr(args, "pipeline", None) or str(index.class_name)
    if not index.modular:
        _check_call_flags(args, pipeline_name, path)
    _check_frames(args, pipeline_name, path)
    _check_adapters(args, pipeline_name, index, label)
    if index.modular:
        _check_modular_flags(args, pipeline_name, path)
    if args.tp * args.ulysses * args.ring * args.cfg > 1:
        from paradiff.plans.pipelines import not_dit_refusal

        if not_dit_refusal(pipeline_name) is not None:
            raise CliError(f"{label}: {not_dit_refusal(pipeline_name)}")
    if args.cfg > 1 and index.modular:
        _check_modular_guides(args, pipeline_name, path)
    elif args.cfg > 1:
        from paradiff.plans.pipelines import cfg_refusal, pipeline_spec

        refusal = cfg_refusal(pipeline_name)
        if refusal is not None:
            raise CliError(f"--cfg {args.cfg}: {label}: {refusal}. Use --cfg 1")
        rule = pipeline_spec(pipeline_name).cfg
        if rule is not None:  # else guidance through a guider component: checked at the call
            branches = rule.branches
            if args.cfg != branches:
                raise CliError(f"--cfg {args.cfg}: {pipeline_name} runs {branches} guidance branches per step, one "
                               f"per cfg rank. Use --cfg {branches} or --cfg 1")
            _check_call_guides(args, pipeline_name, index.entries())
    if args.ulysses * args.ring > 1:
        from paradiff.plans.pipelines import cp_refusal

        refusal = cp_refusal(pipeline_name)
        if refusal is not None:
            raise CliError(f"--ulysses / --ring: {label}: {refusal}")
    if args.tp > 1 or getattr(args, "gguf", None):
        _check_transformers_split(args, index, label)
    if getattr(args, "quantize", None) and args.compare and index.modular:
        raise CliError(f"--quantize {args.quantize} with --compare: {label} is a Modular Diffusers pipeline, whose "
                       "single-process reference paradiff does not load quantized; drop one of the two")
    if getattr(args, "quantize_skip", None):
        _check_quantize_skip(args, index, label)
    if getattr(args, "quantize", None) == "nf4" and args.tp > 1:
        _check_nf4_blocks(args, index, label)
    if not index.modular:  # last: what the mesh and the flags decide is said first
        _check_component_files(index, label)


def _check_component_files(index, label: str) -> None:
    """Each component a standard pipeline's model_index.json names: its folder there, its configs and shard index
    readable JSON (not a tokenizer's vocabulary: tens of MB to parse on every run), each safetensors file's header
    whole (its tensors inside the file): a truncated download or a corrupt config is named here, in any mesh,
    instead of by every rank once it loads."""
    from paradiff.errors import CheckpointError
    from paradiff.io.checkpoint import read_header

    for name, (_library, class_name) in index.components.items():
        folder = index.folder / name
        if not folder.is_dir():
            raise CliError(f"{label}: model_index.json names {name} ({class_name}), but {folder} is not a folder")
        for config in sorted([*folder.glob("*config.json"), *folder.glob("*.index.json")]):
            try:
                json.loads(config.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise CliError(f"{config}: not valid JSON ({exc}); the file is corrupt") from None
        for weights in sorted(folder.glob("*.safetensors")):
            try:
                read_header(weights)
            except CheckpointError as exc:
                raise CliError(str(exc).splitlines()[0]) from None


def fetch_hub_pipeline(repo: str) -> Path:
    """The local copy of Hub pipeline `repo`, downloaded (or found in the Hub cache) by this one process, as every
    worker would; a CliError naming the repository and how to get it when it cannot be had (offline, no such repo,
    gated)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    from paradiff.errors import ParadiffError
    from paradiff.io.folders import resolve_folder

    how = (f"download it where the Hub is reachable (huggingface-cli download {repo}) and run with the local copy "
           "(its folder, or the id with HF_HUB_OFFLINE=1)")
    try:
        return resolve_folder(repo, pipeline=True)
    except LocalEntryNotFoundError:
        offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise CliError(f"{repo}: not in the local Hub cache and {offline}; {how}") from None
    except (HfHubHTTPError, OSError, ParadiffError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CliError(f"{repo}: cannot fetch this Hub repository ({type(exc).__name__}: {first}); {how}") from None


# the call options the command line passes to any pipeline, by flag
CALL_OPTIONS = {"--negative-prompt": "negative_prompt", "--guidance-scale": "guidance_scale",
                "--true-cfg-scale": "true_cfg_scale"}


def _check_call_flags(args: argparse.Namespace, pipeline_name: str, folder: Path) -> None:
    """A guidance option the pipeline class's __call__ does not take would fail at the call on every rank (FLUX.2
    takes no negative_prompt): refused by flag, naming what it does take."""
    import inspect

    import diffusers

    cls = getattr(diffusers, pipeline_name, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "__call__", None)):
        return  # a custom pipeline class: checked at the call
    parameters = inspect.signature(cls.__call__).parameters
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return
    for flag, keyword in CALL_OPTIONS.items():
        if getattr(args, keyword, None) is not None and keyword not in parameters:
            takes = [f for f, k in CALL_OPTIONS.items() if k in parameters]
            raise CliError(f"{flag}: {pipeline_name}'s __call__ takes no {keyword} (of the guidance options it "
                           f"takes {', '.join(takes) if takes else 'none'}); drop {flag}")


def _check_frames(args: argparse.Namespace, pipeline_name: str, folder: Path) -> None:
    """--frames N on a pipeline whose VAE packs T frames into one latent frame: it makes T*k + 1 frames and would
    silently make another count; refused, naming the nearest counts it makes."""
    if args.frames is None:
        return
    from paradiff.plans.pipelines import frames_step

    vae_config = folder / "vae" / "config.json"
    step = frames_step(pipeline_name, json.loads(vae_config.read_text())) if vae_config.is_file() else None
    if step is None or args.frames % step == 1:
        return
    below = (args.frames - 1) // step * step + 1
    counts = [count for count in (below - step, below, below + step, below + 2 * step) if count >= 1]
    raise CliError(f"--frames {args.frames}: {pipeline_name}'s VAE packs {step} frames into one latent frame, so it "
                   f"makes {step}k + 1 frames and would not make {args.frames}; use one of "
                   f"{', '.join(map(str, counts))} ...")


def _check_adapters(args: argparse.Namespace, pipeline_name: str, index, label: str) -> None:
    """Each local --lora safetensors file: its header read and checked against the file (a truncated or corrupt
    file is named, with what is wrong), and a file of peft-named transformer tensors checked against the
    transformer built from its config on the meta device: every module it targets exists, with the shapes it needs
    (as each worker would find after the whole load)."""
    from paradiff.cli.args import lora_specs

    loras = lora_specs(args)
    if not loras:
        return
    import diffusers

    cls = getattr(diffusers, pipeline_name, None)
    if isinstance(cls, type) and not hasattr(cls, "load_lora_weights"):
        raise CliError(f"--lora: {pipeline_name} has no LoRA loader in diffusers (no load_lora_weights); adapters "
                       "work on pipelines whose class has one (FLUX, Qwen-Image, Wan, SD3 ...)")
    from paradiff.errors import AdapterError, CheckpointError

    model = None
    for lora in loras:
        local = Path(lora["path"])
        if local.is_file() and local.suffix not in ADAPTER_SUFFIXES:
            raise CliError(f"--lora {lora['path']}: not an adapter file (a {local.suffix or 'suffix-less'} file); "
                           f"expected one of {', '.join(ADAPTER_SUFFIXES)}, a folder holding one, or a Hub id")
        file = _adapter_file(local, args.lora_weight_name)
        if file is None:
            continue  # a Hub id, or another format: read by diffusers in the workers
        from paradiff.io.checkpoint import read_header

        try:
            header = read_header(file)
        except CheckpointError as exc:
            raise CliError(f"--lora {lora['path']}: not a readable safetensors file: {exc}") from None
        if not any(marker in key.lower() for key in header for marker in ADAPTER_MARKERS):
            example = next(iter(header), "none")
            raise CliError(f"--lora {lora['path']}: holds no adapter tensors ({len(header)} tensors, e.g. {example!r}, "
                           "none named lora / lokr / loha); is it a model's weights?")
        # peft names under the transformer's prefix: loaded as they are (others are converted by diffusers first)
        shapes = {key.removeprefix("transformer."): tuple(info.shape) for key, info in header.items()
                  if key.startswith("transformer.")}
        if not shapes or not all(".lora_A." in name or ".lora_B." in name for name in shapes):
            continue
        if model is None:
            model = _meta_transformer(index)
            if model is None:
                return
        from paradiff.api.lora import AdapterSource, check_adapter

        adapter = AdapterSource(names={name: name for name in shapes}, shapes=shapes, dtypes={}, identity="")
        try:
            check_adapter(model, None, adapter, None, False)
        except AdapterError as exc:
            raise CliError(f"--lora {lora['path']}: {label}'s transformer ({type(model).__name__}): "
                           f"{str(exc).splitlines()[0]}") from None


# what diffusers' LoRA loaders read (safetensors, or torch's pickles), and the words every adapter format's tensor names
# carry (peft's lora_A, kohya's lora_down / lora_up, LyCORIS' lokr / hada, alphas beside them)
ADAPTER_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
ADAPTER_MARKERS = ("lora", "lokr", "hada", "loha", "dora")


def _adapter_file(path: Path, weight_name: str | None) -> Path | None:
    """The local safetensors file of a --lora path (a file, or a folder's weight_name / diffusers' default name)."""
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        default = path / "pytorch_lora_weights.safetensors"  # diffusers' default weight_name
        path = path / weight_name if weight_name else default if default.is_file() else \
            files[0] if len(files) == 1 else path
    return path if path.is_file() and path.suffix == ".safetensors" else None


def _meta_transformer(index):
    """The pipeline's transformer built from its config on the meta device (no weight), or None when its class or
    folder is not local."""
    import torch

    from paradiff.api.model import parameters_on_meta
    from paradiff.io.model_classes import construct, load_config
    from paradiff.plans import model_config

    library, class_name = index.components["transformer"][:2]
    repository, subfolder = index.location("transformer")
    folder = Path(repository) / (subfolder or "")
    model_cls = getattr(importlib.import_module(library), class_name, None)
    if model_cls is None or not (folder / "config.json").is_file():
        return None
    from paradiff.errors import ParadiffError

    try:
        with parameters_on_meta():
            return construct(model_cls, model_config(model_cls, load_config(model_cls, folder)), torch.float32)
    except (ParadiffError, ValueError, TypeError, OSError):
        return None  # a config this process cannot build: the workers' load names what is wrong


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

    from paradiff.plans.pipelines import pipeline_spec

    rule = pipeline_spec(pipeline_name).cfg
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


def looks_like_hub_id(name: str) -> bool:
    owner, slash, repo = name.partition("/")
    return bool(slash and owner and repo and "/" not in repo and not name.startswith((".", "/", "~")))


def _check_transformers_split(args: argparse.Namespace, index, label: str) -> None:
    """Resolve each transformer's TP plan for the first TP rank on the meta device, as every worker will; a
    transformer read from a --gguf file is checked against the file (its types, names and blocks)."""
    import torch

    from paradiff.api.model import prepare_model
    from paradiff.cli.args import gguf_files
    from paradiff.errors import ParadiffError

    plan = _plan_argument(args.plan, "tensor")
    files = gguf_files(args)
    names = sorted(name for name in index.components if name.startswith("transformer"))
    unknown = sorted(set(files) - set(names))
    if unknown:
        raise CliError(f"--gguf {unknown[0]}=...: {label} has no such transformer; its transformers are {names}")
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


def _check_quantize_skip(args: argparse.Namespace, index, label: str) -> None:
    """Each --quantize-skip name matches a module of the transformer (diffusers' matching: the name, or a prefix of
    it ending at a dot), else it would skip nothing without a word."""
    from paradiff.cli.args import quantize_skip

    if "transformer" not in index.components:
        return
    model = _meta_transformer(index)
    if model is None:
        return
    names = [f"{name}." for name, _ in model.named_modules() if name]
    for key in quantize_skip(args):
        if not any(f"{key}." in name for name in names):
            top = [name for name, _ in model.named_children()]
            raise CliError(f"--quantize-skip {key}: {label}'s transformer ({type(model).__name__}) has no module of "
                           f"that name; its top-level modules are {', '.join(top)}")


def _check_nf4_blocks(args: argparse.Namespace, index, label: str) -> None:
    """--quantize nf4 --tp N: every linear nf4 quantizes must split on its 64-element blocks on every rank (the
    first and last TP ranks' slices are the ones that can end off a block). Those that would not are named, all at
    once, with the flag that leaves them unquantized."""
    import torch

    from paradiff.api.model import prepare_model
    from paradiff.cli.args import quantize_skip
    from paradiff.errors import ParadiffError
    from paradiff.quant.schemes import block_cut_layers, model_config_for, scheme_from_config

    skip = quantize_skip(args)
    scheme = scheme_from_config(model_config_for("nf4", getattr(torch, args.dtype), skip))
    plan = _plan_argument(args.plan, "tensor")
    cut: dict[str, list[str]] = {}
    for name in sorted(name for name in index.components if name.startswith("transformer")):
        library, class_name = index.components[name][:2]
        repository, subfolder = index.location(name)
        folder = Path(repository) / (subfolder or "")
        if not folder.is_dir():
            continue
        model_cls = getattr(importlib.import_module(library), class_name)
        for rank in sorted({0, args.tp - 1}):
            try:
                prepared = prepare_model(model_cls, folder, dtype=torch.float32, device=torch.device("cpu"),
                                         tp_shard=(rank, args.tp), plan=plan)
            except ParadiffError:
                return  # not this check's to say (a folder saved quantized ...): the workers name it
            prepared.checkpoint.close()
            layers = block_cut_layers(scheme.for_model(prepared.model), prepared.model, prepared.resolved)
            for layer in layers:
                if layer not in cut.setdefault(name, []):
                    cut[name].append(layer)
    layers = [layer for layers in cut.values() for layer in layers]
    if layers:
        where = ", ".join(f"{name}: {', '.join(names)}" for name, names in cut.items() if names)
        given = f"{','.join(skip)}," if skip else ""
        raise CliError(f"--quantize nf4 --tp {args.tp}: {label}'s {where} would be split across a 64-element nf4 "
                       f"block, so no rank's shard could equal the single-device quantized weight; leave "
                       f"{'it' if len(layers) == 1 else 'them'} unquantized with --quantize-skip "
                       f"{given}{','.join(dict.fromkeys(layers))}, or use another --tp")
