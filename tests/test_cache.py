"""Step caches on parallel models: every rank takes the decision a single process would take, at the same step."""

from __future__ import annotations

import pytest
import torch

import paradiff
import rank_cases_cache as cases
from paradiff.testing.models import build_model, make_inputs, run_forward

ATOL = 1e-5
WORLD2 = [dict(family=family, **degrees) for family in ("flux2", "wan")
          for degrees in ({}, dict(tp=2), dict(ulysses=2), dict(ring=2))]
WORLD4 = [dict(family=family, tp=2, ulysses=2) for family in ("flux2", "wan")]


@pytest.fixture(scope="module")
def cached(pools) -> dict:
    """label -> per-rank results, all cases of one world size in one call."""
    by_label: dict[str, list[dict]] = {}
    for world, batch in ((2, WORLD2), (4, WORLD4)):
        for rank_result in pools.get(world).run(cases.cached_equivalence_many, cases=batch):
            for label, result in rank_result.items():
                by_label.setdefault(label, []).append(result)
    return by_label


@pytest.mark.parametrize("cache", ["fbc", "taylorseer"])
@pytest.mark.parametrize("case", WORLD2 + WORLD4, ids=cases._label)
def test_cached_parallel_skips_the_steps_a_single_process_skips(cached, case, cache):
    for result in cached[cases._label(case)]:
        run = result[cache]
        assert run["actual"] == run["expected"], run  # the same steps computed and skipped
        assert True in run["actual"][1:] and False in run["actual"], run  # the run skips some steps, not all
        assert run["diff"] <= ATOL, run
        assert run["uncached_diff"] > 1e-4, run  # skipping really changed the result


@pytest.fixture(scope="module")
def straddling(pools) -> list[dict]:
    return pools.get(2).run(cases.straddling_metric)


@pytest.mark.parametrize("label", ["agreed compute, a rank alone would skip", "agreed skip, a rank alone would compute"])
def test_ranks_follow_the_agreed_decision_when_their_own_measure_disagrees(straddling, label):
    """No hang, no divergence: each rank's own measure says otherwise at step 1, the agreed one decides."""
    alone = [result[label]["alone"][1] for result in straddling]
    assert alone[0] != alone[1], straddling  # the premise: ranks deciding alone would disagree
    for result in straddling:
        run = result[label]
        assert run["actual"] == run["expected"], run  # as diffusers' own cache in one process
        assert run["diff"] <= ATOL, run
    assert straddling[0][label]["actual"] == straddling[1][label]["actual"]


def test_deciding_alone_would_make_ranks_disagree(straddling):
    """Without the reduction the ranks disagree; the check that catches it raises on every rank (no hang)."""
    for result in straddling:
        assert result["alone_error"] is not None, result
        assert "ranks disagree on compute the remaining blocks: rank 0=False, rank 1=True" in result["alone_error"]


def test_unsupported_cache_is_refused_before_any_hook(pools):
    for message in pools.get(2).run(cases.unsupported_cache):
        assert "PyramidAttentionBroadcastConfig is not supported" in message, message
        assert "FirstBlockCacheConfig" in message and "TaylorSeerCacheConfig" in message, message


def test_flux2_first_block_cache_skips_exactly():
    """diffusers' own first-block cache raises on FLUX.2 (joint-sequence tail); paradiff's repair must give back
    the full model's output when the skipped step's input equals the last computed one."""
    from diffusers import FirstBlockCacheConfig

    model = build_model("flux2", layers=2, single_layers=2)
    inputs = make_inputs("flux2", model.config, batch=2)
    expected = run_forward(model, inputs)
    monitor = paradiff.enable_cache(model, FirstBlockCacheConfig(threshold=0.5))
    with model.cache_context("cond"):
        computed = run_forward(model, inputs)
        skipped = run_forward(model, inputs)
    assert [d.computed for d in monitor.decisions] == [True, False]
    assert torch.allclose(computed, expected, atol=0, rtol=0)
    assert torch.allclose(skipped, expected, atol=1e-6, rtol=0)


def test_taylorseer_on_blocks_that_return_none():
    """Kandinsky 6's video blocks return (video, None) without audio; diffusers' TaylorSeer hook fails on the None.
    With the same input every step the Taylor series is flat, so a predicted step must equal the full forward."""
    from diffusers import TaylorSeerCacheConfig

    from paradiff.plan_tools.family_examples import build_example, example_inputs, forward

    model = build_example("kandinsky6", "kandinsky6-video")
    inputs = example_inputs("kandinsky6", "kandinsky6-video", model.config)
    expected = forward(model, inputs)
    config = TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, max_order=1,
                                   taylor_factors_dtype=torch.float32,
                                   cache_identifiers=paradiff.block_identifiers(model))
    monitor = paradiff.enable_cache(model, config)
    with model.cache_context("cond"):
        outputs = [forward(model, inputs) for _ in range(5)]
    assert False in [d.computed for d in monitor.decisions] and True in [d.computed for d in monitor.decisions]
    for output in outputs:
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(output, expected, strict=True))
    model.disable_cache()
    assert all(torch.equal(a, b) for a, b in zip(forward(model, inputs), expected, strict=True))


@pytest.mark.parametrize("family,example,reason", [
    ("chroma", "chroma", "ChromaTransformerBlock .* is not in diffusers' TransformerBlockRegistry"),
    ("kandinsky5", "kandinsky-5", "passes `hidden_states` to Kandinsky5TransformerDecoderBlock"),
])
def test_first_block_cache_refuses_blocks_diffusers_cannot_read(family, example, reason):
    """diffusers 0.42's first-block cache knows a fixed list of block classes; for the others it fails with a bare
    ValueError (at enable time, or at the first step): paradiff says why, and what caches every family."""
    from diffusers import FirstBlockCacheConfig

    from paradiff.plan_tools.family_examples import build_example

    model = build_example(family, example)
    with pytest.raises(paradiff.ParallelConfigError, match=reason.replace("(", r"\(")) as raised:
        paradiff.enable_cache(model, FirstBlockCacheConfig(threshold=0.1))
    assert "cache_identifiers=paradiff.block_identifiers(model)" in str(raised.value)
    assert model._cache_config is None  # refused before any hook was placed
