"""One node of tests/test_cli.py::test_two_nodes_on_loopback: torchrun itself (torch.distributed.run's argument
parser and config, its c10d rendezvous and elastic agent, the environment it gives each worker), except that the
worker runs `-m MODULE ARGS` in processes forked from this one, where torchrun would start a fresh interpreter. The
test forks this node from its preloaded server (paradiff_testkit/command.py), so the worker starts with torch, diffusers and
paradiff imported: each fresh worker spent about 5 s of CPU on those imports, and the test's two nodes started
theirs at once on a 2-core machine.

    python tests/torchrun_node.py TORCHRUN_OPTIONS -m MODULE ARGS
"""

from __future__ import annotations

import os
import sys

from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser

from paradiff.distributed.spawn import exit_as_main


def run_module(*command: str) -> None:
    """torchrun's worker command line after the interpreter (["-u", "-m", MODULE, *ARGS]) run as `python -m` would,
    in a child forked from this worker (the command ends in os._exit, which would leave the agent waiting for this
    function's return value); its non-zero exit status fails the worker."""
    target = list(command[command.index("-m"):])
    pid = os.fork()
    if pid == 0:
        exit_as_main(target, dict(os.environ))
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code != 0:
        raise SystemExit(f"{' '.join(target)} exited with status {code}")


if __name__ == "__main__":
    config, _interpreter, command = config_from_args(get_args_parser().parse_args())
    config.start_method = "fork"
    elastic_launch(config, entrypoint=run_module)(*command)
