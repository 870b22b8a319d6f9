"""A worker for the launcher's own tests (`python -m paradiff_testkit.launched SCENARIO FOLDER`), without torch.

- `follower-dies`: rank 1 writes FOLDER/died and exits with code 9; rank 0, once it has seen that file, takes the
  time a server's rank 0 takes to answer its clients (longer than the launcher's dead-peer grace), writes
  FOLDER/answered and exits 0.
- `leader-dies`: rank 0 exits with code 9 at once; rank 1 waits (bounded) for a file that never comes.
- `signals`: rank 0 writes the name of each SIGTERM, SIGUSR1 or SIGUSR2 it gets to FOLDER/signals (a line each),
  after FOLDER/ready (written once rank 1 ignores SIGTERM, as a server's other ranks do, and said so in
  FOLDER/ready1); it exits 0 once it has two, or SECOND_S after the first; rank 1 exits with rank 0.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ANSWER_S = 1.5  # > the tests' dead-peer grace
WAIT_S = 120.0  # a bound on every wait here: the launcher is expected to end it long before
SECOND_S = 5.0  # how long rank 0 waits for a second signal after the first


def wait_for(path: Path) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.02)
    return False


def main(scenario: str, folder: Path) -> int:
    rank = int(os.environ["RANK"])
    if scenario == "follower-dies":
        if rank == 1:
            (folder / "died").write_text("")
            os._exit(9)
        if not wait_for(folder / "died"):
            return 2
        time.sleep(ANSWER_S)
        (folder / "answered").write_text("")
        return 0
    if scenario == "leader-dies":
        if rank == 0:
            os._exit(9)
        return 0 if wait_for(folder / "never") else 2
    if scenario == "signals":
        return signals(rank, folder)
    raise SystemExit(f"unknown scenario {scenario!r}: follower-dies, leader-dies or signals")


def signals(rank: int, folder: Path) -> int:
    import signal

    if rank != 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (folder / f"ready{rank}").write_text("")
        return 0 if wait_for(folder / "finished") else 2
    got: list[str] = []

    def record(number, _frame) -> None:
        name = signal.Signals(number).name  # its own: another signal's handler may run between these lines
        got.append(name)
        with open(folder / "signals", "a") as log:
            log.write(name + "\n")

    for number in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, record)
    wait_for(folder / "ready1")  # every rank has its handlers (rank 1 ignores SIGTERM) before the test signals
    (folder / "ready").write_text("")
    deadline = time.monotonic() + WAIT_S
    while len(got) < 2 and time.monotonic() < deadline:
        if got:
            deadline = min(deadline, time.monotonic() + SECOND_S)
        time.sleep(0.02)
    (folder / "finished").write_text("")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
