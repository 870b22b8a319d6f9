"""Parallel modes: one parser, one printer, and ParallelConfig.from_degrees."""

from __future__ import annotations

import pytest

from paradiff import ContextParallelConfig, ParallelConfig, TensorParallelConfig
from paradiff.config import MODE_DIMENSIONS, mode_name, mode_world_size, parse_mode
from paradiff.errors import ParallelConfigError


@pytest.mark.parametrize("mode", ["single", "tp2", "ulysses2", "ring2", "cfg2", "data2", "ulysses2xtp2",
                                  "ring2xulysses2", "data2xcfg2xring2xulysses2xtp2", "fsdp2", "fsdp2xulysses2",
                                  "cfg2xfsdp2xtp2"])
def test_mode_name_and_parse_mode_round_trip(mode):
    assert mode_name(parse_mode(mode)) == mode


@pytest.mark.parametrize("spelling", ["tp2xulysses2", "tp2 x ulysses2", "tp=2xulysses=2", "ulysses2xtp2"])
def test_every_spelling_parses_to_the_same_degrees(spelling):
    assert parse_mode(spelling) == dict(data=1, cfg=1, fsdp=1, ring=1, ulysses=2, tp=2)


def test_the_cli_dp_is_data():
    assert parse_mode("tp=2+dp=2".replace("+", "x")) == dict(data=2, cfg=1, fsdp=1, ring=1, ulysses=1, tp=2)


@pytest.mark.parametrize("empty", ["", "single", " single "])
def test_no_parallelism_parses_to_all_ones(empty):
    assert parse_mode(empty) == dict.fromkeys(MODE_DIMENSIONS, 1)


@pytest.mark.parametrize("bad, part", [("tp2xfoo2", "foo2"), ("tp", "tp"), ("tp0", "tp0"), ("tp2x", "")])
def test_a_bad_mode_names_the_bad_part_and_the_valid_names(bad, part):
    with pytest.raises(ValueError) as error:
        parse_mode(bad)
    assert repr(part) in str(error.value)
    assert all(name in str(error.value) for name in MODE_DIMENSIONS)


def test_a_dimension_given_twice_is_an_error():
    with pytest.raises(ValueError, match="'tp' is given twice"):
        parse_mode("tp2xtp2")


def test_mode_name_keeps_a_given_order_and_rejects_unknown_dimensions():
    assert mode_name(dict(tp=2, ring=2, ulysses=2), order=("tp", "ring", "ulysses")) == "tp2xring2xulysses2"
    assert mode_name(dict(tp=2, ulysses=2), separator=" x ") == "ulysses2 x tp2"
    with pytest.raises(ValueError, match="unknown parallel dimension"):
        mode_name(dict(pp=2))


def test_from_degrees_builds_what_hand_written_configs_build():
    assert ParallelConfig.from_degrees() == ParallelConfig()
    assert ParallelConfig.from_degrees(tp=2) == ParallelConfig(tensor_parallel_config=TensorParallelConfig(2))
    assert ParallelConfig.from_degrees(ring=2, ulysses=2, cfg=2, data=2) == ParallelConfig(
        context_parallel_config=ContextParallelConfig(ring_degree=2, ulysses_degree=2), cfg_degree=2, data_degree=2)
    assert ParallelConfig.from_degrees(**parse_mode("cfg2xulysses2xtp2")).degrees() == dict(
        data=1, cfg=2, fsdp=1, ring=1, ulysses=2, tp=2)


@pytest.mark.parametrize("mode, world, dims", [("fsdp2", 2, ("fsdp",)), ("fsdp2xulysses2", 2, ("ring", "ulysses")),
                                               ("fsdp4xring2xulysses2", 4, ("ring", "ulysses")),
                                               ("cfg2xfsdp2", 4, ("fsdp",)), ("fsdp2xtp2", 4, ("fsdp",)),
                                               ("data2xfsdp2xulysses2xtp2", 8, ("ring", "ulysses"))])
def test_fsdp_shares_the_cp_ranks_or_is_a_dimension_of_its_own(mode, world, dims):
    config = ParallelConfig.from_mode(mode)
    assert (config.fsdp_degree, config.world_size, config.fsdp_dims) == (parse_mode(mode)["fsdp"], world, dims)
    assert mode_world_size(mode) == world


@pytest.mark.parametrize("degrees", [dict(fsdp=2, ulysses=4), dict(fsdp=4, ring=2), dict(fsdp=3, ring=2, ulysses=2)])
def test_an_fsdp_degree_other_than_the_cp_degree_is_refused_with_the_valid_one(degrees):
    cp = degrees.get("ring", 1) * degrees.get("ulysses", 1)
    with pytest.raises(ParallelConfigError, match=f"fsdp_degree={degrees['fsdp']} .* fsdp must equal {cp}"):
        ParallelConfig.from_degrees(**degrees)
    with pytest.raises(ParallelConfigError, match="fsdp_degree must be >= 1"):
        ParallelConfig(fsdp_degree=0)


def test_from_degrees_rejects_bad_degrees():
    with pytest.raises(ParallelConfigError):
        ParallelConfig.from_degrees(tp=0)
    with pytest.raises(ParallelConfigError):
        ParallelConfig.from_degrees(cfg=0)
    # a guider with three branches (SkipLayerGuidance) splits over 3 cfg ranks: checked against the pipeline at load
    assert ParallelConfig.from_degrees(cfg=3).cfg_degree == 3
