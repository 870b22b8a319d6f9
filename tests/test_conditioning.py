"""Conditioning inputs (reference images, masks, image-to-video) on split pipelines, the CLI flags that pass them,
and audio pipelines' WAV files."""

from __future__ import annotations

import pytest

import rank_cases_conditioning as cases

RTOL = 1e-5
CP_MODES = {"ulysses2": dict(ulysses=2), "ring2": dict(ring=2)}


@pytest.mark.parametrize("case", sorted(cases.CASES))
def test_conditioned_pipeline_under_cp_equals_single_process(pools, tiny_pipeline_folders, case):
    folder = str(tiny_pipeline_folders[cases.CASES[case]["family"]])
    results = pools.get(2).run(cases.conditioned_equivalence, case=case, folder=folder, modes=CP_MODES)
    (tokens,) = results[0]["tokens"]
    assert tokens % 2 == 1, results[0]  # the ranks' shares are uneven
    for mode in CP_MODES:  # each rank holds its own share of the image + condition tokens, together all of them
        shares = [result["modes"][mode]["local_tokens"] for result in results]
        assert all(len(share) == 1 for share in shares) and sum(share[0] for share in shares) == tokens, shares
    for result in results:
        for mode, outcome in result["modes"].items():
            assert outcome["max_abs_diff"] <= RTOL * max(outcome["scale"], 1.0), (case, mode, outcome)
