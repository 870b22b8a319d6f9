"""Measured I/O of a TP load, run on every rank by tests/test_load_io.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

import paradiff
from paradiff.io.checkpoint import Checkpoint
from paradiff.runtime.state import get_state
from paradiff.testing.models import model_class


def _rchar() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def measured_tp_load(folder: str, tp: int) -> dict:
    cls = model_class("flux2")
    dist.barrier()
    before = _rchar()
    model = paradiff.from_pretrained(cls, folder, parallel_config=paradiff.TensorParallelConfig(tp))
    read = _rchar() - before
    checkpoint = Checkpoint(folder)
    resolved = get_state(model).tp_plan
    share = sum(
        info.nbytes if resolved.spec_for(name) is None
        else torch.Size(resolved.spec_for(name).local_shape(info.shape)).numel() * info.nbytes // max(1, torch.Size(info.shape).numel())
        for name, info in checkpoint.tensors.items()
    )
    headers = sum(8 + int.from_bytes(open(path, "rb").read(8), "little") for path in {i.file for i in checkpoint.tensors.values()})
    checkpoint.close()
    return {"read": read, "share": share, "headers": headers,
            "total": sum(i.nbytes for i in checkpoint.tensors.values())}
