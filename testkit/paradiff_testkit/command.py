"""Run `python -m paradiff.cli ...` (or a script) in tests without starting a new interpreter for it.

A test of the command itself used to pay 3-5 s of CPU per run for a fresh interpreter to import torch, diffusers
and transformers before the command did anything. Here each run is a process forked from the fork server the test
pools use (distributed/spawn.py: local_context), which imported those once; in the fork the command runs as
`python -m module args` would (its own environment, argv, stdin from /dev/null, stdout and stderr to files, its exit
status as the return code) and in a process group of its own, so a run past its timeout is killed with every worker
it started. Where workers may not be forked (a machine with accelerator devices) it is a plain subprocess.

The handles mimic subprocess.Popen (`communicate`, `poll`, `wait`, `kill`, `pid`, `returncode`), and `run` returns
a subprocess.CompletedProcess with text output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paradiff.distributed.spawn import can_fork_workers, exit_as_main, local_context
from paradiff.testing.dist import PRELOAD
from paradiff_testkit import PRELOAD as KIT_PRELOAD


def _run_in_fork(target: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """The forked command: `python -m MODULE ARGS` (target ["-m", MODULE, *ARGS]) or `python SCRIPT ARGS`, in a
    process group of its own, stdin from /dev/null, stdout and stderr to `out` / `err` (one file when equal)."""
    os.setpgrp()
    try:
        streams = [((0,), os.devnull, os.O_RDONLY)]
        if out == err:
            streams.append(((1, 2), out, os.O_WRONLY | os.O_APPEND))
        else:
            streams += [((1,), out, os.O_WRONLY | os.O_APPEND), ((2,), err, os.O_WRONLY | os.O_APPEND)]
        for fds, path, flags in streams:
            opened = os.open(path, flags)
            for fd in fds:
                os.dup2(opened, fd)
            os.close(opened)
        os.chdir(cwd)
    except BaseException:  # noqa: BLE001 - nowhere to report it but the exit status
        os._exit(1)
    exit_as_main(target, env)


class ForkedRun:
    """One command forked from the preloaded server, with the part of subprocess.Popen's interface tests use."""

    def __init__(self, args: list[str], target: list[str], env: dict[str, str], cwd: str,
                 output: str | None = None) -> None:
        self.args = args
        self._folder = tempfile.mkdtemp(prefix="paradiff-command-")
        self._out, self._err = (os.path.join(self._folder, name) for name in ("stdout", "stderr"))
        if output is not None:  # both streams to one file, as Popen(stdout=f, stderr=f)
            self._out = self._err = str(output)
        for path in (self._out, self._err):
            Path(path).touch()
        self._process = local_context((*PRELOAD, *KIT_PRELOAD)).Process(target=_run_in_fork,
                                                       args=(target, env, cwd, self._out, self._err))
        self._process.start()
        self.pid = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, number: int) -> None:
        """To the command's own process (as Popen.send_signal), not its workers."""
        if self.poll() is None:
            os.kill(self.pid, number)

    def kill(self) -> None:
        """The command and every process it started (its process group)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._process.join(10)
        self.poll()

    terminate = kill

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        finally:
            self._reap_group()
        return self._read(self._out), self._read(self._err)

    def _reap_group(self) -> None:
        """Workers the command left behind (it should leave none): killed, as a fresh interpreter's would be by
        their own parent-death checks."""
        try:
            os.killpg(self.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.killpg(self.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def _read(path: str) -> str:
        return Path(path).read_text(errors="replace")

    def __del__(self) -> None:
        import shutil

        shutil.rmtree(getattr(self, "_folder", ""), ignore_errors=True)


def start(target: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None,
          output: str | Path | None = None, fresh: bool = False):
    """Start `python *target` (e.g. ["-m", "paradiff.cli", "generate", ...] or ["tools/x.py", "--quick"]) with
    `env` (default: this process's environment); a Popen-like handle with text output. `output`: a file both
    streams go to (appended), instead of being captured. `fresh`: a new interpreter all the same (what a user's
    start costs: for benchmarks)."""
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    if fresh or not can_fork_workers():
        if output is not None:
            with open(output, "ab") as console:
                return subprocess.Popen([sys.executable, *target], stdout=console, stderr=console,
                                        stdin=subprocess.DEVNULL, env=env, cwd=cwd)
        return subprocess.Popen([sys.executable, *target], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, env=env, cwd=cwd)
    return ForkedRun([sys.executable, *target], list(target), env, cwd, None if output is None else str(output))


def run(target: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *target], capture_output=True, text=True, timeout=timeout, env=env)`,
    forked from the preloaded server where it may be."""
    handle = start(target, env=env, cwd=cwd)
    try:
        stdout, stderr = handle.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        handle.kill()
        raise
    return subprocess.CompletedProcess(handle.args, handle.returncode, stdout, stderr)
