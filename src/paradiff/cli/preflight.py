"""What a model folder's configs already decide, checked by the launcher before any worker starts: a folder that
is not there, a pipeline asked for CFG parallelism that never guides, a TP degree the transformer's heads cannot
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
        from paradiff.plans.pipelines import CFG_RULES

        if pipeline_name not in CFG_RULES:
            raise CliError(f"--cfg {args.cfg}: CFG parallelism is supported for {', '.join(sorted(CFG_RULES))}; "
                           f"{args.model} is a {pipeline_name}. Use --cfg 1")
    if args.tp > 1:
        _check_transformers_split(args, path, index)


def _looks_like_hub_id(name: str) -> bool:
    owner, slash, repo = name.partition("/")
    return bool(slash and owner and repo and "/" not in repo and not name.startswith((".", "/", "~")))


def _check_transformers_split(args: argparse.Namespace, folder: Path, index: dict) -> None:
    """Resolve each transformer's TP plan for the first TP rank on the meta device, as every worker will."""
    import torch

    from paradiff.api.model import prepare_model
    from paradiff.cli.worker import _plan_argument
    from paradiff.errors import ParadiffError

    plan = _plan_argument(args.plan, "tensor")
    for name, entry in sorted(index.items()):
        if not (name.startswith("transformer") and isinstance(entry, list) and len(entry) == 2
                and all(isinstance(part, str) for part in entry)):
            continue
        model_cls = getattr(importlib.import_module(entry[0]), entry[1])
        try:
            prepared = prepare_model(model_cls, folder / name, dtype=torch.float32, device=torch.device("cpu"),
                                     tp_shard=(0, args.tp), plan=plan)
        except ParadiffError as exc:
            raise CliError(f"--tp {args.tp}: {name} ({entry[1]}): {str(exc).splitlines()[0]}") from None
        prepared.checkpoint.close()
