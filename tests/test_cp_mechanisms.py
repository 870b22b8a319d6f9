"""Context-parallel plan mechanisms that video families need, checked in one process against the arithmetic they
promise (the families' multi-process equivalence tests exercise them end to end)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from paradiff.context_parallel.apply import _split
from paradiff.context_parallel.plan import Split


def rank_of(rank: int, size: int):
    return SimpleNamespace(cp_rank=rank, cp_size=size)


def test_split_reaches_every_tensor_inside_tuples_lists_and_dicts():
    table = torch.arange(2 * 7 * 3).view(2, 7, 3)
    value = {"query": table, "key": (table, [table, "not a tensor"])}
    for rank, rows in ((0, slice(0, 4)), (1, slice(4, 7))):
        out = _split(value, Split(1), rank_of(rank, 2), "rotary_emb")
        assert torch.equal(out["query"], table[:, rows])
        assert isinstance(out["key"], tuple) and torch.equal(out["key"][0], table[:, rows])
        assert isinstance(out["key"][1], list) and torch.equal(out["key"][1][0], table[:, rows])
        assert out["key"][1][1] == "not a tensor"


def test_split_with_ndim_leaves_other_ranks_whole_inside_containers():
    per_sample, per_token = torch.ones(2, 5), torch.ones(2, 6, 5, 4)
    out = _split((per_sample, per_token), Split(2, ndim=4), rank_of(1, 2), "temb")
    assert out[0] is per_sample and out[1].shape == (2, 6, 2, 4)
