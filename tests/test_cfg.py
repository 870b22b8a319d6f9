"""CFG parallelism: each half computes one branch per step, the first step included."""

from __future__ import annotations

import json

import pytest

import rank_cases_cfg as cases
from paradiff_testkit.pipelines import default_call_kwargs

ATOL = 1e-5
STEPS = 3


@pytest.mark.parametrize("family,compiled", [("flux2", False), ("wan", False), ("flux2", True)],
                         ids=["flux2", "wan", "flux2-compiled"])
def test_first_step_is_not_computed_twice(pools, family, compiled):
    """Cfg rank 1 learns the output's structure from a meta-device run: STEPS forwards per rank, not STEPS + 1."""
    for result in pools.get(2).run(cases.cfg_pairs, family=family, steps=STEPS, compiled=compiled):
        assert result["diff"] <= ATOL, result
        assert result["computed"] == STEPS, result


def test_the_two_predictions_are_exchanged_whatever_their_shapes(pools):
    for result in pools.get(2).run(cases.cfg_pair_of_different_shapes):
        assert result["first"] and result["second"], result


def test_without_a_meta_run_the_first_call_is_learned_once(pools):
    results = pools.get(2).run(cases.cfg_pairs, steps=STEPS, meta=False)
    assert [r["computed"] for r in results] == [STEPS, STEPS + 1], results
    for result in results:
        assert result["diff"] <= ATOL, result


# --- whole pipelines --------------------------------------------------------------------------------------------

RELATIVE = 1e-5
# one transformer call per step on [uncond, cond]
BATCH_FAMILIES = ("sd3", "pixart_sigma", "sana", "ltx", "pixart_alpha", "auraflow", "cogview3plus", "cogvideox")
# two calls per step (Qwen-Image and Wan: tests/test_pipelines.py)
TWO_CALL_FAMILIES = ("flux", "flux2_klein", "lumina2", "hunyuanvideo", "chroma")
NO_META_RUN = ("lumina2",)  # its forward reads the caption lengths off the mask: no meta run
# family -> (tiny folder, pipeline class run on it, call arguments beyond the family's defaults)
VARIANTS = {
    "pixart_alpha": ("pixart_sigma", "PixArtAlphaPipeline", dict(clean_caption=False)),
    "flux": ("flux", None, dict(negative_prompt="blurry, low quality", true_cfg_scale=4.0)),
    "hunyuanvideo": ("hunyuanvideo", None, dict(negative_prompt="blurry, low quality", true_cfg_scale=4.0)),
}


def _run(pools, references, ranks: int, family: str, folders, degrees: dict):
    folder, pipeline_class, call = VARIANTS.get(family, (family, None, {}))
    expected = references.run(str(folders[folder]), 0, pipeline_class,
                              **dict(default_call_kwargs(folder), num_inference_steps=STEPS, **call))
    return pools.get(ranks).run(cases.pipeline_cfg, family=folder, folder=str(folders[folder]), degrees=degrees,
                                expected=expected, steps=STEPS, pipeline_class=pipeline_class, call=call)


def _check_pipeline(result: dict, family: str, steps: int = STEPS) -> None:
    assert result["diff"] <= RELATIVE * max(result["scale"], 1.0), result
    if family in BATCH_FAMILIES:
        assert result["style"] == "BatchCfgSplitter", result
        assert result["reference_batches"] == [2] * steps, result  # diffusers: the whole [uncond, cond] batch
        assert result["batches"] == [1] * steps, result  # each cfg rank: its half, once per step
    else:
        assert result["style"] == "CfgSplitter", result
        assert result["reference_batches"] == [1] * (2 * steps), result
        # one of the two calls per step; cfg rank 1 of a transformer whose forward cannot run on the meta device
        # computes the first call once more, to learn its output's structure
        calls = steps + 1 if family in NO_META_RUN and result["cfg_rank"] == 1 else steps
        assert result["batches"] == [1] * calls, result
        assert result["computed"] == calls, result
        return
    assert result["computed"] == steps, result


@pytest.mark.parametrize("family", BATCH_FAMILIES + TWO_CALL_FAMILIES)
def test_pipeline_at_cfg2_matches_single_process(pools, references, tiny_pipeline_folders, family):
    results = _run(pools, references, 2, family, tiny_pipeline_folders, dict(cfg=2))
    assert sorted(r["cfg_rank"] for r in results) == [0, 1]
    for result in results:
        _check_pipeline(result, family)
        if family in BATCH_FAMILIES:  # cfg rank r's first block ran on exactly half r of diffusers' batch
            assert result["block_diff"] <= RELATIVE, result


@pytest.mark.parametrize("family", ("sd3", "pixart_sigma", "sana", "flux2_klein"))
def test_pipeline_at_cfg2_x_tp2_matches_single_process(pools, references, tiny_pipeline_folders, family):
    results = _run(pools, references, 4, family, tiny_pipeline_folders, dict(cfg=2, tp=2))
    assert sorted(r["cfg_rank"] for r in results) == [0, 0, 1, 1]
    for result in results:
        _check_pipeline(result, family)


def unclassified_folder(tmp_path, pipeline: str = "EasyAnimateControlPipeline",
                        transformer: str = "EasyAnimateTransformer3DModel") -> str:
    """A pipeline folder of a class CFG_RULES does not list: refused from its model_index.json, nothing else read."""
    (tmp_path / "model_index.json").write_text(json.dumps({
        "_class_name": pipeline, "transformer": ["diffusers", transformer]}))
    return str(tmp_path)


@pytest.mark.parametrize("family,reason", [
    ("flux2", "Flux2Pipeline never runs classifier-free guidance (guidance-distilled"),
    # (EasyAnimate Control fails in diffusers 0.42.1 itself, so nothing verifies a rule for it)
    (None, "EasyAnimateControlPipeline is not classified for CFG parallelism yet ("),
    ("SanaPAGPipeline", "SanaPAGPipeline is not supported with CFG parallelism yet: perturbed-attention guidance"),
    ("LTX2Pipeline", "LTX2Pipeline is not supported with CFG parallelism yet: it runs up to four branches"),
], ids=["never-guides", "not-classified", "pag", "ltx2"])
def test_cfg2_refusals_say_why(pools, tiny_pipeline_folders, tmp_path, family, reason):
    if family in (None, "SanaPAGPipeline", "LTX2Pipeline"):
        transformer = {"SanaPAGPipeline": "SanaTransformer2DModel", "LTX2Pipeline": "LTX2VideoTransformer3DModel"}
        folder = (unclassified_folder(tmp_path, family, transformer[family]) if family
                  else unclassified_folder(tmp_path))
    else:
        folder = str(tiny_pipeline_folders[family])
    for message in pools.get(2).run(cases.load_refusal, folder=folder, degrees=dict(cfg=2)):
        assert message.startswith(f"ParallelConfigError: cfg_degree=2: {reason}"), message
        assert message.endswith("; use cfg_degree=1."), message


def test_a_call_guiding_in_a_way_not_split_is_refused(pools, tiny_pipeline_folders):
    """SD3 with skip-layer guidance adds a third branch, a separate call on the conditional batch: refused at cfg2
    before any transformer call, naming the argument."""
    call = dict(skip_guidance_layers=[1])
    for message in pools.get(2).run(cases.call_refusal, family="sd3", folder=str(tiny_pipeline_folders["sd3"]),
                                    degrees=dict(cfg=2), call=call):
        assert message.startswith("ParallelConfigError: CFG parallelism on StableDiffusion3Pipeline: "
                                  "skip_guidance_layers=[1]: skip-layer guidance adds a third branch"), message
        assert message.endswith("; use cfg_degree=1."), message


def test_cfg_degree_must_be_the_branch_count():
    """A batch or two-call pipeline runs 2 branches: cfg_degree=3 is refused by name, before anything is read."""
    from paradiff.api.pipeline import _check_cfg_classified
    from paradiff.errors import ParallelConfigError

    with pytest.raises(ParallelConfigError, match=r"cfg_degree=3: SanaPipeline runs 2 guidance branches per step, one "
                                                  r"per cfg rank; use cfg_degree=2 \(or cfg_degree=1\)"):
        _check_cfg_classified("SanaPipeline", 3)
    _check_cfg_classified("HunyuanVideo15Pipeline", 3)  # a guider's branches: checked against its guider at the call


# --- the rules ---------------------------------------------------------------------------------------------------

def test_rules_say_when_a_call_guides():
    from types import SimpleNamespace

    from paradiff.plans.pipelines import CFG_RULES

    lumina, klein, flux = CFG_RULES["Lumina2Pipeline"], CFG_RULES["Flux2KleinPipeline"], CFG_RULES["FluxPipeline"]
    assert lumina.runs_cfg({}) and not lumina.runs_cfg({"cfg_trunc_ratio": 0.5})  # truncated: not every step
    assert klein.runs_cfg({}, SimpleNamespace(is_distilled=False))
    assert not klein.runs_cfg({}, SimpleNamespace(is_distilled=True))
    assert not flux.runs_cfg({"true_cfg_scale": 4.0}) and flux.runs_cfg({"true_cfg_scale": 4.0, "negative_prompt": ""})
    assert not CFG_RULES["SanaPipeline"].runs_cfg({"guidance_scale": 1.0})


def test_a_rule_declares_its_style_completely():
    from paradiff.plans.pipelines import BATCH, CfgRule

    with pytest.raises(ValueError, match="names its batched arguments"):
        CfgRule("guidance_scale", 4.5, needs_negative_prompt=False, style=BATCH)
    with pytest.raises(ValueError, match="style must be"):
        CfgRule("guidance_scale", 4.5, needs_negative_prompt=False, style="three_calls")


def test_each_pipeline_has_one_spec_that_says_once_how_it_guides():
    from paradiff.plans.pipelines import PIPELINES, CfgRule, PipelineSpec, _each, _table, pipeline_spec

    rule = CfgRule("guidance_scale", 4.5, needs_negative_prompt=False)
    with pytest.raises(ValueError, match="says how the pipeline guides once"):
        PipelineSpec(cfg=rule, never_guides=True)
    with pytest.raises(ValueError, match="FluxPipeline has two PipelineSpecs"):
        _table(_each("FluxPipeline", cfg=rule), _each(("SanaPipeline", "FluxPipeline"), never_guides=True))
    assert pipeline_spec("FluxPipeline") is PIPELINES["FluxPipeline"] and pipeline_spec(None) == PipelineSpec()


def test_docs_table_is_generated_from_the_rules():
    from pathlib import Path

    from paradiff.plan_tools.cfg_rules import cfg_rules_page, cfg_rules_table

    docs = (Path(__file__).parents[1] / "docs" / "cfg-rules.md").read_text()
    table = cfg_rules_table()
    assert table in docs, "docs/cfg-rules.md's CFG table is stale: run python tools/docs_tables.py"
    assert docs == cfg_rules_page(), "docs/cfg-rules.md is not the generator's output: run python tools/docs_tables.py"


def test_batch_split_cuts_a_cache_along_its_batch_dim_and_hands_the_callers_cache_back():
    # AnyFlow FAR: each block's KV cache (2, batch, heads, tokens, head_dim) holds the branches along dim 1; the
    # cache-encoding call returns no prediction, only the cache (the caller's, not this rank's view of it)
    import torch

    from paradiff.errors import ParallelConfigError
    from paradiff.runtime.cfg import BatchCfgSplitter

    splitter = BatchCfgSplitter(group=None, cfg_rank=1, cfg_degree=2, batched=("hidden_states", "kv_cache"),
                                parameter_names=("hidden_states", "kv_cache"), batch_dims={"kv_cache": 1})
    cache = {0: {"full": torch.zeros(2, 4, 3)}}

    def fill(hidden_states, kv_cache):
        assert hidden_states.shape[0] == 2 and kv_cache[0]["full"].shape == (2, 2, 3)
        kv_cache[0]["full"].fill_(1.0)
        return None, kv_cache

    sample, returned = splitter(fill, (torch.zeros(4, 5),), {"kv_cache": cache})
    assert sample is None and returned is cache
    assert cache[0]["full"][:, 2:].eq(1).all() and cache[0]["full"][:, :2].eq(0).all()
    with pytest.raises(ParallelConfigError, match=r"'kv_cache' has batch 2 \(dim 0\)"):
        BatchCfgSplitter(group=None, cfg_rank=0, cfg_degree=2, batched=("kv_cache",),
                         parameter_names=("hidden_states",))(fill, (torch.zeros(4, 5),), {"kv_cache": cache})
