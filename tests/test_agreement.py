"""distributed/agreement.py in one process: a peer rank played by a thread on an in-memory store."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from paradiff.distributed import agreement
from paradiff.errors import DistributedError


class PeerOnWait(dist.Store):
    """A store that lets the peer (rank 1) arrive only once rank 0 waits in the store: rank 0 must wait there."""

    def __init__(self, peer) -> None:
        super().__init__()
        self.inner = dist.HashStore()
        self.peer = peer
        self.waited = threading.Event()

    def set(self, key, value):
        self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def add(self, key, value):
        return self.inner.add(key, value)

    def check(self, keys):
        return self.inner.check(keys)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def wait(self, keys, timeout=timedelta(seconds=30)):
        if not self.waited.is_set():
            self.waited.set()
            self.peer(self)
        self.inner.wait(keys, timeout)


@pytest.fixture
def two_ranks(monkeypatch):
    """This process is rank 0 of 2; sleeping is refused (agreement waits in the store, it does not poll)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def no_sleep(seconds):
        raise AssertionError(f"agreement polled (slept {seconds}s) instead of waiting in the store")

    monkeypatch.setattr(agreement.time, "sleep", no_sleep)

    def use(store):
        monkeypatch.setattr(agreement, "_store", lambda: store)

    return use


def test_agreement_waits_in_the_store_and_names_the_rank_that_never_came(two_ranks):
    stage = "test_agreement"

    def peer_arrives(store):  # rank 1 publishes the same facts and counts itself out, as agree() does there
        prefix = dist.PrefixStore(f"paradiff/agree/{stage}/{agreement.fingerprint((0, 1))}/0/", store)
        prefix.set("1", '{"error": null, "facts": {"x": 1}}')
        prefix.add("left", 1)
        prefix.set("all left", "")

    store = PeerOnWait(lambda s: threading.Thread(target=peer_arrives, args=(s,)).start())
    two_ranks(store)
    agreement.agree(stage, {"x": 1}, timeout_s=60)
    assert store.waited.is_set()

    two_ranks(PeerOnWait(lambda s: None))  # rank 1 never arrives: named, after the timeout, without polling
    with pytest.raises(DistributedError, match=r"rank\(s\) \[1\] did not reach the agreement point within 0s"):
        agreement.agree("test_agreement_absent", {"x": 1}, timeout_s=0.2)
