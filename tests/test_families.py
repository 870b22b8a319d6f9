"""Every built-in family example, in every parallel mode, with no plan argument: equal to the single-process
forward (fp32, relative max difference <= 1e-5) at batch 2 and token counts neither 2 nor 4 ranks divide, with the
work really split (projection FLOPs inside the block stacks <= 0.75 of single on every rank; TP ranks hold at most
0.75 of the block weights)."""

from __future__ import annotations

import functools
import re

import pytest

import rank_cases_families as cases
from paradiff.plan_tools import family_examples as examples
from paradiff.plans import builtin_plan
from paradiff.tensor_parallel.plan import QUERY_HEAD_ATTRS, as_plan, resolve_plan
from paradiff_testkit.families import UNEVEN_HEAD_CONFIGS, single_process_figures
from paradiff_testkit.families import uneven_head_overrides as find_uneven_head_overrides

TOLERANCE = 1e-5
MAX_SHARE = 0.75
EXAMPLES = examples.all_examples()
IDS = [f"{family}:{example}" for family, example, _ in EXAMPLES]
# modes a family asks for beyond the four, e.g. tp4 where K/V heads (2) are fewer than the ranks and get replicated
EXTRA = [(family, example, mode) for family, example, _ in EXAMPLES
         for mode in examples.family_module(family).extra_modes.get(example, ())]


@functools.lru_cache(maxsize=None)  # each test function walks every example: keep them all (small outputs)
def _single(family: str, example: str, overrides: tuple = ()) -> dict:
    return single_process_figures(family, example, dict(overrides) or None)


def single(family: str, example: str, overrides: dict | None = None) -> dict:
    """The example's single-process figures, computed once here instead of on every rank of every test."""
    return _single(family, example, tuple(sorted((overrides or {}).items())))


@functools.lru_cache(maxsize=None)  # several tests ask for the same example's config (each answer builds and runs it)
def uneven_head_overrides(family: str, example: str, heads: int = 3) -> dict | None:
    return find_uneven_head_overrides(family, example, heads)


def check(results: list[dict]) -> None:
    for rank, by_mode in enumerate(results):
        for mode, figures in by_mode.items():
            assert figures["diff"] <= TOLERANCE, (rank, mode, figures)
            assert figures["wrong_slices"] == [], (rank, mode, figures)
            assert figures["flop_share"] <= MAX_SHARE, (rank, mode, figures)
            if mode.startswith("tp"):
                assert figures["bytes_share"] <= MAX_SHARE, (rank, mode, figures)


@pytest.mark.parametrize("family,example,class_name", EXAMPLES, ids=IDS)
def test_two_ranks_tp_ulysses_ring_and_three_heads_at_tp2(pools, family, example, class_name):
    """tp2, ulysses2 and ring2; then 3 heads over 2 ranks (1 K/V head where the example groups them): 2 + 1 whole
    heads. Both in one case on the 2-rank pool."""
    overrides = uneven_head_overrides(family, example)
    assert overrides is not None, "add the example's 3-head config to UNEVEN_HEAD_CONFIGS (paradiff_testkit/families.py)"
    results = pools.get(2).run(cases.family_modes_runs, runs=[
        dict(family=family, example=example, modes=["tp2", "ulysses2", "ring2"], single=single(family, example)),
        dict(family=family, example=example, modes=["tp2"], config_overrides=overrides,
             single=single(family, example, overrides))])
    for run in range(2):
        check([by_run[run] for by_run in results])


@pytest.mark.parametrize("family,example,class_name", EXAMPLES, ids=IDS)
def test_four_ranks_tp2_x_ulysses2_loaded_shard_on_read(pools, tmp_path, family, example, class_name):
    """Loaded shard-on-read (from_pretrained); enable_parallelism, the other way in, runs in the two-rank modes."""
    examples.build_example(family, example).save_pretrained(tmp_path, safe_serialization=True)
    results = pools.get(4).run(cases.family_modes, family=family, example=example, modes=["tp2xulysses2"],
                               checkpoint=str(tmp_path), loaders=("from_pretrained",), single=single(family, example))
    assert all(list(by_mode) == ["tp2xulysses2/from_pretrained"] for by_mode in results), results
    check(results)


@pytest.mark.parametrize("family,example,class_name", EXAMPLES, ids=IDS)
def test_tp3_splits_four_heads_into_whole_heads(pools, family, example, class_name):
    """The examples' 4 heads over 3 ranks: 2 + 1 + 1 whole heads (K/V heads with their query heads), feed-forward
    widths floor/ceil; refused, naming the module, only where an attention has fewer heads than ranks."""
    results = pools.get(3).run(cases.family_modes_or_refusal, family=family, example=example, modes=["tp3"],
                               single=single(family, example))
    if any("refused" in result for result in results):
        for result in results:
            found = re.match(r"(\S+): tp_degree=3 is larger than the (\d) attention heads", result.get("refused", ""))
            assert found, result
            module = examples.build_example(family, example).get_submodule(found[1])
            assert int(found[2]) < 3 and int(found[2]) in {getattr(module, attr, None) for attr in QUERY_HEAD_ATTRS}
        return
    check(results)


@pytest.mark.parametrize("family,example", sorted(UNEVEN_HEAD_CONFIGS),
                         ids=[f"{family}:{example}" for family, example in sorted(UNEVEN_HEAD_CONFIGS)])
def test_uneven_head_configs_give_every_split_attention_three_heads(family, example):
    """The hand-written 3-head configs leave no attention the plan splits at an even count (both streams of a
    two-stream model, perceiver and face cross-attentions): every one holds 2 + 1 heads at tp2."""
    model = examples.build_example(family, example, config_overrides=UNEVEN_HEAD_CONFIGS[(family, example)](3))
    plan = as_plan(builtin_plan(model, model.config, "tensor"))
    per_rank = [resolve_plan(model, plan, rank, 2).local_head_counts for rank in range(2)]
    assert per_rank[0], (family, example)
    held = {name: [next(counts[name][attr] for attr in QUERY_HEAD_ATTRS if attr in counts[name]) for counts in per_rank]
            for name in per_rank[0]}
    assert {name: heads for name, heads in held.items() if heads != [2, 1]} == {}


UNEVEN_ON_BOTH = ["flux:flux.1-dev", "flux2:flux.2-dev", "wan:wan2.1-t2v", "qwenimage:qwen-image",
                  "hunyuan_video:hunyuan-video-t2v", "nucleusmoe:nucleus-moe"]


@pytest.mark.parametrize("name", UNEVEN_ON_BOTH)
def test_tp2_x_ulysses2_with_heads_uneven_on_both(pools, name):
    """3 heads: TP holds 2 + 1, then Ulysses splits each TP rank's 2 or 1 heads over its 2 CP ranks."""
    family, example = name.split(":")
    overrides = uneven_head_overrides(family, example)
    assert overrides is not None, name
    check(pools.get(4).run(cases.family_modes, family=family, example=example, modes=["tp2xulysses2"],
                           config_overrides=overrides, single=single(family, example, overrides)))


# 5 and 7 heads on a sample (every example: tools/verify_plans.py --uneven, docs/coverage.md): two-stream, video,
# grouped-query (1 K/V head) and hand-configured examples
FIVE_AND_SEVEN = [("flux:flux.1-dev", "tp3", 5), ("wan:wan2.2-ti2v", "tp2", 7), ("lumina2:lumina2", "tp3", 7),
                  ("z_image:z-image", "tp2", 5), ("ltx2:ltx-2", "tp3", 5)]


@pytest.mark.parametrize("name,mode,heads", FIVE_AND_SEVEN, ids=[f"{n}:{m}@{h}" for n, m, h in FIVE_AND_SEVEN])
def test_five_and_seven_heads_split_into_whole_heads(pools, name, mode, heads):
    family, example = name.split(":")
    overrides = uneven_head_overrides(family, example, heads)
    assert overrides is not None, name
    check(pools.get(cases.world_size(mode)).run(cases.family_modes, family=family, example=example, modes=[mode],
                                                config_overrides=overrides,
                                                single=single(family, example, overrides)))


@pytest.mark.parametrize("mode", ["tp2", "tp2xulysses2"])
def test_grouped_heads_six_over_three_kv_heads_split_by_whole_groups(pools, mode):
    """6 query heads over 3 K/V heads at tp2: 2 + 1 K/V heads, each with its 2 query heads; then Ulysses on top."""
    overrides = {"num_attention_heads": 6, "num_key_value_heads": 3}
    check(pools.get(cases.world_size(mode)).run(cases.family_modes, family="nucleusmoe", example="nucleus-moe",
                                                modes=[mode], config_overrides=overrides,
                                                single=single("nucleusmoe", "nucleus-moe", overrides)))


@pytest.mark.parametrize("family,example,mode", EXTRA, ids=[f"{f}:{e}:{m}" for f, e, m in EXTRA])
def test_extra_modes_loaded_shard_on_read(pools, tmp_path, family, example, mode):
    world = cases.world_size(mode)
    examples.build_example(family, example).save_pretrained(tmp_path, safe_serialization=True)
    check(pools.get(world).run(cases.family_modes, family=family, example=example, modes=[mode],
                               checkpoint=str(tmp_path), single=single(family, example)))
