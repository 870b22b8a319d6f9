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


# --- whole pipelines --------------------------------------------------------------------------------------------

RELATIVE = 1e-5
BATCH_FAMILIES = ("sd3", "pixart_sigma", "sana", "ltx")  # one transformer call per step on [uncond, cond]
TWO_CALL_FAMILIES = ("flux2_klein",)  # new two-call rules (Flux / Qwen / Wan: tests/test_pipelines.py)


def _check_pipeline(result: dict, family: str, steps: int = STEPS) -> None:
    assert result["diff"] <= RELATIVE * max(result["scale"], 1.0), result
    if family in BATCH_FAMILIES:
        assert result["style"] == "BatchCfgSplitter", result
        assert result["reference_batches"] == [2] * steps, result  # diffusers: the whole [uncond, cond] batch
        assert result["batches"] == [1] * steps, result  # each cfg rank: its half, once per step
    else:
        assert result["style"] == "CfgSplitter", result
        assert result["reference_batches"] == [1] * (2 * steps), result
        assert result["batches"] == [1] * steps, result  # one of the two calls per step
    assert result["computed"] == steps, result


@pytest.mark.parametrize("family", BATCH_FAMILIES + TWO_CALL_FAMILIES)
def test_pipeline_at_cfg2_matches_single_process(pools, tiny_pipeline_folders, family):
    results = pools.get(2).run(cases.pipeline_cfg, family=family, folder=str(tiny_pipeline_folders[family]),
                               degrees=dict(cfg=2), steps=STEPS)
    assert sorted(r["cfg_rank"] for r in results) == [0, 1]
    for result in results:
        _check_pipeline(result, family)
        if family in BATCH_FAMILIES:  # cfg rank r's first block ran on exactly half r of diffusers' batch
            assert result["block_diff"] <= RELATIVE, result


@pytest.mark.parametrize("family", ("sd3", "pixart_sigma", "sana", "flux2_klein"))
def test_pipeline_at_cfg2_x_tp2_matches_single_process(pools, tiny_pipeline_folders, family):
    results = pools.get(4).run(cases.pipeline_cfg, family=family, folder=str(tiny_pipeline_folders[family]),
                               degrees=dict(cfg=2, tp=2), steps=STEPS)
    assert sorted(r["cfg_rank"] for r in results) == [0, 0, 1, 1]
    for result in results:
        _check_pipeline(result, family)


@pytest.mark.parametrize("family,reason", [
    ("flux2", "Flux2Pipeline never runs classifier-free guidance (guidance-distilled"),
    ("hunyuanvideo", "HunyuanVideoPipeline is not classified for CFG parallelism yet (classified: "),
], ids=["never-guides", "not-classified"])
def test_cfg2_refusals_say_why(pools, tiny_pipeline_folders, family, reason):
    for message in pools.get(2).run(cases.load_refusal, folder=str(tiny_pipeline_folders[family]),
                                    degrees=dict(cfg=2)):
        assert message.startswith(f"ParallelConfigError: cfg_degree=2: {reason}"), message
        assert message.endswith("; use cfg_degree=1."), message
