"""Run by tests/test_doc_snippets.py on every torchrun worker (tests/torchrun_node.py): each script of a folder, in
turn, in a child forked from this worker, with torchrun's environment but a fresh rendezvous port per script (every
script makes its own process group, as a user's would); exits 1 if any script failed on this rank.

    python tests/torchrun_node.py --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        -m doc_snippet_runner FOLDER
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from paradiff.distributed.spawn import exit_as_main, free_port


def _exchange_store() -> dist.TCPStore:
    """A store every worker reaches: torchrun's agent store when it hosts one, else one rank 0 hosts."""
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(address, port, world, is_master=not hosted and rank == 0,
                         timeout=datetime.timedelta(seconds=300))


def main(folder: str) -> int:
    store = _exchange_store()
    rank = int(os.environ["RANK"])
    failed = []
    for index, script in enumerate(sorted(Path(folder).glob("*.py"))):
        if rank == 0:
            store.set(f"doc-snippet/{index}/port", str(free_port()))
        port = store.get(f"doc-snippet/{index}/port").decode()
        env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}
        env["MASTER_PORT"] = port
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.chdir(script.parent)
            exit_as_main([str(script)], env)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(f"doc snippet {script.name} rank {rank}: exit {code} ({time.monotonic() - started:.1f} s)", flush=True)
        if code != 0:
            failed.append(script.name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
