"""paradiff.compile: every parallel mode compiles without a graph break inside a block and matches eager.

Equivalence runs without inductor, whose C++ compilation of every case would take minutes on CI's CPUs: the
4-rank cases, which compose every parallel op (TP's all-reduces with Ulysses, ring with Ulysses, and the cache),
with backend="aot_eager" (Dynamo + AOTAutograd + functionalization, i.e. everything torch.compile does up to code
generation); the 2-rank cases, one parallel mode each, with backend="eager" (Dynamo's tracing, guards and graphs, run
as traced: the graph breaks, graph counts and ops checked below are Dynamo's graphs either way, and AOTAutograd
would double their compile time). One inductor case checks that the functional collectives and the CP attention op
also lower to real kernels.
"""

from __future__ import annotations

import pytest

from paradiff.config import mode_name

import rank_cases_compile as cases

REL_TOL = 1e-4  # compiled vs eager, relative to the output's largest magnitude
SINGLE_TOL = 1e-5  # and, as everywhere, parallel vs single process
WORLD2 = [dict(family=family, **degrees) for family in ("flux2", "wan")
          for degrees in ({}, dict(tp=2), dict(ulysses=2), dict(ring=2))]
WORLD4 = [dict(family="flux2", tp=2, ulysses=2, cache=True), dict(family="wan", tp=2, ulysses=2, cache=True),
          dict(family="flux2", ring=2, ulysses=2)]
GRAPHS = {"flux2": 2, "wan": 1}  # one graph per block class (Flux2: double- and single-stream), shared by all blocks


@pytest.fixture(scope="module")
def compiled(pools) -> dict:
    """label -> per-rank results; all cases of one world size in one call (rank processes compile once each). A case
    without parallel degrees is the same on every rank and runs on the first rank only: one result."""
    by_label: dict[str, list[dict]] = {}
    for world, batch, backend in ((2, WORLD2, "eager"), (4, WORLD4, "aot_eager")):
        for rank_result in pools.get(world).run(cases.compiled_vs_eager, cases=batch, backend=backend, timeout_s=600):
            for label, result in rank_result["results"].items():
                by_label.setdefault(label, []).append(result)
    return by_label


def _label(case: dict) -> str:
    order = ("tp", "ring", "ulysses")
    return f"{case['family']}:{mode_name({k: case.get(k, 1) for k in order}, order=order)}"


@pytest.mark.parametrize("case", WORLD2 + WORLD4, ids=_label)
def test_compiled_matches_eager_without_graph_breaks(compiled, case):
    label = _label(case)
    for result in compiled[label]:
        assert result["graph_breaks"] == 0, result
        assert result["graphs"] == GRAPHS[case["family"]], result  # blocks share their graph: no recompilation
        assert result["vs_eager"] <= REL_TOL and result["repeat"] == 0.0, result
        assert result["vs_single"] <= SINGLE_TOL, result


@pytest.mark.parametrize("case", WORLD2 + WORLD4, ids=_label)
def test_compiled_graphs_hold_the_parallel_ops(compiled, case):
    """TP's all-reduces are graph ops (functional collectives); CP attention is one custom op per attention call."""
    for result in compiled[_label(case)]:
        cp = case.get("ring", 1) * case.get("ulysses", 1) > 1
        assert (result["all_reduce_ops"] > 0) == (case.get("tp", 1) > 1), result
        assert (result["cp_attention_ops"] > 0) == cp, result
        assert (result["sdpa_ops"] > 0) == (not cp), result  # under CP, no attention escapes the interception


@pytest.mark.parametrize("case", [case for case in WORLD4 if case.get("cache")], ids=_label)
def test_compiled_and_cached_skips_the_steps_eager_single_process_skips(compiled, case):
    for result in compiled[_label(case)]:
        cached = result["cache"]
        assert cached["actual"] == cached["expected"] and False in cached["actual"], cached
        assert cached["diff"] <= REL_TOL, cached


def test_compile_refuses_a_model_without_blocks_and_a_second_compile():
    import torch

    import paradiff
    from paradiff.testing.models import build_model

    with pytest.raises(paradiff.ParallelConfigError, match="Linear has no repeated blocks to compile"):
        paradiff.compile(torch.nn.Linear(2, 2))
    model = paradiff.compile(build_model("wan"), backend="aot_eager")  # lazy: nothing is traced before a call
    with pytest.raises(paradiff.ParallelConfigError, match="already compiled by paradiff.compile"):
        paradiff.compile(model)


def test_compile_after_enable_cache_keeps_the_cache_outside_the_graphs():
    """The cache's decision is data-dependent (a graph break by nature): it must wrap the compiled blocks."""
    import torch
    from diffusers import FirstBlockCacheConfig

    import paradiff
    from paradiff.testing.models import build_model, make_inputs, run_forward
    from rank_cases_cache import SHAPE as denoise_shape

    model = build_model("flux2")
    # denoise's input shape: the next test's compiled blocks (same process) reuse these graphs instead of retracing
    inputs = make_inputs("flux2", model.config, batch=2, lengths=denoise_shape)
    expected = run_forward(model, inputs)
    paradiff.enable_cache(model, FirstBlockCacheConfig(threshold=0.5))
    paradiff.compile(model, backend="aot_eager")
    first, second = run_forward(model, inputs), run_forward(model, inputs)
    assert [d.computed for d in paradiff.cache_monitor(model).decisions] == [True, False]
    assert torch.allclose(first, expected, rtol=0, atol=1e-6) and torch.allclose(second, expected, rtol=0, atol=1e-6)


def test_compiled_model_takes_taylorseer_on_whole_blocks():
    """TaylorSeer on whole blocks wraps the compiled blocks (its schedule stays eager): same latents and steps as
    eager; on attention modules (diffusers' default patterns) it would sit inside a block's one graph: refused."""
    import torch
    from diffusers import TaylorSeerCacheConfig

    import paradiff
    from paradiff.testing.models import build_model
    from rank_cases_cache import denoise

    def config(identifiers):
        return TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, max_order=1,
                                     taylor_factors_dtype=torch.float32, cache_identifiers=identifiers)

    eager = build_model("flux2")
    identifiers = paradiff.block_identifiers(eager)
    assert identifiers == [r"single_transformer_blocks\.\d+", r"transformer_blocks\.\d+"]
    eager_monitor = paradiff.enable_cache(eager, config(identifiers))
    expected = denoise(eager, "flux2")
    compiled = paradiff.compile(build_model("flux2"), backend="aot_eager")
    monitor = paradiff.enable_cache(compiled, config(identifiers))
    actual = denoise(compiled, "flux2")
    assert [d.computed for d in monitor.decisions] == [d.computed for d in eager_monitor.decisions]
    assert False in [d.computed for d in monitor.decisions]
    assert float((actual - expected).abs().max() / expected.abs().max()) <= REL_TOL

    compiled.disable_cache()
    with pytest.raises(paradiff.ParallelConfigError,
                       match=r"hooks `transformer_blocks\.0\.attn`, inside the compiled block `transformer_blocks\.0`"):
        paradiff.enable_cache(compiled, config(None))  # diffusers' default: `^transformer_blocks.*attn`, ...
    assert compiled._cache_config is None  # the refused cache is not left half-enabled
    uncompiled = build_model("flux2")
    uncompiled.enable_cache(config(None))  # enabled first, then compiled: refused the same way
    with pytest.raises(paradiff.ParallelConfigError, match="cache_identifiers=paradiff.block_identifiers"):
        paradiff.compile(uncompiled, backend="aot_eager")


def test_inductor_lowers_the_parallel_ops(pools):
    """The one inductor case (C++ code generation): a functional all-reduce and the CP attention op on 2 ranks."""
    for result in pools.get(2).run(cases.inductor_smoke, timeout_s=600):
        assert result["all_reduce_ops"] == 1 and result["cp_attention_ops"] == 1, result
        assert result["diff"] <= REL_TOL, result
