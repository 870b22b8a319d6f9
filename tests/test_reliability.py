"""Failing ranks never hang the others: every rank ends with an error naming the failing rank, in bounded time."""

from __future__ import annotations

import shutil

import pytest

import rank_cases_faults as cases
from paradiff.testing.dist import RankPool

COLLECTIVE_TIMEOUT_S = 5.0


@pytest.fixture
def fault_pool():
    """A fresh pool for each injected fault: a cut-off collective leaves gloo pairs unusable."""
    pool = RankPool(2, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    yield pool
    pool.close(force=True)
    assert not any(p.is_alive() for p in pool.processes), "a worker process was left running"


@pytest.fixture(scope="module")
def agree_pool():
    """Agreement failures issue no collective, so one pool serves all of them."""
    pool = RankPool(2, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    yield pool
    pool.close(force=True)
    assert not any(p.is_alive() for p in pool.processes), "a worker process was left running"


@pytest.mark.parametrize("mode", ["ring", "tp"])
def test_exception_mid_forward_names_the_failing_rank(fault_pool, mode):
    outcomes = fault_pool.run_outcomes(cases.fault_in_forward, timeout_s=60, kind="raise", mode=mode)
    (ok0, rank0), (ok1, rank1) = outcomes
    assert ok0 and ok1, outcomes
    assert rank1["message"] == "ValueError: injected fault in block 1"
    assert "DistributedError" in rank0["message"] and "rank 1 failed with ValueError: injected fault" in rank0["message"]
    assert rank0["elapsed_s"] < COLLECTIVE_TIMEOUT_S + 10, rank0


def test_killed_rank_stops_the_others(fault_pool):
    outcomes = fault_pool.run_outcomes(cases.fault_in_forward, timeout_s=60, kind="exit")
    (ok0, rank0), (ok1, rank1) = outcomes
    assert not ok1 and rank1 == "died with exit code 3"
    assert ok0 and "DistributedError" in rank0["message"] and "crashed or was killed" in rank0["message"], rank0
    assert rank0["elapsed_s"] < COLLECTIVE_TIMEOUT_S + 10, rank0


def test_bad_input_on_one_rank_stops_every_rank(agree_pool):
    messages = [value for ok, value in agree_pool.run_outcomes(cases.bad_input_on_one_rank, timeout_s=60)]
    assert messages[1].startswith("PlanError: Unknown tensor-parallel style 'diagonal'"), messages
    assert messages[0].startswith("DistributedError: paradiff.enable_parallelism: 1 rank(s) failed"), messages
    assert "rank 1: PlanError: Unknown tensor-parallel style 'diagonal'" in messages[0]


def test_agreements_keep_the_store_flat_and_read_only_json(agree_pool, tmp_path):
    """Many agreement rounds leave as many store keys as two; a pickle planted in the store is refused, not run."""
    planted = tmp_path / "planted"
    for result in agree_pool.run(cases.agreement_store_stays_data, timeout_s=60, planted_file=str(planted)):
        # at most two rounds of keys (a peer may already be one round ahead); without deletion +2 per round
        assert max(result["counts"]) <= result["counts"][1] + 2, result["counts"]
        assert "not JSON" in result["refused"], result
        assert result["found"] == {} and not result["ran"], result
    assert not planted.exists()


def test_ranks_with_different_models_refuse_to_start(agree_pool):
    messages = [value for ok, value in agree_pool.run_outcomes(cases.mismatched_model, timeout_s=60)]
    for message in messages:
        assert "ranks disagree on model config" in message and "rank 0=" in message and "rank 1=" in message, message


def test_truncated_shard_is_caught_on_every_rank_before_use(agree_pool, checkpoints, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(checkpoints[("flux2", "sharded")], folder)
    shard = sorted(folder.glob("*-00002-of-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    messages = [value for ok, value in agree_pool.run_outcomes(cases.load_truncated, timeout_s=60, folder=str(folder))]
    for message in messages:
        assert message.startswith("CheckpointError") and shard.name in message and "truncated" in message, message
