"""CFG parallelism: each half computes one branch per step, the first step included."""

from __future__ import annotations

import pytest

import rank_cases_cfg as cases

ATOL = 1e-5
STEPS = 3


@pytest.mark.parametrize("family,compiled", [("flux2", False), ("wan", False), ("flux2", True)],
                         ids=["flux2", "wan", "flux2-compiled"])
def test_first_step_is_not_computed_twice(pools, family, compiled):
    """Cfg rank 1 learns the output's structure from a meta-device run: STEPS forwards per rank, not STEPS + 1."""
    for result in pools.get(2).run(cases.cfg_pairs, family=family, steps=STEPS, compiled=compiled):
        assert result["diff"] <= ATOL, result
        assert result["computed"] == STEPS, result


def test_without_a_meta_run_the_first_call_is_learned_once(pools):
    results = pools.get(2).run(cases.cfg_pairs, steps=STEPS, meta=False)
    assert [r["computed"] for r in results] == [STEPS, STEPS + 1], results
    for result in results:
        assert result["diff"] <= ATOL, result
