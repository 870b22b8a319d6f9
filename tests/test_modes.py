"""Parallel modes: one parser, one printer, and ParallelConfig.from_degrees."""

from __future__ import annotations

import pytest

from paradiff import ContextParallelConfig, ParallelConfig, TensorParallelConfig
from paradiff.config import MODE_DIMENSIONS, mode_name, parse_mode
from paradiff.errors import ParallelConfigError


@pytest.mark.parametrize("mode", ["single", "tp2", "ulysses2", "ring2", "cfg2", "data2", "ulysses2xtp2",
                                  "ring2xulysses2", "data2xcfg2xring2xulysses2xtp2"])
def test_mode_name_and_parse_mode_round_trip(mode):
    assert mode_name(parse_mode(mode)) == mode


@pytest.mark.parametrize("spelling", ["tp2xulysses2", "tp2 x ulysses2", "tp=2xulysses=2", "ulysses2xtp2"])
def test_every_spelling_parses_to_the_same_degrees(spelling):
    assert parse_mode(spelling) == dict(data=1, cfg=1, ring=1, ulysses=2, tp=2)


def test_the_cli_dp_is_data():
    assert parse_mode("tp=2+dp=2".replace("+", "x")) == dict(data=2, cfg=1, ring=1, ulysses=1, tp=2)


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
        data=1, cfg=2, ring=1, ulysses=2, tp=2)


def test_from_degrees_rejects_bad_degrees():
    with pytest.raises(ParallelConfigError):
        ParallelConfig.from_degrees(tp=0)
    with pytest.raises(ParallelConfigError):
        ParallelConfig.from_degrees(cfg=0)
    # a guider with three branches (SkipLayerGuidance) splits over 3 cfg ranks: checked against the pipeline at load
    assert ParallelConfig.from_degrees(cfg=3).cfg_degree == 3
