"""`paradiff serve`: the checks made before any worker starts, and each worker's entry (paradiff.serve.ranks)."""

from __future__ import annotations

import argparse
import os
import re
import sqlite3
from typing import Any, Callable

from paradiff.cli.args import CliError


def check_serve_args(args: argparse.Namespace) -> None:
    """What `generate`'s checks do not cover: the address, the limits, and flags that make no sense for a server."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise CliError(f"paradiff serve needs {' and '.join(missing)}: pip install 'paradiff[serve]'")
    if args.compare:
        raise CliError("--compare is a `generate` flag; compare a server's answers with `paradiff generate`")
    if not 0 <= args.batch_window <= 10:
        raise CliError(f"--batch-window {args.batch_window}: expected seconds from 0 to 10")
    if getattr(args, "ray", False):
        ray_replicas(args)
    if args.max_wait is not None and args.max_wait <= 0:
        raise CliError(f"--max-wait {args.max_wait}: expected a number of seconds > 0")
    if args.request_timeout <= 0:
        raise CliError(f"--request-timeout {args.request_timeout}: expected a number of seconds > 0")
    if args.max_steps is not None and args.steps > args.max_steps:
        raise CliError(f"--steps {args.steps} is above --max-steps {args.max_steps}")
    if args.max_side is not None and max(args.width, args.height) > args.max_side:
        raise CliError(f"--width {args.width} / --height {args.height}: above --max-side {args.max_side}")
    if args.max_frames is not None and args.frames is not None and args.frames > args.max_frames:
        raise CliError(f"--frames {args.frames} is above --max-frames {args.max_frames}")
    if not 0 < args.read_timeout <= 600:
        raise CliError(f"--read-timeout {args.read_timeout}: expected seconds above 0, at most 600")
    for origin in args.allow_origin or ():
        if not re.fullmatch(r"https?://[^/\s]+", origin):
            raise CliError(f"--allow-origin {origin!r}: expected a page origin, SCHEME://HOST[:PORT] with no path, "
                           "e.g. https://app.example.com")
    if getattr(args, "api_key_file", None) is not None:
        if args.api_key is not None:
            raise CliError("--api-key and --api-key-file: give one of them")
        try:
            with open(args.api_key_file, encoding="utf-8") as file:
                args.api_key = file.readline().strip() or None
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"--api-key-file {args.api_key_file}: cannot read it "
                           f"({getattr(exc, 'strerror', None) or exc})") from None
        if args.api_key is None:
            raise CliError(f"--api-key-file {args.api_key_file}: the file's first line is empty; expected the key")
    if args.api_key is not None and not args.api_key.strip():
        raise CliError("--api-key is empty; give a key, or leave the flag out for a server without one")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not (args.api_key or os.environ.get("PARADIFF_API_KEY")):
        from paradiff.cli.report import say

        say(f"paradiff serve: warning: listening on {args.host} without --api-key: anyone who can reach it can use it")
    from paradiff.serve.jobs import keep_results, open_store

    try:
        keep_results(args.keep_results)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if "RANK" not in os.environ:  # the launcher, before its workers start
        try:
            open_store(args).close()
        except (OSError, sqlite3.Error) as exc:
            raise CliError(f"--jobs-db {args.jobs_db or os.path.join(args.out, 'jobs.db')}: cannot open it as a "
                           f"SQLite database ({exc}); give a writable file path") from None
        from paradiff.serve.app import check_listen_address

        problem = check_listen_address(args.host, args.port)
        if problem:
            raise CliError(f"--host {args.host} --port {args.port}: {problem}")


def run_serve_worker(args: argparse.Namespace, on_pipeline_loaded: Callable[[Any, int], None] | None) -> int:
    import torch

    from paradiff.cli.worker import load_spec_of, model_of
    from paradiff.distributed.mesh import default_device
    from paradiff.serve.app import Frontend
    from paradiff.serve.dispatch import Dispatcher
    from paradiff.serve.ranks import serve_rank

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    name = "paradiff-demo" if args.model is None else os.path.basename(os.path.normpath(model_of(args)))
    return serve_rank(args, load_spec_of(args), device, lambda: Frontend(args, name).start(), on_pipeline_loaded,
                      Dispatcher)


RAY_ONLY = {"--ray": 0, "--ray-replicas": 1, "--ray-route": 1, "--ray-address": 1, "--host": 1, "--port": 1,
            "--out": 1}


def ray_replicas(args: argparse.Namespace) -> tuple[int, int]:
    """--ray-replicas N or MIN:MAX as (min, max)."""
    text = args.ray_replicas
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(part.isdigit() and int(part) > 0 for part in parts) \
            or int(parts[0]) > int(parts[-1]):
        raise CliError(f"--ray-replicas {text!r}: expected N or MIN:MAX, whole numbers from 1 with MIN <= MAX")
    return int(parts[0]), int(parts[-1])


def run_ray_serve(args: argparse.Namespace, argv: list[str]) -> int:
    """`paradiff serve --ray`: the flags of one mesh (argv without the Ray flags and the address, which each
    replica chooses on its node) given to paradiff.serve.ray."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise CliError("--ray needs Ray Serve: pip install 'paradiff[ray]'")
    from paradiff.cli.args import world_size_of
    from paradiff.serve.ray import run

    return run(mesh_argv(argv), world_size_of(args), ray_replicas(args), args.ray_route, args.host, args.port,
               args.ray_address)


def mesh_argv(argv: list[str]) -> list[str]:
    """The flags of `paradiff serve ...` that each Ray replica's mesh takes: without the Ray flags, --host, --port
    and --out (each mesh listens on a loopback port of its own and writes to a folder of its own)."""
    mesh: list[str] = []
    skip = 0
    for token in argv[argv.index("serve") + 1:]:
        if skip:
            skip -= 1
            continue
        name = token.split("=", 1)[0]
        if name in RAY_ONLY:
            skip = RAY_ONLY[name] if "=" not in token else 0
            continue
        mesh.append(token)
    return mesh
