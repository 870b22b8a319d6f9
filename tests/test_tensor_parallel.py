"""Tensor parallelism: equivalence with single-process diffusers, shard contents, bf16, saving, errors."""

from __future__ import annotations

import pytest

import rank_cases_tp as cases

ATOL = 1e-5
FAMILIES = ("flux", "flux2", "qwenimage")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "world,tp,layout",
    [(2, 2, "single"), (2, 2, "sharded"), (4, 4, "single"), (4, 4, "sharded"), (4, 2, "single"), (3, 3, "sharded")],
    ids=["tp2-file", "tp2-index", "tp4-file", "tp4-index", "tp2x2replicas-file", "tp3-uneven-heads-index"],
)
def test_from_pretrained_matches_single_process(pools, checkpoints, family, world, tp, layout):
    results = pools.get(world).run(
        cases.tp_equivalence, family=family, folder=str(checkpoints[(family, layout)]), tp=tp, via="from_pretrained"
    )
    for result in results:
        assert max(result["diffs"].values()) < ATOL, result
        assert result["local_bytes"] < result["full_bytes"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world", [2, 4])
def test_enable_parallelism_matches_single_process(pools, checkpoints, family, world):
    results = pools.get(world).run(
        cases.tp_equivalence, family=family, folder=str(checkpoints[(family, "single")]), tp=world, via="enable"
    )
    for result in results:
        assert max(result["diffs"].values()) < ATOL, result


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_load(pools, checkpoints, family):
    for result in pools.get(2).run(cases.bf16_load, family=family, folder=str(checkpoints[(family, "single")]), tp=2):
        assert result["diff"] < 0.05 * max(result["scale"], 1.0), result


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_round_trip(pools, checkpoints, tmp_path, family):
    out = tmp_path / "saved"
    results = pools.get(2).run(
        cases.save_round_trip, family=family, folder=str(checkpoints[(family, "sharded")]), out=str(out), tp=2
    )
    assert results[0]["tensors"] > 10
    assert (out / "diffusion_pytorch_model.safetensors.index.json").is_file()


def test_a_tp_models_own_save_pretrained_writes_the_gathered_checkpoint(pools, checkpoints, tmp_path):
    """diffusers' save_pretrained called on a split model: the whole weights that plain diffusers reloads (it used to
    write each rank's slices); `variant=` is refused by name on every rank, before any gather."""
    out = tmp_path / "saved"
    results = pools.get(2).run(cases.save_round_trip, family="flux", folder=str(checkpoints[("flux", "sharded")]),
                               out=str(out), tp=2, through="model")
    assert results[0]["tensors"] > 10
    assert all(result["refused"].startswith("UnsupportedModelError: FluxTransformer2DModel.save_pretrained on a "
                                            "tensor-parallel model") and "['variant']" in result["refused"]
               for result in results), results


def test_save_pretrained_gathers_uneven_head_shards(pools, checkpoints, tmp_path):
    """4 heads over 3 ranks (2 + 1 + 1): the gathered checkpoint equals the original tensor for tensor."""
    out = tmp_path / "saved"
    results = pools.get(3).run(cases.save_round_trip, family="flux2", folder=str(checkpoints[("flux2", "sharded")]),
                               out=str(out), tp=3)
    assert results[0]["tensors"] > 10
