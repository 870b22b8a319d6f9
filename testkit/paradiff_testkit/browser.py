"""Debian's chromium (never `playwright install`), headless, for the web page's tests."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

# Debian's /usr/bin/chromium is a shell script: it sources /etc/chromium.d/* (which forks grep, find, findmnt, ls, tr
# and cut, and where /dev/shm is mounted twice prints "[: 25273323520: unexpected operator": findmnt answers two
# lines; harmless, the check only adds --disable-dev-shm-usage, which playwright passes anyway), adds flags for a
# desktop (GPU rasterization, extensions) and execs the binary beside it. The tests launch that binary themselves.
BINARY = Path(os.path.realpath(CHROMIUM)).parent.parent / "lib" / "chromium" / "chromium"

# Fewer processes to start, each a handshake that a starved machine slows: no zygote (a renderer is started directly;
# playwright passes --no-sandbox, which --no-zygote needs) and no GPU rasterization (software compositing; the GPU
# process then only composites). Measured on the 2-core host beside the load lane's two busy loops: launch median
# 0.8-1.3 s against 1.6-2.3 s through the wrapper, and the two zygote processes fewer.
LAUNCH_ARGS = ["--no-zygote", "--disable-gpu"]

# A launch normally takes 1-3 s (up to 12 s while 7 jobs shared the 2 cores); under the load lane one was seen to hang
# past 180 s at start-up (no window ever opened) while the next launch in the same run took seconds, and in another run
# three tries of 90 s each hung, through the wrapper. A launch is not what the tests check: each try is bounded, a later
# try starts a new browser process, and a try that times out says what the browser's processes were doing.
LAUNCH_TRIES = 3
LAUNCH_TIMEOUT_MS = 90_000


def executable() -> str:
    """The chromium binary itself where Debian's layout has it, else whatever `chromium` is."""
    return str(BINARY) if BINARY.is_file() and os.access(BINARY, os.X_OK) else CHROMIUM


def launch_chromium(playwright):
    """The browser, launched headless; raises the last launch error after `LAUNCH_TRIES` bounded tries, with a
    snapshot of the browser's processes taken just before the last try's timeout."""
    from playwright.sync_api import Error as PlaywrightError

    path = executable()
    for attempt in range(LAUNCH_TRIES):
        seen: list[str] = []
        done = threading.Event()
        watch = threading.Thread(target=_snapshot_if_slow, args=(path, done, LAUNCH_TIMEOUT_MS * 0.9 / 1000, seen),
                                 daemon=True)
        watch.start()
        try:
            return playwright.chromium.launch(executable_path=path, headless=True, timeout=LAUNCH_TIMEOUT_MS,
                                              args=LAUNCH_ARGS)
        except PlaywrightError as exc:
            if attempt == LAUNCH_TRIES - 1:
                done.set()
                watch.join(timeout=5)
                raise PlaywrightError(f"{exc}\nthe browser's processes before the timeout:\n"
                                      + ("\n".join(seen) or "(none seen)")) from exc
        finally:
            done.set()


def _snapshot_if_slow(path: str, done: threading.Event, after_s: float, seen: list[str]) -> None:
    """Unless the launch ends within `after_s`: each process of a browser playwright launched (its binary, its
    profile or its crash handler in the command line), its state and where in the kernel it waits, from /proc."""
    if done.wait(after_s):
        return
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if not any(word in command for word in (path, "playwright_chromiumdev_profile", "chrome_crashpad_handler")):
                continue
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
            wchan = (proc / "wchan").read_text()
            kind = next((arg for arg in command.split() if arg.startswith("--type=")),
                        "--type=crash handler" if "chrome_crashpad_handler" in command else "--type=browser")
            threads = len(list((proc / "task").iterdir()))
            seen.append(f"pid {proc.name} {kind[7:]}: state {state}, waits in {wchan or '-'}, {threads} threads")
        except (OSError, ValueError):
            continue
