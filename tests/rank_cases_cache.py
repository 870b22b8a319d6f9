"""Functions run on every rank of a pool by tests/test_cache.py (gloo, CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from diffusers import FirstBlockCacheConfig, TaylorSeerCacheConfig

import paradiff
from paradiff.config import mode_name
from paradiff.distributed.comm import all_gather_object
from paradiff_testkit.caching import decide_alone, stock_decisions
from paradiff.testing.models import Lengths, build_model, make_inputs, run_forward
from rank_cases_compile import parallel_config

SHAPE = Lengths(height=3, width=5, text=7)
STEPS = 8


def taylorseer(family: str) -> TaylorSeerCacheConfig:
    # Wan's attention modules are attn1/attn2, which diffusers' default patterns (".*attn") miss: cache the blocks
    identifiers = [r"blocks\.\d+"] if family == "wan" else None
    return TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, max_order=1,
                                 taylor_factors_dtype=torch.float32, cache_identifiers=identifiers)


def denoise(model, family: str, steps: int = STEPS, batch: int = 2, inputs: dict | None = None) -> torch.Tensor:
    """A flow-matching Euler loop (t from 1 to 0) in the "cond" cache context; returns the final latents."""
    inputs = dict(inputs or make_inputs(family, model.config, batch=batch, lengths=SHAPE))
    latents = inputs.pop("hidden_states")
    scale = 1000.0 if family == "wan" else 1.0
    with model.cache_context("cond"):
        for step in range(steps):
            t, t_next = 1.0 - step / steps, 1.0 - (step + 1) / steps
            timestep = torch.full((latents.shape[0],), t * scale)
            velocity = run_forward(model, dict(inputs, hidden_states=latents, timestep=timestep))
            latents = latents + (t_next - t) * velocity
    return latents


def first_block_threshold(family: str, layers: int = 2, single_layers: int = 2) -> float:
    """A threshold that skips some steps and computes others, from an always-compute single-process probe."""
    probe = build_model(family, layers=layers, single_layers=single_layers)
    monitor = paradiff.enable_cache(probe, FirstBlockCacheConfig(threshold=0.0))
    denoise(probe, family)
    metrics = sorted(d.metric for d in monitor.decisions if d.metric is not None)
    middle = len(metrics) // 2
    return (metrics[middle - 1] + metrics[middle]) / 2  # halfway between two measures: no decision is borderline


def cached_equivalence_many(cases: list[dict]) -> dict:
    """The single-process references (threshold probe, uncached and stock cached runs) depend on the family only:
    computed once per family for the whole batch, not once per case."""
    references: dict[tuple, object] = {}
    return {_label(case): cached_equivalence(**case, references=references) for case in cases}


def _reference(references: dict | None, key: tuple, compute):
    """`compute()`, or its result from an earlier case of the same batch (deterministic: seeded models and inputs)."""
    if references is None:
        return compute()
    if key not in references:
        references[key] = compute()
    return references[key]


def _label(case: dict) -> str:
    order = ("tp", "ring", "ulysses")
    return f"{case['family']}:{mode_name({k: case.get(k, 1) for k in order}, order=order)}"


def cached_equivalence(family: str, tp: int = 1, ring: int = 1, ulysses: int = 1,
                       references: dict | None = None) -> dict:
    """First-block cache and TaylorSeer: parallel decisions and latents against a stock single-process cached run.
    `references` (optional) keeps the single-process runs across the cases of one batch."""
    results = {"rank": dist.get_rank()}
    threshold = _reference(references, (family, "threshold"), lambda: first_block_threshold(family))
    uncached = _reference(references, (family, "uncached"),
                          lambda: denoise(build_model(family, layers=2, single_layers=2), family))
    model = build_model(family, layers=2, single_layers=2)
    if tp * ring * ulysses > 1:  # one parallel model for both caches: every mesh costs process groups
        paradiff.enable_parallelism(model, parallel_config(tp, ring, ulysses))
    for name, config in (("fbc", FirstBlockCacheConfig(threshold=threshold)), ("taylorseer", taylorseer(family))):
        expected, expected_decisions = _reference(references, (family, name),
                                                  lambda name=name, config=config: _stock_cached_run(family, name, config))
        if tp * ring * ulysses > 1:
            model.enable_cache(config)  # routed through paradiff: decisions agreed over the model's ranks
        else:
            paradiff.enable_cache(model, config)
        actual = denoise(model, family)
        monitor = paradiff.cache_monitor(model)
        model.disable_cache()
        results[name] = {
            "threshold": getattr(config, "threshold", None),
            "expected": expected_decisions,
            "actual": [d.computed for d in monitor.decisions],
            "diff": float((actual - expected).abs().max() / expected.abs().max()),
            "uncached_diff": float((actual - uncached).abs().max()),
        }
    return results


def _stock_cached_run(family: str, name: str, config) -> tuple[torch.Tensor, list[bool]]:
    single = build_model(family, layers=2, single_layers=2)
    if family == "flux2" and name == "fbc":
        # diffusers' own first-block cache raises on FLUX.2 (its tail block returns the joint sequence);
        # the reference is then paradiff's single-process repair, without any reduction
        paradiff.enable_cache(single, config)
    else:
        single.enable_cache(config)  # diffusers' own hooks, untouched
    return denoise_recording(single, family)


def denoise_recording(model, family: str) -> tuple[torch.Tensor, list[bool]]:
    decisions: list[bool] = []
    with stock_decisions(model, decisions):
        latents = denoise(model, family)
    return latents, decisions


def _shifted_inputs(family: str, config, steps: int) -> list[dict]:
    """Inputs whose image tokens change little in the first half of the sequence and much in the second, at a
    fixed timestep: a rank holding the first half measures a small change, one holding the second a large one."""
    base = make_inputs(family, config, batch=2, lengths=SHAPE)
    generator = torch.Generator().manual_seed(7)
    hidden = base["hidden_states"]
    half = hidden.shape[1] // 2
    weights = torch.ones(hidden.shape[1], 1)
    weights[:half] = 0.01
    sequence = []
    for _ in range(steps):
        hidden = hidden + 0.3 * weights * torch.randn(hidden.shape, generator=generator)
        sequence.append(dict(base, hidden_states=hidden))
    return sequence


def _run_sequence(model, sequence: list[dict]) -> list[torch.Tensor]:
    with model.cache_context("cond"):
        return [run_forward(model, inputs) for inputs in sequence]


def straddling_metric(family: str = "flux", ring: int = 1, ulysses: int = 2, steps: int = 5) -> dict:
    """Thresholds between one rank's own measure and the agreed one: the agreed decision wins on every rank (no
    hang, the same steps as diffusers' own single-process cache) whether it is to compute while a rank alone would
    skip, or to skip while a rank alone would compute. Deciding alone makes the ranks disagree, which the agreement
    check of the test kit (paradiff_testkit.caching) turns into an error instead of a hang."""
    model = build_model(family, layers=2, single_layers=2)
    sequence = _shifted_inputs(family, model.config, steps)
    paradiff.enable_parallelism(model, parallel_config(1, ring, ulysses))  # one model (one mesh) for every run

    def cached_run(threshold: float) -> tuple[list, list]:
        model.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        try:
            return _run_sequence(model, sequence), paradiff.cache_monitor(model).decisions
        finally:
            model.disable_cache()

    _, probe = cached_run(0.0)
    first = next(d for d in probe if d.metric is not None)
    local = all_gather_object(first.local_metric)
    thresholds = {  # geometric means: well away from every measure
        "agreed compute, a rank alone would skip": (min(local) * first.metric) ** 0.5,
        "agreed skip, a rank alone would compute": (max(local) * first.metric) ** 0.5,
    }
    results = {"rank": dist.get_rank(), "local_metric": first.local_metric, "metric": first.metric}
    for label, threshold in thresholds.items():
        single = build_model(family, layers=2, single_layers=2)
        single.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        expected_decisions: list[bool] = []
        with stock_decisions(single, expected_decisions):
            expected = _run_sequence(single, sequence)
        actual, decisions = cached_run(threshold)
        results[label] = {
            "expected": expected_decisions,
            "actual": [d.computed for d in decisions],
            "alone": [None if d.local_metric is None else d.local_metric > threshold for d in decisions],
            "diff": max(float((a - e).abs().max() / e.abs().max()) for a, e in zip(actual, expected)),
        }
    model.enable_cache(FirstBlockCacheConfig(threshold=thresholds["agreed compute, a rank alone would skip"]))
    decide_alone(paradiff.cache_monitor(model), ranks=list(range(dist.get_world_size())))
    try:
        _run_sequence(model, sequence)
        results["alone_error"] = None
    except Exception as exc:  # noqa: BLE001 - the expected outcome, reported to the test
        results["alone_error"] = f"{type(exc).__name__}: {exc}"
    return results


def unsupported_cache() -> str:
    from diffusers import PyramidAttentionBroadcastConfig

    model = build_model("flux2")
    paradiff.enable_parallelism(model, parallel_config(ulysses=dist.get_world_size()))
    try:
        model.enable_cache(PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2))
    except paradiff.ParallelConfigError as exc:
        return str(exc)
    return "no error"
