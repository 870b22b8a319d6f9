"""Property-based: random degrees, head counts, lengths and modes either fail clearly up front or match exactly."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rank_cases_property as cases

WORLD = 4
TP_FAMILIES = ("flux", "flux2", "qwenimage")


@st.composite
def examples(draw):
    family = draw(st.sampled_from(("flux", "flux2", "qwenimage", "wan")))
    tp = draw(st.sampled_from((1, 2, 3, 4))) if family in TP_FAMILIES else 1
    ring = draw(st.sampled_from((1, 2, 3, 4)))
    ulysses = draw(st.sampled_from((1, 2, 3, 4)))
    return dict(
        family=family, tp=tp, ring=ring, ulysses=ulysses,
        heads=draw(st.integers(1, 6)),
        height=draw(st.integers(1, 5)), width=draw(st.integers(1, 5)), text=draw(st.integers(1, 9)),
        batch=draw(st.integers(1, 2)),
    )


def _expected_refusal(example) -> str | None:
    """What must be refused, computed independently of paradiff's own checks."""
    degree = example["tp"] * example["ring"] * example["ulysses"]
    if degree > WORLD or WORLD % degree:
        return "setup"
    if example["tp"] > example["heads"]:  # any head count splits into whole heads, but each rank needs one
        return "setup"
    cp = example["ring"] * example["ulysses"]
    tokens = example["height"] * example["width"]
    if cp > 1 and (tokens < cp or (example["family"] != "wan" and example["text"] < cp)):
        return "forward"
    return None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(example=examples())
def test_clear_refusal_or_exact_result(pools, example):
    results = pools.get(WORLD).run(cases.run_example, **example)
    expected = _expected_refusal(example)
    for result in results:
        if expected is None:
            assert result["outcome"] == "ran" and result["diff"] < 1e-5, (example, result)
        else:
            assert result["outcome"] == "refused" and result["stage"] == expected, (example, result)
            assert any(word in result["error"] for word in ("tp_degree", "ranks", "degree", "tokens")), result
