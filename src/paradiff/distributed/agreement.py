"""Ranks agree or stop, without risking a hang.

Before the first collective of a load or a run, every rank publishes either a fingerprint of what it is about to do
(parallel config, model config, plan, checkpoint identity, dtype, or the initial latents' checksum) or the error it
hit, through the process group's key-value store; then it reads every other rank's entry. Store reads time out, so a
rank that failed or died is reported by rank and cause instead of leaving the others blocked in a collective; and
no collective is ever issued while ranks disagree on shapes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from paradiff.distributed.store import get_json, put_json
from paradiff.errors import DistributedError

# Keys must be unique per agreement round and identical on every participating rank: the ranks of one group run the
# same rounds in the same order, so a per-process counter per (stage, group) numbers every round alike everywhere.
_ROUNDS: dict[tuple, itertools.count] = {}
DEFAULT_TIMEOUT_S = 300.0
ENTRY = {"error": (str, None), "facts": (dict, None)}  # what each rank publishes, checked on read


def fingerprint(value: Any) -> str:
    """A short stable digest of JSON-able data (configs, plans, shapes)."""
    text = json.dumps(value, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_fingerprint(config: Any) -> str:
    """Digest of a diffusers config without its private bookkeeping (e.g. `_use_default_values`, built from a set)."""
    # transformers configs are objects with to_dict(); diffusers' are dicts
    items = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    return fingerprint({key: value for key, value in items.items() if not str(key).startswith("_")})


def tensor_checksum(tensor: torch.Tensor) -> str:
    data = tensor.detach().to("cpu").contiguous()
    raw = data.view(torch.uint8) if data.dtype != torch.bool else data.to(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16] + f":{tuple(data.shape)}:{data.dtype}"


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def agree(stage: str, facts: dict[str, Any] | None, error: BaseException | None = None,
          timeout_s: float | None = None, ranks: list[int] | None = None) -> None:
    """Publish this rank's `facts` (or its `error`) for `stage`, then check every rank's.

    Raises on every rank: the local error itself on the rank that failed; elsewhere a DistributedError naming the
    failing rank(s) and cause, or the facts on which ranks differ, or the ranks that never arrived.
    """
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    rank = dist.get_rank()
    members = tuple(ranks) if ranks is not None else tuple(range(dist.get_world_size()))
    round_id = next(_ROUNDS.setdefault((stage, members), itertools.count()))
    group_id = fingerprint(members)
    store = dist.PrefixStore(f"paradiff/agree/{stage}/{group_id}/{round_id}/", _store())
    payload = {"error": None if error is None else f"{type(error).__name__}: {error}", "facts": facts}
    put_json(store, str(rank), payload)  # JSON (non-JSON facts as their repr, which is what is compared)
    if error is not None:
        if rank != members[0]:
            store.add("left", 1)  # it reads nothing more: the first member need not wait for it (_leave_together)
        raise error
    timeout = timeout_s if timeout_s is not None else _group_timeout()
    keys = [str(r) for r in members]
    deadline = time.monotonic() + timeout
    missing = keys
    while missing:
        missing = [key for key in keys if not store.check([key])]
        if missing and time.monotonic() > deadline:
            raise DistributedError(
                f"{stage}: rank(s) {[int(k) for k in missing]} did not reach the agreement point within {timeout:.0f}s "
                "(crashed, killed, or stuck before it); stopping instead of waiting in a collective."
            )
        if missing:
            time.sleep(0.01)
    entries = {int(key): get_json(store, key, ENTRY) for key in keys}
    _leave_together(store, rank, members, stage, deadline)
    if round_id:
        # every member published this round, so every member has read the previous one: this rank's entry of it
        # goes, and the store holds at most two rounds of each agreement point however many calls a server runs
        previous = dist.PrefixStore(f"paradiff/agree/{stage}/{group_id}/{round_id - 1}/", _store())
        previous.delete_key(str(rank))
        if rank == members[0]:  # every member counted itself out of the previous round before publishing this one
            previous.delete_key("left")
    failed = {r: e["error"] for r, e in entries.items() if e["error"]}
    if failed:
        detail = "; ".join(f"rank {r}: {message}" for r, message in sorted(failed.items()))
        raise DistributedError(f"{stage}: {len(failed)} rank(s) failed, so this rank stops too. {detail}")
    mine = entries[rank]["facts"] or {}
    for key in sorted(mine):
        values = {r: (e["facts"] or {}).get(key) for r, e in entries.items()}
        if len(set(map(repr, values.values()))) > 1:
            raise DistributedError(
                f"{stage}: ranks disagree on {key}: " + ", ".join(f"rank {r}={v}" for r, v in sorted(values.items()))
                + ". Every rank must run the same configuration on the same inputs."
            )


def _leave_together(store: dist.Store, rank: int, members: tuple[int, ...], stage: str, deadline: float) -> None:
    """The first member (the rank whose process serves the store when no agent does) returns only once every member
    has read the entries: a rank that finished its script and exited at once could otherwise close the store under
    a peer still reading it ("Connection reset by peer" in that peer). The others count themselves out and go."""
    if rank != members[0]:
        store.add("left", 1)
        return
    while store.add("left", 0) < len(members) - 1:
        if time.monotonic() > deadline:
            raise DistributedError(f"{stage}: rank(s) did not finish reading the agreement within the timeout "
                                   "(crashed, killed, or stuck after publishing); stopping.")
        time.sleep(0.005)


def _group_timeout() -> float:
    """PARADIFF_TIMEOUT (seconds) if set, else 300 s: the longest a rank waits for its peers at an agreement point."""
    return float(os.environ.get("PARADIFF_TIMEOUT", DEFAULT_TIMEOUT_S))
