"""`paradiff` with injected faults, for the reliability tests and the fault benchmark; never part of a normal run.

    PARADIFF_INJECT_FAULT=1:raise python -m paradiff_testkit.faults generate --ulysses 2 ...

runs the real command, whose launcher starts its workers through this module too, so each worker installs the fault
below on its loaded pipeline and then runs the normal worker code. The variables:

- PARADIFF_INJECT_FAULT="RANK:raise|exit": that rank fails in its second transformer forward, inside the first block
  (raise: a RuntimeError; exit: os._exit(9), as if killed); "RANK:seed": it starts from other latents;
  "all:alike": every rank raises the same ValueError there (a request's own fault, as bad inputs would);
  "RANK:device": it raises a device's error ("CUDA error: ..."), a rank's fault even in a replica of one rank.
  "@N" after the kind moves the fault to the Nth forward; several faults are separated by commas ("all:alike,1:raise@4").
- PARADIFF_FAULT_STAMP=FILE: the rank writes the moment of the fault (time.time()) there.
- PARADIFF_FAULT_GATE=FILE: the rank fails only once FILE exists (waiting at most 120 s), so that a test can first
  bring the server to the state it means to fault in (a second request queued, say).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

FAULT_KINDS = ("raise", "exit", "seed", "alike", "device")


def install_fault_from_env(pipeline, rank: int) -> None:
    """Install the fault PARADIFF_INJECT_FAULT asks for on `pipeline.transformer`, if it targets `rank`."""
    spec = os.environ.get("PARADIFF_INJECT_FAULT")
    if not spec:
        return
    for one in spec.split(","):
        target, _, kind = one.partition(":")
        kind, _, call = kind.partition("@")
        if kind not in FAULT_KINDS or not (target.isdigit() or target == "all") or not (call.isdigit() or not call):
            raise ValueError(f"PARADIFF_INJECT_FAULT={spec!r}: expected RANK:KIND[@N] (RANK a number or 'all', KIND "
                             f"one of {FAULT_KINDS}), separated by commas")
        if target == "all" or int(target) == rank:
            install_fault(pipeline.transformer, rank, kind, os.environ.get("PARADIFF_FAULT_STAMP"), int(call or 2),
                          os.environ.get("PARADIFF_FAULT_GATE"))


def install_fault(transformer: torch.nn.Module, rank: int, kind: str, stamp_file: str | None = None,
                  call: int = 2, gate_file: str | None = None) -> None:
    def stamp() -> None:
        if gate_file:
            deadline = time.monotonic() + 120
            while not Path(gate_file).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        if stamp_file:
            Path(stamp_file).write_text(repr(time.time()))

    forwards: list[int] = []
    block_calls: list[int] = []

    def shift_latents(_module, args, kwargs):
        forwards.append(1)
        if len(forwards) == 1:
            stamp()
            kwargs["hidden_states"] = kwargs["hidden_states"] + 1.0
            return args, kwargs
        return None

    def fail_in_block(_module, _args):
        # inside the forward (first transformer block), where a real fault would happen
        block_calls.append(1)
        if len(block_calls) == call:
            stamp()
            if kind == "exit":
                os._exit(9)
            if kind == "alike":
                raise ValueError("injected request fault (the same on every rank)")
            if kind == "device":
                raise RuntimeError(f"CUDA error: injected device fault on rank {rank}")
            raise RuntimeError(f"injected fault on rank {rank}")

    if kind == "seed":
        transformer.register_forward_pre_hook(shift_latents, with_kwargs=True, prepend=True)
    else:
        blocks = next(m for m in transformer.modules() if isinstance(m, torch.nn.ModuleList))
        blocks[0].register_forward_pre_hook(fail_in_block)


def main(argv: list[str] | None = None) -> int:
    from paradiff.cli import main as paradiff_main

    return paradiff_main(argv, worker_module="paradiff_testkit.faults", on_pipeline_loaded=install_fault_from_env)


if __name__ == "__main__":
    sys.exit(main())
