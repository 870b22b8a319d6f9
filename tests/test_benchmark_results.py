"""Benchmark results are data: every benchmarks/results/*.json follows the schema (benchmarks/results.py), and the
committed BENCHMARKS.md is what benchmarks/report.py generates from them."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_module(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


results = load_module("results")
report = load_module("report")


def test_every_results_file_validates_and_benchmarks_md_is_generated_from_them():
    files = sorted((BENCHMARKS / "results").glob("*.json"))
    assert files, "no results in benchmarks/results"
    loaded = results.load_all()
    assert len(loaded) == len(files)
    scripts = {path.stem for path in BENCHMARKS.glob("*.py")}
    assert {result["benchmark"] for result in loaded} <= scripts
    assert report.OUTPUT.read_text() == report.render(results.load_files()), "run: python benchmarks/report.py"


def test_benchmarks_md_stays_one_page():
    size = len(report.render(results.load_files()).encode())
    assert size < 15_000, (f"BENCHMARKS.md would be {size:,} bytes, over 15,000 (issue 37): fewer headline figures a "
                           "benchmark, shorter names, or a shorter page from benchmarks/report.py")


GOOD = {"benchmark": "bench_x", "title": "one line", "command": "python benchmarks/bench_x.py", "commit": "4e2087b",
        "date": "2026-12-06T09:00:00Z", "machine": {"cpu": "AMD EPYC", "cores": 2, "device": "cpu"},
        "figures": [{"name": "a / b", "value": 1.08, "unit": "x", "goal": "<= 1.15", "met": True, "note": ""}]}


@pytest.mark.parametrize("change, says", [
    ({"commit": "HEAD"}, "commit 'HEAD': expected 7 to 40 lowercase hex digits"),
    ({"date": "2026-12-06 09:00+02:00"}, "expected ISO 8601 in UTC"),
    ({"machine": {"cpu": "AMD EPYC", "cores": 0, "device": "cpu"}}, "machine.cores must be a positive integer, got 0"),
    ({"figures": []}, "figures must be a non-empty list"),
    ({"figures": [{**GOOD["figures"][0], "met": False}]}, "value 1.08 meets goal '<= 1.15', but met is False"),
    ({"figures": [{**GOOD["figures"][0], "goal": None}]}, "met is True but there is no goal"),
    ({"figures": [{**GOOD["figures"][0], "value": "1.08"}]}, "value must be a number, got '1.08'"),
    ({"figures": [{**GOOD["figures"][0], "ratio": 1}]}, "unknown keys ['ratio']"),
])
def test_a_bad_result_is_refused_naming_the_field_and_the_value(change, says):
    assert results.problems(GOOD) == []
    assert any(says in problem for problem in results.problems({**GOOD, **change}))


def test_write_result_names_the_file_after_the_benchmark_and_the_generator_takes_it(tmp_path):
    figures = [results.figure("mixed / same-adapter batch", 1.2, "x", "<= 1.15", note="median of 5 rounds")]
    assert figures[0]["met"] is False
    path = results.write_result("bench_x", "one line", figures, command="python benchmarks/bench_x.py",
                                folder=tmp_path, timed=False)  # timed: the note would depend on this machine's load
    assert path == tmp_path / "bench_x.json"
    written = json.loads(path.read_text())
    assert written["machine"]["cores"] >= 1 and len(written["commit"]) >= 7
    (tmp_path / "bench_y.json").write_text(json.dumps({**GOOD, "benchmark": "bench_x"}))
    with pytest.raises(results.ResultError, match="bench_y.json: benchmark is 'bench_x'; the file must be named"):
        results.load_all(tmp_path)
    (tmp_path / "bench_y.json").unlink()
    text = report.render(results.load_files(tmp_path))
    assert "## Goals: 0 of 1 met" in text
    assert "- bench_x (" in text and "mixed / same-adapter batch 1.2 x, goal <= 1.15; median of 5 rounds" in text
    assert "- [bench_x.json](benchmarks/results/bench_x.json) (" in text
    assert "one line — mixed / same-adapter batch 1.2 x (<= 1.15: **missed**)" in text
