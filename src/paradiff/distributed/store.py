"""The key-value store the ranks share, and what crosses it: typed JSON checked on read, or raw bytes. Never pickle:
a value read from the store is data, whoever wrote it.

Under paradiff's own launcher rank 0 hosts the store and listens on loopback only (127.0.0.1), so nothing outside
the machine can reach it. Under torchrun the agent hosts it on the rendezvous network, which must be private.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from typing import Any

import torch.distributed as dist

LOOPBACK = ("127.0.0.1", "localhost")


class StoreValueError(ValueError):
    """A store value that is not the JSON its reader expects (a bug, or a value planted by someone else)."""


def open_store(rank: int, world: int, timeout_s: float) -> dist.Store:
    """The job's TCP store from MASTER_ADDR / MASTER_PORT: rank 0 hosts it under paradiff's launcher, bound to
    127.0.0.1 when MASTER_ADDR is a loopback address; under torchrun the agent hosts it
    (TORCHELASTIC_USE_AGENT_STORE) and every rank is a client."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    if not master or host not in LOOPBACK:
        return dist.TCPStore(host, port, world, is_master=master, timeout=timeout)
    # TCPStore given only a host name listens on every interface; a socket bound here listens on loopback alone
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, timeout=timeout,
                          master_listen_fd=listener.detach())
    return store


def store_client(timeout_s: float) -> dist.Store:
    """Another connection to the job's store (MASTER_ADDR / MASTER_PORT): a thread that polls the store while another
    thread of the process blocks in it (a rendezvous, a wait) needs its own, since one client's operations run one
    after the other."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def put_json(store: dist.Store, key: str, value: Any) -> None:
    store.set(key, json.dumps(value, default=repr))


def get_json(store: dist.Store, key: str, schema: dict[str, Any] | type | tuple) -> Any:
    """The JSON value at `key`, checked against `schema`: a type (or tuple of types) for a scalar, or
    {field: type or tuple of types} for an object (every field required, no other field)."""
    raw = store.get(key)
    try:
        value = json.loads(raw)
    except ValueError:
        raise StoreValueError(f"store key {key!r}: not JSON ({len(raw)} bytes)") from None
    return checked(value, schema, key)


def checked(value: Any, schema: dict[str, Any] | type | tuple, where: str) -> Any:
    if not isinstance(schema, dict):
        if not _is(value, schema):
            raise StoreValueError(f"store key {where!r}: expected {_names(schema)}, got {type(value).__name__}")
        return value
    if not isinstance(value, dict) or set(value) != set(schema):
        got = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise StoreValueError(f"store key {where!r}: expected an object with fields {sorted(schema)}, got {got}")
    for field, kind in schema.items():
        if not _is(value[field], kind):
            raise StoreValueError(f"store key {where!r}: field {field!r} should be {_names(kind)}, "
                                  f"got {type(value[field]).__name__}")
    return value


def _is(value: Any, kind: type | tuple) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        return False  # JSON true is not a number here
    if float in kinds and isinstance(value, int):
        return True
    return any(value is None if k is None else isinstance(value, k) for k in kinds)


def _names(kind: type | tuple) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is None else k.__name__ for k in kinds)
