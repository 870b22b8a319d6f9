"""What each rank of a run shows on the console: library messages and progress bars once, from rank 0, and only on
a terminal (the command's generation and the server's ranks alike); `say`, the one-line console message both write."""

from __future__ import annotations

import logging
import os
import sys


def say(line: str) -> None:
    """One write per line, so lines of concurrent ranks never interleave mid-line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class _CommandLines(logging.Formatter):
    """paradiff's own log records as the command's other lines: "paradiff: warning: ..."."""

    def format(self, record: logging.LogRecord) -> str:
        return f"paradiff: {record.levelname.lower()}: {record.getMessage()}"


def quiet_other_ranks(rank: int) -> None:
    """Library messages and progress bars once, from rank 0 (and only on a terminal); paradiff's own warnings as
    one "paradiff: warning: ..." line each."""
    if rank != 0 or not console_is_terminal():
        quiet_libraries()
    if rank != 0:  # every rank takes the same fallbacks (VAE or text encoder kept whole): rank 0 says so, once
        logging.getLogger("paradiff").setLevel(logging.ERROR)
    logger = logging.getLogger("paradiff")
    if not any(isinstance(handler.formatter, _CommandLines) for handler in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_CommandLines())
        logger.addHandler(handler)
        logger.propagate = False  # one line, not a second one from the root logger's handler


def console_is_terminal() -> bool:
    """Whether the user's console is a terminal: the launcher relays workers' stderr through a pipe and says so."""
    relayed = os.environ.get("PARADIFF_CONSOLE_TTY")
    return sys.stderr.isatty() if relayed is None else relayed == "1"


def quiet_libraries() -> None:
    """Only rank 0 on a terminal shows progress; the libraries' own loading bars would repeat once per rank."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.set_verbosity_error()
