"""`paradiff generate`'s worker run on every rank of a test pool (gloo, CPU) by tests/test_cli_video.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from paradiff.cli.args import build_parser, check_args
from paradiff.cli.worker import generate


def generate_each(runs: list[list[str]]) -> list[dict]:
    """Run `paradiff generate ARGV` for each argv of `runs`, in this pool's process group; per run: rank 0's report,
    and this rank's transformer parameter count next to the whole transformer's."""
    torch.set_num_threads(1)
    results = []
    for argv in runs:
        args = build_parser().parse_args(argv)
        check_args(args)
        loaded = {}

        def measure(pipeline, _rank):
            config = dict(pipeline.transformer.config)
            whole = type(pipeline.transformer).from_config(config)
            loaded["local_params"] = sum(p.numel() for p in pipeline.transformer.parameters())
            loaded["whole_params"] = sum(p.numel() for p in whole.parameters())

        report = generate(args, torch.device("cpu"), on_pipeline_loaded=measure)
        results.append({"rank": dist.get_rank(), "report": report, **loaded})
    return results


def fetch_offline(repo: str, cache: str) -> dict:
    """`fetch_hub_model_once` for Hub id `repo` with the Hub offline and an empty cache `cache`, as under torchrun:
    which ranks tried to fetch, and what each raised."""
    from huggingface_hub import constants

    from paradiff.cli import preflight
    from paradiff.cli.args import CliError
    from paradiff.cli.worker import fetch_hub_model_once

    before = constants.HF_HUB_OFFLINE, constants.HF_HUB_CACHE  # the pool's processes serve other tests after
    constants.HF_HUB_OFFLINE, constants.HF_HUB_CACHE = True, cache
    tried = []
    fetch = preflight.fetch_hub_pipeline
    preflight.fetch_hub_pipeline = lambda name: tried.append(name) or fetch(name)
    try:
        args = build_parser().parse_args(["generate", repo])
        fetch_hub_model_once(args, torch.device("cpu"))
        return {"rank": dist.get_rank(), "tried": tried, "error": None}
    except CliError as exc:
        return {"rank": dist.get_rank(), "tried": tried, "error": str(exc)}
    finally:
        preflight.fetch_hub_pipeline = fetch
        constants.HF_HUB_OFFLINE, constants.HF_HUB_CACHE = before
