"""Never a silent full load: the bytes a rank reads, measured by the kernel, stay within its share."""

from __future__ import annotations

import pytest

import rank_cases_io as cases
from paradiff.testing.models import build_model, save_model

# Besides tensor data, a load reads the safetensors headers, config.json and a little process-group traffic
# (the store exchanges of the agreement and the mesh): 256 KiB covers those with room to spare.
OVERHEAD_BYTES = 256 * 1024


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wide") / "flux2"
    return save_model(build_model("flux2", heads=4, head_dim=64, layers=2, single_layers=2), folder, sharded=True)


@pytest.mark.parametrize("world", [2, 4])
def test_tp_load_reads_only_the_ranks_share(pools, wide_checkpoint, world):
    for result in pools.get(world).run(cases.measured_tp_load, folder=str(wide_checkpoint), tp=world):
        bound = result["share"] + result["headers"] + OVERHEAD_BYTES
        assert result["read"] <= bound, result
        assert result["share"] < 0.6 * result["total"] if world == 2 else result["share"] < 0.35 * result["total"]
        assert result["read"] >= result["share"]  # the measurement is real: at least the data itself was read
