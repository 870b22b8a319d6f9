"""A worker for the launcher's own tests (`python -m paradiff_testkit.launched SCENARIO FOLDER`), without torch.

- `follower-dies`: rank 1 writes FOLDER/died and exits with code 9; rank 0, once it has seen that file, takes the
  time a server's rank 0 takes to answer its clients (longer than the launcher's dead-peer grace), writes
  FOLDER/answered and exits 0.
- `leader-dies`: rank 0 exits with code 9 at once; rank 1 waits (bounded) for a file that never comes.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ANSWER_S = 1.5  # > the tests' dead-peer grace
WAIT_S = 120.0  # a bound on every wait here: the launcher is expected to end it long before


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
    raise SystemExit(f"unknown scenario {scenario!r}: follower-dies or leader-dies")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
