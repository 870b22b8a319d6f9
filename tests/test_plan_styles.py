"""Styles for per-head parameters and norms over grouped K heads: which slice each rank holds, and the errors a
wrong plan gets before anything is read (single process: resolution needs no torch.distributed)."""

from __future__ import annotations

import pytest

from paradiff import HeadNorm, PlanError, SplitParameter, TensorParallelPlan, examples
from paradiff.tensor_parallel.plan import resolve_plan
from paradiff.tensor_parallel.styles import ShardSpec


@pytest.fixture(scope="module")
def lumina_next():
    return examples.build_example("lumina_next", "lumina-next")  # 4 query heads of 16, 2 K/V heads


def test_split_parameter_gives_each_rank_its_heads(lumina_next):
    plan = TensorParallelPlan(styles={"layers.*.gate": SplitParameter(0)})
    for rank in range(2):
        resolved = resolve_plan(lumina_next, plan, rank, 2)
        assert resolved.spec_for("layers.1.gate") == ShardSpec(dim=0, pieces=((2 * rank, 2),))
        assert resolved.spec_for("layers.1.attn1.to_q.weight") is None


def test_split_parameter_errors(lumina_next):
    with pytest.raises(PlanError, match=r"has no parameter 'gates'; its own parameters are \['gate'\]"):
        resolve_plan(lumina_next, TensorParallelPlan(styles={"layers.*.gates": SplitParameter(0)}), 0, 2)
    with pytest.raises(PlanError, match=r"\(4 heads\) is not divisible by tp_degree=3"):
        SplitParameter(0).shard_spec("gate", (4,), 0, 3, None, "layers.0.gate")


def test_head_norm_over_grouped_heads_follows_the_kv_heads(lumina_next):
    """tp=4, 2 K heads of 16: ranks 0-1 hold head 0, ranks 2-3 head 1 (as ColwiseHeads gives their K/V); tp=2 one
    head each."""
    plan = TensorParallelPlan(styles={"layers.*.attn1.norm_k": HeadNorm(head_dim=16)})
    held = [resolve_plan(lumina_next, plan, rank, 4).spec_for("layers.0.attn1.norm_k.weight").pieces
            for rank in range(4)]
    assert held == [((0, 16),), ((0, 16),), ((16, 16),), ((16, 16),)]
    assert resolve_plan(lumina_next, plan, 1, 2).spec_for("layers.0.attn1.norm_k.bias").pieces == ((16, 16),)
