"""The `paradiff` command: `generate` images or videos on the mesh, `serve` them over HTTP, `bench` a list of
configurations.

Outside torchrun, `generate` launches and supervises its own worker processes (the product of the degrees) and ends
every worker when one fails; under torchrun (multi-node included) it uses the given ranks.

    args.py      the parser and every up-front check of the user's input
    preflight.py what the model folder's configs decide, checked before any worker starts
    launcher.py  starts and supervises the local workers
    relay.py     the workers' stderr to the console, without native (C++) backtraces
    worker.py    one rank: process group, pipeline on the mesh, generation
    serve.py     `paradiff serve`: its checks, and each rank's entry into paradiff.serve
    report.py    report.json and the run's summary lines
    compare.py   `--compare`: the single-process reference
    bench.py     `paradiff bench`
    plans.py     `paradiff check-plan` and `paradiff plans`
    plan.py      `paradiff plan`: predicted meshes from the cost model
    embedded.py  the pipeline used when no model is given
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

from paradiff.cli.args import CliError, build_parser, check_args, world_size_of
from paradiff.cli.preflight import check_model_folder
from paradiff.cli.launcher import INTERRUPTED, USER_ERROR, WORKER_MODULE, WORKER_REPORTED_FAILURE, launch
from paradiff.errors import native_message
from paradiff.runtime.console import say

# A server's rank 0 answers its clients and stops the other ranks itself when one of them dies; the launcher's bound
# on that (launch's `leader_grace_s`).
SERVER_LEADER_GRACE_S = 60.0

__all__ = ["CliError", "entry_point", "main"]


def main(argv: list[str] | None = None, *, worker_module: str = WORKER_MODULE,
         on_pipeline_loaded: Callable[[Any, int], None] | None = None) -> int:
    """Run the command; returns the exit code.

    `worker_module` is what the launcher starts for each rank (`python -m worker_module ARGV`); it must end in this
    function. `on_pipeline_loaded(pipeline, rank)` runs in each worker once its pipeline is loaded.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.debug:  # the workers this process starts inherit it
        os.environ["PARADIFF_DEBUG"] = "1"
    try:
        code = _run(args, argv, worker_module, on_pipeline_loaded)
        sys.stdout.flush()  # here, where a reader that went away is caught, not at the interpreter's exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except KeyboardInterrupt:  # Ctrl-C: one line from the command (a worker's launcher says it for every rank)
        if not os.environ.get("PARADIFF_WORKER"):
            say("paradiff: interrupted.")
        return INTERRUPTED
    except CliError as exc:
        say(f"paradiff: error: {exc}")
        return USER_ERROR
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback, unless --debug / PARADIFF_DEBUG=1
        if os.environ.get("PARADIFF_DEBUG"):
            raise
        say(f"paradiff: error: {type(exc).__name__}: {_first_line(exc)} (paradiff --debug shows the traceback)")
        return WORKER_REPORTED_FAILURE


def _first_line(exc: BaseException) -> str:
    return native_message(exc, limit=None)


def _reader_gone() -> int:
    """What a command whose stdout was closed early (`paradiff plans | head`) ends with: no traceback, no "Exception
    ignored" at exit (stdout now goes to /dev/null), and the status of a process ended by SIGPIPE, as `yes | head`
    has it."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _run(args, argv: list[str], worker_module: str, on_pipeline_loaded) -> int:
    """The command of `args`; its exit code (a CliError propagates)."""
    if args.command in ("check-plan", "plans"):
        from paradiff.cli.plans import check_plan_command, plans_command

        return check_plan_command(args) if args.command == "check-plan" else plans_command(args)
    if args.command == "plan":
        from paradiff.cli.plan import plan_command

        return plan_command(args)
    if args.command == "bench":
        from paradiff.cli.bench import bench

        return bench(args, lambda run_argv: main(run_argv, worker_module=worker_module,
                                                 on_pipeline_loaded=on_pipeline_loaded))
    if getattr(args, "parallel", None) == "auto":
        from paradiff.cli.plan import resolve_auto_parallel

        argv = resolve_auto_parallel(args, argv)
    check_args(args)
    if getattr(args, "dry_run", False):  # the same checks of the folder and the mesh as a run's, then the figures
        from paradiff.cli.dry_run import dry_run

        check_model_folder(args)
        return dry_run(args)
    if args.command == "serve":
        from paradiff.cli.serve import check_serve_args

        check_serve_args(args)
        if args.ray and "RANK" not in os.environ:
            from paradiff.cli.serve import run_ray_serve

            return run_ray_serve(args, argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != world_size_of(args):
            raise CliError(
                f"the degrees multiply to {world_size_of(args)} but torchrun started {os.environ['WORLD_SIZE']} "
                "processes; they must match"
            )
        if args.command == "generate" and os.environ["RANK"] == "0" and not os.environ.get("PARADIFF_WORKER"):
            _clear_previous_run(args)  # under torchrun (the local launcher's workers: the launcher did)
        _run_worker_and_exit(args, on_pipeline_loaded)
    if args.model is None:
        from paradiff.cli.embedded import embedded_default

        try:
            embedded_default()
        except FileNotFoundError as exc:
            raise CliError(str(exc)) from None
    check_model_folder(args)
    if args.command == "generate":
        _warn_idle_replicas(args)
        _clear_previous_run(args)
    if args.command == "serve":  # the launcher forwards SIGTERM / SIGINT to rank 0, which drains
        return launch(argv, world_size_of(args), worker_module, dead_grace_s=10.0, forward_signals=True,
                      leader_grace_s=SERVER_LEADER_GRACE_S)
    return launch(argv, world_size_of(args), worker_module)


def _clear_previous_run(args) -> None:
    """A run into a folder an earlier run wrote: its outputs go first (said once), so none is left stale."""
    from paradiff.cli.report import clear_previous_run

    removed = clear_previous_run(Path(args.out))
    if removed:
        say(f"paradiff: --out {args.out}: removed the {removed} output file(s) of the run before (its report.json "
            "named them)")


def _warn_idle_replicas(args) -> None:
    """--dp N with fewer than N prompts: the replicas without one load the whole pipeline and wait (said once)."""
    from paradiff.cli.args import read_prompts

    count = len(read_prompts(args))
    if args.dp > count:
        say(f"paradiff: warning: --dp {args.dp} with {count} prompt(s): {args.dp - count} replica(s) will load the "
            f"pipeline and draw nothing; give at least {args.dp} prompts (--prompt repeated, --prompts-file) or a "
            "smaller --dp")


def _run_worker_and_exit(args, on_pipeline_loaded) -> None:
    from paradiff.cli.worker import run_worker

    code = 0
    try:
        if args.command == "serve":
            from paradiff.cli.serve import run_serve_worker

            code = run_serve_worker(args, on_pipeline_loaded)
        else:
            run_worker(args, on_pipeline_loaded)
    except Exception as exc:  # noqa: BLE001 - one line per failing rank; PARADIFF_DEBUG=1 for tracebacks
        if os.environ.get("PARADIFF_DEBUG"):
            raise
        say(f"paradiff: rank {os.environ.get('RANK')} failed: {type(exc).__name__}: {_first_line(exc)}")
        code = WORKER_REPORTED_FAILURE
    # Skip interpreter finalisation: gloo's background threads may still release Python objects of the last
    # collectives, and doing that while the interpreter shuts down aborts the process (seen in ~5% of runs).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def entry_point() -> None:
    sys.exit(main())
