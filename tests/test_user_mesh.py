"""A user DeviceMesh (own dimension names, fewer dimensions, 1-D) shards and computes exactly as the mesh paradiff builds
from the degrees; mesh coordinates are looked up by dimension name."""

from __future__ import annotations

import pytest

import rank_cases_mesh as cases
from paradiff.distributed.mesh import MESH_DIMS, coordinates_from_degrees, mesh_dim_mapping
from paradiff.distributed.parallelism import Parallelism
from paradiff.errors import ParallelConfigError

FAMILY = "flux"


@pytest.mark.parametrize(
    "world,tp,data,shape,names",
    [
        (2, 2, 1, (2,), ("model",)),
        (2, 2, 1, (2,), ("tp",)),
        (4, 4, 1, (4,), ("ranks",)),
        (4, 2, 2, (2, 2), ("replicas", "model")),
        (4, 2, 2, (2, 2), ("data", "tp")),
    ],
    ids=["1d-own-name-2", "1d-tp-2", "1d-own-name-4", "own-names-2x2", "fewer-dims-2x2"],
)
@pytest.mark.parametrize("via", ["from_pretrained", "enable_parallelism"])
def test_user_mesh_gives_the_built_mesh_shards_and_outputs(pools, checkpoints, world, tp, data, shape, names, via):
    results = pools.get(world).run(
        cases.user_mesh_matches_built_mesh, family=FAMILY, folder=str(checkpoints[(FAMILY, "single")]), tp=tp,
        data=data, shape=shape, names=names, via=via,
    )
    for result in results:
        assert result["differing_shards"] == [], result
        assert result["output_diff"] == 0.0, result
        assert result["describe"]["tp"] == tp and result["describe"]["data"] == data, result


def _degrees(**given: int) -> dict[str, int]:
    return {dim: given.get(dim, 1) for dim in MESH_DIMS}


@pytest.mark.parametrize("rank", range(8))
def test_coordinates_of_every_rank_of_a_2x2x2_layout(rank):
    coordinates = coordinates_from_degrees(_degrees(data=2, ring=2, tp=2), rank)
    expected = {"data": rank // 4, "cfg": 0, "fsdp": 0, "ring": rank // 2 % 2, "ulysses": 0, "tp": rank % 2}
    assert coordinates.indices == expected
    assert coordinates.tp_rank == rank % 2
    assert coordinates.cp_rank == rank // 2 % 2
    assert coordinates.replica == rank // 4
    assert coordinates.index("ring", "tp") == rank % 4 and coordinates.size("ring", "tp") == 4
    assert coordinates.size("data", "ring", "tp") == 8


@pytest.mark.parametrize("rank", range(8))
def test_coordinates_of_a_2x2x2_cfg_ulysses_tp_layout(rank):
    coordinates = coordinates_from_degrees(_degrees(cfg=2, ulysses=2, tp=2), rank)
    assert coordinates.indices == {"data": 0, "cfg": rank // 4, "fsdp": 0, "ring": 0, "ulysses": rank // 2 % 2,
                                   "tp": rank % 2}
    assert coordinates.index("ring", "ulysses") == rank // 2 % 2


def test_mesh_dimensions_named_after_paradiffs_map_by_name_in_any_order():
    assert mesh_dim_mapping(_degrees(data=2, tp=4), ("tp", "data"), (4, 2)) == {"tp": 0, "data": 1}


def test_unnamed_mesh_dimensions_take_the_unnamed_degrees_in_paradiffs_order():
    assert mesh_dim_mapping(_degrees(data=2, tp=4), ("outer", "inner"), (2, 4)) == {"data": 0, "tp": 1}
    assert mesh_dim_mapping(_degrees(tp=4), ("gpus",), (4,)) == {"tp": 0}
    assert mesh_dim_mapping(_degrees(data=2, tp=2), ("tp", "hosts"), (2, 2)) == {"tp": 0, "data": 1}


def test_size_one_mesh_dimensions_no_degree_needs_are_ignored():
    assert mesh_dim_mapping(_degrees(tp=2), ("unused", "model"), (1, 2)) == {"tp": 1}


@pytest.mark.parametrize(
    "degrees,names,sizes",
    [
        (_degrees(tp=4), ("gpus",), (2,)),
        (_degrees(tp=2), ("a", "b"), (2, 2)),
        (_degrees(data=2, tp=2), ("gpus",), (4,)),
        (_degrees(tp=2), ("tp",), (4,)),
    ],
    ids=["size-mismatch", "too-many-dims", "too-few-dims", "named-size-mismatch"],
)
def test_a_mesh_that_does_not_fit_the_degrees_is_refused_naming_its_dimensions(degrees, names, sizes):
    with pytest.raises(ParallelConfigError, match=repr(names[0])):
        mesh_dim_mapping(degrees, names, sizes)


# ----------------------------------------------------------------------------------------------------------------
# The registered parallelisms (distributed/parallelism.py): the mesh's dimensions come from them


def test_the_mesh_and_the_modes_have_the_registrys_dimensions_and_degrees():
    from paradiff.api.parallelisms import REGISTRY
    from paradiff.config import MODE_DIMENSIONS, ParallelConfig
    from paradiff.distributed.mesh import CP_DIMS, REPLICA_DIMS
    from paradiff.distributed.parallelism import PARALLELISMS

    assert PARALLELISMS.dims == MESH_DIMS == MODE_DIMENSIONS == REGISTRY.dims
    assert MESH_DIMS == ("data", "cfg", "fsdp", "ring", "ulysses", "tp")
    assert CP_DIMS == PARALLELISMS.get("cp").dims == ("ring", "ulysses")
    assert REPLICA_DIMS == ("cfg", "fsdp", "ring", "ulysses", "tp")
    assert REGISTRY.apply_order[:3] == ("tp", "cp", "fsdp")  # torchtitan's order: TP, CP, (compile), FSDP
    config = ParallelConfig.from_degrees(tp=2, ulysses=2, fsdp=2, cfg=2)
    assert config.degrees() == PARALLELISMS.degrees(config) == {"data": 1, "cfg": 2, "fsdp": 1, "ring": 1,
                                                                "ulysses": 2, "tp": 2}
    assert [p.name for p in REGISTRY.parallelisms if p.enabled(config)] == ["cfg", "fsdp", "cp", "tp"]
    with pytest.raises(ParallelConfigError, match="fsdp_degree=3 with context parallelism of 2 ranks"):
        ParallelConfig.from_degrees(ulysses=2, fsdp=3)  # FSDP's own refusal, asked by the config
    with pytest.raises(ValueError, match="distinct"):
        PARALLELISMS.adding(PARALLELISMS.get("tp"))
    with pytest.raises(ValueError, match="binds 'cp' with dimensions"):
        PARALLELISMS.binding(RingOnly())


class RingOnly(Parallelism):
    name, dims = "cp", ("ring",)


def test_a_parallelism_of_its_own_gets_its_dimension_and_patches_without_touching_the_others(pools):
    results = pools.get(2).run(cases.a_parallelism_of_its_own_gets_a_dimension_and_its_patches)
    for rank, result in enumerate(results):
        assert result["mesh_dims"] == ["data", "cfg", "pipe", "fsdp", "ring", "ulysses", "tp"], result
        assert result["describe"]["pipe"] == 2 and result["pipe_rank"] == rank, result
        assert result["model_dims"] == ["pipe"] and result["model_group_is_pipe"], result
        assert result["apply_order"] == ["tp", "cp", "pipe", "fsdp", "cfg", "data"], result
        pipe_patches = [line for line in result["applied"] if line.endswith("(by pipe)")]
        assert len(pipe_patches) == 1 and pipe_patches[0].startswith("hook forward: "), result["applied"]
        assert result["patched_shift"] == pytest.approx(10.0 * rank), result
        assert result["left"] == [] and result["removed"] >= 1 and result["unpatched_equal"], result
        assert result["global_dims_unchanged"], result
