"""`paradiff serve`: the flags as the server's typed settings (`settings_of`: serve/settings.py's ServeSettings), the
checks made before any worker starts, and each worker's entry (paradiff.serve.ranks)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, Callable

from paradiff.cli.args import CliError
from paradiff.errors import ServeSettingsError
from paradiff.runtime.console import say

if TYPE_CHECKING:
    from paradiff.serve.settings import ServeSettings


def check_serve_args(args: argparse.Namespace) -> None:
    """What `generate`'s checks do not cover: the server's settings (serve/settings.py: ServeSettings, built from the
    flags and checked there), the address, and flags that make no sense for a server."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn", "sqlalchemy") if importlib.util.find_spec(name) is None]
    if missing:
        raise CliError(f"paradiff serve needs {', '.join(missing)}: pip install 'paradiff[serve]'")
    if args.compare:
        raise CliError("--compare is a `generate` flag; compare a server's answers with `paradiff generate`")
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
    settings = settings_of(args)
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not (settings.api_key
                                                                       or os.environ.get("PARADIFF_API_KEY")):
        say(f"paradiff serve: warning: listening on {settings.host} without --api-key: anyone who can reach it can "
            "use it")
    if "RANK" not in os.environ:  # the launcher, before its workers start
        from paradiff.serve.jobs import open_store
        from paradiff.serve.jobstore import shown

        try:
            open_store(settings).close()
        except ValueError as exc:  # not a URL of a database served here (store_url)
            raise CliError(str(exc)) from None
        except ModuleNotFoundError as exc:  # the database's driver
            raise CliError(f"--jobs-db {shown(settings.jobs_where)}: its driver {exc.name} is not installed; "
                           "pip install 'paradiff[postgres]'") from None
        except Exception as exc:  # noqa: BLE001 - SQLAlchemy's and the driver's errors, OSError: one line, no trace
            reason = getattr(exc, "reason", None) or " ".join(str(getattr(exc, "orig", None) or exc).split())
            raise CliError(f"--jobs-db {shown(settings.jobs_where)}: cannot open the job store ({reason}); give a "
                           "writable file path or a database URL the server can reach") from None
        from paradiff.serve.app import check_listen_address

        problem = check_listen_address(settings.host, settings.port)
        if problem:
            raise CliError(f"--host {settings.host} --port {settings.port}: {problem}")


def settings_of(args: argparse.Namespace) -> ServeSettings:
    """The flags of `paradiff serve` as the typed ServeSettings the server runs with (the one place its parsed flags
    become one; after check_serve_args, which reads --api-key-file); a value the settings refuse is a CliError
    naming its flag."""
    from paradiff.cli.args import default_steps
    from paradiff.cli.embedded import embedded_call_kwargs
    from paradiff.cli.worker import load_spec_of, model_of
    from paradiff.serve.settings import ServeSettings

    spec = load_spec_of(args)
    try:
        return ServeSettings(
            spec, model_name="paradiff-demo" if args.model is None else os.path.basename(os.path.normpath(
                model_of(args))),
            host=args.host, port=args.port, api_key=args.api_key, allow_host=tuple(args.allow_host or ()),
            allow_origin=tuple(args.allow_origin or ()), max_batch=args.max_batch, batch_window=args.batch_window,
            max_queue=args.max_queue, schedule=args.schedule, max_wait=args.max_wait,
            request_timeout=args.request_timeout, max_n=args.max_n, max_side=args.max_side,
            max_steps=args.max_steps, max_frames=args.max_frames, max_body_bytes=args.max_body_bytes,
            read_timeout=args.read_timeout, width=args.width, height=args.height,
            steps=args.steps if args.steps is not None else default_steps(args),
            guidance_scale=args.guidance_scale, true_cfg_scale=args.true_cfg_scale,
            negative_prompt=args.negative_prompt, frames=args.frames, fps=args.fps,
            extra_call_kwargs=tuple(embedded_call_kwargs().items()) if args.model is None else (),
            previews=args.previews, out=args.out, jobs_db=args.jobs_db, keep_results=args.keep_results,
            lora_modules=tuple(args.lora_modules or ()), allow_runtime_lora=args.allow_runtime_lora,
            lora_root=args.lora_root, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
            timeout=args.timeout, ray=args.ray, ray_replicas=ray_replicas(args) if args.ray else (1, 1),
            ray_route=args.ray_route, ray_address=args.ray_address, ray_ingress=args.ray_ingress)
    except ServeSettingsError as exc:
        raise settings_error(exc) from None


def settings_error(exc: ServeSettingsError) -> CliError:
    """A ServeSettingsError as the command line says it: each setting it names as its flag."""
    return CliError(exc.said(lambda field: "--" + field.replace("_", "-")))


def run_serve_worker(args: argparse.Namespace, on_pipeline_loaded: Callable[[Any, int], None] | None) -> int:
    import torch

    from paradiff.distributed.mesh import default_device
    from paradiff.serve.app import Frontend
    from paradiff.serve.dispatch import Dispatcher
    from paradiff.serve.ranks import FRONTEND_ELSEWHERE, serve_rank

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    settings = settings_of(args)
    if os.environ.get(FRONTEND_ELSEWHERE):  # a mesh under Ray Serve: its replica's process runs the frontend
        return serve_rank(settings, device, None, on_pipeline_loaded)
    try:
        return serve_rank(settings, device, lambda: Frontend(settings).start(), on_pipeline_loaded, Dispatcher)
    except ServeSettingsError as exc:  # a --lora-modules file rank 0's frontend cannot serve
        raise settings_error(exc) from None


RAY_ONLY = {"--ray": 0, "--ray-replicas": 1, "--ray-route": 1, "--ray-address": 1, "--ray-ingress": 1, "--host": 1,
            "--port": 1, "--out": 1, "--jobs-db": 1}


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
    from paradiff.serve.jobstore import store_url
    from paradiff.serve.ray import check_ingress, run

    settings = settings_of(args)
    try:
        check_ingress(settings.ray_ingress, settings.ray_address)  # before Ray starts
    except ValueError as exc:
        raise CliError(str(exc)) from None
    # one job store for every mesh (each runs the jobs it claims; any answers any job id): this command's
    # (`--jobs-db`, else --out's jobs.db), as a URL (a file's absolute path: Ray starts the meshes in folders of their
    # own)
    jobs = ["--jobs-db", store_url(settings.jobs_where)]
    return run(mesh_argv(argv) + jobs, world_size_of(args), settings.ray_replicas, settings.ray_route, settings.host,
               settings.port, settings.ray_address, settings.ray_ingress)


def mesh_argv(argv: list[str]) -> list[str]:
    """The flags of `paradiff serve ...` that each Ray replica's mesh takes: without the Ray flags, --host, --port
    and --out (each mesh listens on a loopback port of its own and writes to a folder of its own), and --jobs-db
    (run_ray_serve gives every mesh the same store, as a URL)."""
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
