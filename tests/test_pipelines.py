"""Whole pipelines on composed meshes: images equal the single-process pipeline's (fp32, same seed)."""

from __future__ import annotations

import pytest

import rank_cases_pipelines as cases
from paradiff_testkit.pipelines import default_call_kwargs

ATOL = 1e-5
COMPOSED = {  # id: degrees on 4 ranks
    "tp2xulysses2": dict(tp=2, ulysses=2),
    "tp2xring2": dict(tp=2, ring=2),
    "cfg2xtp2": dict(cfg=2, tp=2),
    "cfg2xulysses2": dict(cfg=2, ulysses=2),
    "dp2xtp2": dict(dp=2, tp=2),
}
CFG_FAMILIES = ("qwenimage", "wan")  # the pipelines that run true CFG
TP_FAMILIES = ("flux", "flux2", "qwenimage")


@pytest.fixture(scope="session")
def pipelines(tiny_pipeline_folders):
    return {family: str(tiny_pipeline_folders[family]) for family in ("flux", "flux2", "qwenimage", "wan", "wan2.2-a14b")}


def _equivalence(pool, references, family: str, folder: str, degrees: dict, seeds=(0,), steps: int = 2) -> list:
    """cases.pipeline_equivalence on `pool`, against diffusers' own images made once in this process. Two denoising
    steps (the second one runs on what the first made) unless a check counts per-step forwards over 3."""
    call = dict(default_call_kwargs(family), num_inference_steps=steps)
    expected = {seed: references.pixels(folder, seed, **call) for seed in seeds}
    return pool.run(cases.pipeline_equivalence, family=family, folder=folder, degrees=degrees, expected=expected,
                    whole_params=references.parameters(folder), steps=steps)


def _cases():
    for mode, degrees in COMPOSED.items():
        for family in ("flux", "flux2", "qwenimage", "wan"):
            if "cfg" in degrees and family not in CFG_FAMILIES:
                continue
            if "tp" in degrees and family not in TP_FAMILIES:
                continue
            yield pytest.param(family, degrees, id=f"{mode}-{family}")


@pytest.mark.parametrize("family,degrees", list(_cases()))
def test_composed_pipeline_matches_single_process(pools, references, pipelines, family, degrees):
    results = _equivalence(pools.get(4), references, family, pipelines[family], degrees,
                           steps=3 if "cfg" in degrees else 2)
    for result in results:
        assert max(result["diffs"].values()) < ATOL, result
        if degrees.get("cfg", 1) == 2:  # 3 steps, one branch per step on each half, the first step included
            assert result["cfg_forwards"] == 3, result
    assert sum(r["output_rank"] for r in results) == degrees.get("dp", 1)


@pytest.mark.parametrize("family,degrees", [
    ("wan", dict(ulysses=2)), ("wan", dict(ring=2)), ("qwenimage", dict(cfg=2)), ("flux2", dict(tp=2)),
])
def test_two_rank_pipelines(pools, references, pipelines, family, degrees):
    results = _equivalence(pools.get(2), references, family, pipelines[family], degrees, seeds=(0, 7))
    cfg = ["cfg_exchange"] if degrees.get("cfg", 1) == 2 else []
    for result in results:
        assert max(result["diffs"].values()) < ATOL, result
        assert result["wrappers"] == ["stage_switch", "latent_check", *cfg, "failure_guard"], result


def test_data_parallel_spreads_prompts_with_fixed_seeds(pools, references, pipelines):
    prompts = ["a cat", "a dog", "a red cube", "two birds", "a lake"]
    call = default_call_kwargs("flux2")
    expected = {index: references.pixels(pipelines["flux2"], 100 + index, **dict(call, prompt=prompt))
                for index, prompt in enumerate(prompts)}
    results = pools.get(4).run(cases.data_parallel_prompts, family="flux2", folder=pipelines["flux2"],
                               degrees=dict(dp=2, tp=2), prompts=prompts, expected=expected)
    by_replica = {}
    for result in results:
        assert max(result["diffs"].values(), default=0.0) < ATOL, result
        by_replica.setdefault(tuple(result["indices"]), []).append(result["rank"])
    assert sorted(i for indices in by_replica for i in indices) == list(range(len(prompts)))
    assert all(len(ranks) == 2 for ranks in by_replica.values())  # both TP ranks of a replica made the same share


def test_cfg_parallel_refuses_a_call_without_guidance(pools, pipelines):
    for message in pools.get(2).run(cases.cfg_without_guidance, family="qwenimage", folder=pipelines["qwenimage"]):
        assert "cfg_degree=2 needs a call that runs classifier-free guidance" in message, message


def test_ranks_refuse_to_generate_from_different_latents(pools, references, pipelines):
    messages = pools.get(2).run(cases.mismatched_seed, family="flux2", folder=pipelines["flux2"])
    for message in messages:
        assert message.startswith("DistributedError: generation start: ranks disagree on initial latents"), message
    # no collective was left half-done: the same pool still runs a correct case
    results = _equivalence(pools.get(2), references, "flux2", pipelines["flux2"], dict(ulysses=2))
    assert all(max(r["diffs"].values()) < ATOL for r in results)


@pytest.mark.parametrize("degrees", [dict(tp=2), dict(ulysses=2), dict(cfg=2)], ids=["tp2", "ulysses2", "cfg2"])
def test_wan22_a14b_both_transformers_run_parallel(pools, references, pipelines, degrees):
    """Wan 2.2 A14B: `transformer` (high-noise steps) and `transformer_2` (low-noise steps) are both loaded split
    (TP: each rank holds part of each), both run, and the video equals the single-process one."""
    results = _equivalence(pools.get(2), references, "wan2.2-a14b", pipelines["wan2.2-a14b"], degrees, steps=3)
    for result in results:
        assert max(result["diffs"].values()) < ATOL, result
        assert set(result["transformer_params"]) == {"transformer", "transformer_2"}, result
        assert all(calls > 0 for calls in result["transformer_calls"].values()), result
        for held, whole in result["transformer_params"].values():
            assert held < 0.75 * whole if "tp" in degrees else held == whole, result
        if "cfg" in degrees:  # 3 steps, one branch per step on each rank, over both transformers
            assert result["cfg_forwards"] == 3, result


def test_a_registry_of_its_own_is_applied_on_every_load_path_and_its_step_hooks_run_once_per_step(pools, pipelines):
    steps = 3
    results = pools.get(2).run(cases.a_registry_of_its_own_on_every_load_path, family="qwenimage",
                               folder=pipelines["qwenimage"], model_cls="QwenImageTransformer2DModel", steps=steps)
    for result in results:
        model = "QwenImageTransformer2DModel"
        # from_pretrained (tp2): resolved while preparing, around the read, applied after TP swapped its linears
        assert result["loaded_model"] == [("resolve", model), ("before_read", model), ("after_read", model),
                                          ("tp swapped before", True), ("apply", model, "probe plan", False)], result
        assert len(result["model_listed"]) == 1 and result["model_listed"][0].startswith("hook forward"), result
        # load_pipeline (cfg2): the same phases on its transformer, applied before CFG put its exchange on
        assert [entry[0] for entry in result["loaded_pipeline"]] == ["resolve", "before_read", "after_read",
                                                                     "apply"], result
        assert result["loaded_pipeline"][-1] == ("apply", model, "probe plan", False), result
        assert len(result["listed"]) == 1 and result["unlisted"] == [], result
        # once per denoising step, in order, each before its after; CFG closed each step's pair
        assert result["step_log"] == [(hook, step) for step in range(steps)
                                      for hook in ("before_step", "after_step")], result
        assert result["steps_run"] == steps and result["splitter_calls"] == [0], result
        assert result["plain_steps"] and result["equal"], result  # (CFG's own step hook on the plain pipeline)
