"""Fault injection run on every rank by tests/test_reliability.py."""

from __future__ import annotations

import os
import time

import torch.distributed as dist

import paradiff
from paradiff.testing.models import Lengths, build_model, make_inputs, run_forward


def fault_in_forward(kind: str, failing_rank: int = 1, mode: str = "ring") -> dict:
    """One rank raises (or exits) inside a block mid-forward; every rank reports what it saw and when."""
    model = build_model("flux2", layers=2)
    config = (paradiff.ContextParallelConfig(ring_degree=dist.get_world_size()) if mode == "ring"
              else paradiff.TensorParallelConfig(dist.get_world_size()))
    paradiff.enable_parallelism(model, config)

    def inject(_module, _args):
        if dist.get_rank() == failing_rank:
            if kind == "exit":
                os._exit(3)
            raise ValueError("injected fault in block 1")

    model.transformer_blocks[1].register_forward_pre_hook(inject)
    inputs = make_inputs("flux2", model.config, lengths=Lengths(height=4, width=4, text=6))
    start = time.monotonic()
    try:
        run_forward(model, inputs)
        message = "no error"
    except Exception as exc:  # noqa: BLE001 - the message is the result
        message = f"{type(exc).__name__}: {exc}"
    return {"rank": dist.get_rank(), "message": message, "elapsed_s": time.monotonic() - start}


def bad_input_on_one_rank(failing_rank: int = 1) -> str:
    """Only one rank passes a broken plan: every rank must stop, none may hang."""
    model = build_model("flux2")
    plan = {"transformer_blocks.*.attn.to_q": "colwise"}
    if dist.get_rank() == failing_rank:
        plan = {"transformer_blocks.*.attn.to_q": "diagonal"}
    try:
        paradiff.enable_parallelism(model, paradiff.TensorParallelConfig(dist.get_world_size()), plan=plan)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def mismatched_model(odd_rank: int = 1) -> str:
    model = build_model("flux2", heads=8 if dist.get_rank() == odd_rank else 4)
    try:
        paradiff.enable_parallelism(model, paradiff.ContextParallelConfig(ulysses_degree=dist.get_world_size()))
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def load_truncated(folder: str) -> str:
    from paradiff.testing.models import model_class

    try:
        paradiff.from_pretrained(model_class("flux2"), folder, parallel_config=paradiff.TensorParallelConfig(2))
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def agreement_store_stays_data(planted_file: str) -> dict:
    """Agreement rounds read JSON only and delete what they read: the key count after many rounds equals the count
    after two; a pickle planted where a rank's failure report goes is refused, never run."""
    import pickle

    from paradiff.distributed.agreement import agree
    from paradiff.distributed.failures import KEY, read_failures
    from paradiff.distributed.store import StoreValueError, get_json

    store = dist.distributed_c10d._get_default_store()
    counts = []
    for _ in range(8):
        agree("serve-like calls", {"latents": "same"})
        counts.append(store.num_keys())

    class Planted:
        def __reduce__(self):
            return (open, (planted_file, "w"))

    key = KEY.format(rank=dist.get_world_size() + 5)  # a key no rank writes
    if dist.get_rank() == 0:
        store.set(key, pickle.dumps(Planted()))
    agree("planted", {"ok": True})
    try:
        get_json(store, key, {"time": float, "error": str})
        refused = "read"
    except StoreValueError as exc:
        refused = str(exc)
    found = read_failures(0.0, wait_s=0.0)
    agree("read", {"ok": True})
    return {"counts": counts, "refused": refused, "found": found, "ran": os.path.exists(planted_file)}
