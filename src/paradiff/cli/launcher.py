"""Start the local workers of one run and supervise them: a failure never leaves processes behind or peers waiting."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from paradiff.cli.relay import StderrRelay
from paradiff.runtime.console import say
from paradiff.distributed.spawn import (DRAIN_SIGNAL, STOP_SIGNAL, free_port, rank_env, start_commands,
                                        stop_commands)

WORKER_MODULE = "paradiff.cli"
# A worker that fails exits with this code after printing its line and recording the cause for its peers (who then
# name it within a second or two); any other code means it died without a word (killed, os._exit, a native crash).
WORKER_REPORTED_FAILURE = 1
USER_ERROR = 2  # a CliError, printed by the worker as well
INTERRUPTED = 130  # Ctrl-C (SIGINT), as a shell reports a process it ended
INTERRUPT_GRACE_S = 2.0  # how long the workers get to end on their own after Ctrl-C before they are stopped


def launch(argv: list[str], world: int, worker_module: str = WORKER_MODULE, grace_s: float = 10.0,
           dead_grace_s: float = 1.0, forward_signals: bool = False, leader_grace_s: float | None = None) -> int:
    """Start `world` local workers (`python -m worker_module argv`) and supervise them; 0, or 1 if any failed.

    When one worker fails (exit code WORKER_REPORTED_FAILURE), the others get `grace_s` to notice (their collectives
    fail as soon as the peer's connections close, and they report which rank failed and why), then are terminated
    (SIGTERM, then SIGKILL), so a failure never leaves processes behind or peers waiting in a collective. A worker
    that dies without reporting leaves its peers nothing to say but "a peer died", which this launcher says itself:
    they get only `dead_grace_s`.

    `forward_signals` (a server): SIGTERM to the launcher goes to rank 0 as DRAIN_SIGNAL (it drains and then stops
    every rank), a second one as STOP_SIGNAL (it stops at once); Ctrl-C reaches rank 0 from the terminal. The
    launcher waits for them.

    `leader_grace_s` (a server): when a rank other than 0 fails while rank 0 still runs, rank 0 sees it itself,
    answers every waiting client with the cause and stops the others; the launcher gives it this long (a bound, not
    a wait: it returns as soon as every worker has ended) before it terminates them. On a loaded host the answers
    can take longer than the few seconds a dead peer otherwise gets.
    """
    debug = bool(os.environ.get("PARADIFF_DEBUG"))
    # The workers write to a pipe; rank 0 still shows progress bars when the console is a terminal.
    base_env = dict(os.environ, PARADIFF_WORKER="1", PARADIFF_CONSOLE_TTY="1" if sys.stderr.isatty() else "0",
                    OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    port = free_port()
    workers: list = []
    previous = {}
    if forward_signals:  # before the workers start: a SIGTERM from then on is theirs to hear
        asked = []

        def forward(_number, _frame):
            # as DRAIN_SIGNAL, then STOP_SIGNAL: a SIGTERM sent to the whole process group (systemd's control-group
            # kill) reaches rank 0 twice, itself and through here, and must count as one request to drain
            asked.append(True)
            if workers and workers[0].poll() is None:
                workers[0].send_signal(DRAIN_SIGNAL if len(asked) == 1 else STOP_SIGNAL)

        # SIGINT (Ctrl-C) reaches every worker from the terminal itself: forwarding it too would count twice
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, forward),
                    signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    workers += start_commands(worker_module, argv, [dict(base_env, **rank_env(rank, world, port))
                                                    for rank in range(world)])
    if forward_signals and asked:  # asked to stop while they started, before rank 0 could hear it: stopped now
        stop_commands(workers, 5.0)
    lock = threading.Lock()

    def to_console(data: bytes) -> None:
        if data:
            with lock:  # whole lines: workers' lines never interleave mid-line
                if hasattr(sys.stderr, "buffer"):
                    sys.stderr.buffer.write(data)
                else:
                    sys.stderr.write(data.decode(errors="replace"))
                sys.stderr.flush()

    relays = [StderrRelay(worker.stderr, to_console, filtered=not debug) for worker in workers]
    failed: tuple[int, int] | None = None
    interrupted = False
    try:
        while any(worker.poll() is None for worker in workers):
            for rank, worker in enumerate(workers):
                code = worker.poll()
                if code not in (None, 0) and failed is None:
                    failed = (rank, code)
            if failed is not None:
                grace = grace_s if failed[1] in (WORKER_REPORTED_FAILURE, USER_ERROR) else dead_grace_s
                if leader_grace_s is not None and failed[0] != 0 and workers[0].poll() is None:
                    grace = max(grace, leader_grace_s)
                deadline = time.monotonic() + grace
                while time.monotonic() < deadline and any(worker.poll() is None for worker in workers):
                    time.sleep(0.05)
                break
            time.sleep(0.05)
    except KeyboardInterrupt:  # Ctrl-C: the workers heard it from the terminal too, and end quietly (cli.main)
        interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the stop short
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while time.monotonic() < deadline and any(worker.poll() is None for worker in workers):
            time.sleep(0.05)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        stop_commands(workers, 5.0)
        for relay in relays:
            relay.join(timeout=5.0)
    if interrupted or (failed or (0, 0))[1] == INTERRUPTED:  # a worker ended by Ctrl-C (the launcher ignores it)
        say("paradiff: interrupted; every rank stopped.")
        return INTERRUPTED
    hidden = sum(relay.dropped_traces for relay in relays)
    note = f" {hidden} native stack trace(s) hidden; PARADIFF_DEBUG=1 shows them." if hidden else ""
    failures = [(rank, w.returncode) for rank, w in enumerate(workers) if w.returncode]
    if failed is not None or failures:
        first = failed or failures[0]
        others = ", ".join(f"rank {rank}: {code}" for rank, code in failures if rank != first[0])
        say(f"paradiff: rank {first[0]} {_how_it_ended(first[1])} first; stopped the run"
            + (f" (exit codes of the others: {others})." if others else ".") + note)
        return 1
    if note:
        say("paradiff:" + note)
    return 0


def _how_it_ended(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"

