"""Every built-in family example, in every parallel mode, with no plan argument: equal to the single-process
forward (fp32, relative max difference <= 1e-5) at batch 2 and token counts neither 2 nor 4 ranks divide, with the
work really split (projection FLOPs inside the block stacks <= 0.75 of single on every rank; TP ranks hold at most
0.75 of the block weights)."""

from __future__ import annotations

import pytest

import rank_cases_families as cases
from paradiff.plan_tools import family_examples as examples

TOLERANCE = 1e-5
MAX_SHARE = 0.75
EXAMPLES = examples.all_examples()
IDS = [f"{family}:{example}" for family, example, _ in EXAMPLES]
# modes a family asks for beyond the four, e.g. tp4 where K/V heads (2) are fewer than the ranks and get replicated
EXTRA = [(family, example, mode) for family, example, _ in EXAMPLES
         for mode in examples.family_module(family).extra_modes.get(example, ())]


def check(results: list[dict]) -> None:
    for rank, by_mode in enumerate(results):
        for mode, figures in by_mode.items():
            assert figures["diff"] <= TOLERANCE, (rank, mode, figures)
            assert figures["flop_share"] <= MAX_SHARE, (rank, mode, figures)
            if mode.startswith("tp"):
                assert figures["bytes_share"] <= MAX_SHARE, (rank, mode, figures)


@pytest.mark.parametrize("family,example,class_name", EXAMPLES, ids=IDS)
def test_two_ranks_tp_ulysses_ring(pools, family, example, class_name):
    check(pools.get(2).run(cases.family_modes, family=family, example=example, modes=["tp2", "ulysses2", "ring2"]))


@pytest.mark.parametrize("family,example,class_name", EXAMPLES, ids=IDS)
def test_four_ranks_tp2_x_ulysses2_loaded_shard_on_read(pools, tmp_path, family, example, class_name):
    examples.build_example(family, example).save_pretrained(tmp_path, safe_serialization=True)
    check(pools.get(4).run(cases.family_modes, family=family, example=example, modes=["tp2xulysses2"],
                           checkpoint=str(tmp_path)))


@pytest.mark.parametrize("family,example,mode", EXTRA, ids=[f"{f}:{e}:{m}" for f, e, m in EXTRA])
def test_extra_modes_loaded_shard_on_read(pools, tmp_path, family, example, mode):
    tp, ring, ulysses = cases.MODES[mode]
    examples.build_example(family, example).save_pretrained(tmp_path, safe_serialization=True)
    check(pools.get(tp * ring * ulysses).run(cases.family_modes, family=family, example=example, modes=[mode],
                                             checkpoint=str(tmp_path)))
