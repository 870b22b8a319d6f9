"""The plan toolkit: automatic plans, `paradiff check-plan`, `paradiff plans` and the coverage table in docs/coverage.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import rank_cases_families as cases
from paradiff.plan_tools import family_examples as examples
from paradiff.plans.auto import auto_tensor_plan
from paradiff.plan_tools.check_plan import check_plan
from paradiff.plan_tools.coverage import coverage_table
from paradiff_testkit import command

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5


@pytest.mark.parametrize("world,modes", [(2, ["tp2", "ulysses2", "ring2"]), (4, ["tp2xulysses2", "unified2x2"])])
def test_auto_plans_split_a_model_no_builtin_plan_knows(pools, world, modes):
    for by_mode in pools.get(world).run(cases.unplanned_modes, modes=modes):
        for mode, figures in by_mode.items():
            assert figures["diff"] <= TOLERANCE, (mode, figures)
            assert figures["flop_share"] <= 0.75, (mode, figures)
            if mode.startswith("tp"):
                assert figures["bytes_share"] <= 0.75, (mode, figures)


def test_auto_tensor_plans_reproduce_most_builtin_plans():
    """Inside the block stacks, the automatic planner splits most modules of the hand-written plans the same way
    (those also split embedders and modulations outside the blocks, which the planner leaves whole, and name
    family-specific projections the conventions do not cover), and all of them for these families."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    from verify_plans import auto_match

    classes = {}
    for family, example, class_name in examples.all_examples():
        classes.setdefault(class_name, (family, example))
    same = total = 0
    exact = set()
    report = []
    for class_name, (family, example) in classes.items():
        matched, planned = (int(n) for n in auto_match(family, example).split("/"))
        same, total = same + matched, total + planned
        if matched == planned:
            exact.add(class_name)
        report.append(f"{class_name}: {matched}/{planned}")
    print("\n".join(report))
    assert same / total >= 0.6, report
    assert {"WanTransformer3DModel", "SD3Transformer2DModel", "QwenImageTransformer2DModel",
            "PixArtTransformer2DModel", "LTXVideoTransformer3DModel"} <= exact, report


def test_check_plan_points_at_the_first_wrong_module(tmp_path):
    wrong = tmp_path / "wrong_plan.py"
    wrong.write_text(
        "from paradiff import PackedColwise, TensorParallelPlan\n"
        "from paradiff.plans.wan import tensor_parallel_plan as builtin\n"
        "def tensor_parallel_plan(config):\n"
        "    styles = dict(builtin(config).styles)\n"
        "    styles['blocks.*.ffn.net.0.proj'] = PackedColwise([1, 1])  # a plain GELU FF is not packed\n"
        "    return TensorParallelPlan(styles=styles)\n"
    )
    result = check_plan("WanTransformer3DModel", tp=2, plan=str(wrong))
    assert not result.ok
    first = result.first_divergent
    assert first.name == "blocks.0.ffn.net.0", result.table()
    assert "first divergence" in result.table()


def test_check_plan_aligns_heads_and_tokens_under_tp_x_cp(tmp_path):
    """At tp2 x ulysses2 a per-head Q/K norm's output ([batch, tokens, heads, head_dim]) is cut in both tokens and
    heads by the same factor: each rank's output is compared with its own heads of its own token chunk (the demo's
    FLUX.2 once reported a false divergence there), and a deliberately wrong plan is still found."""
    right = check_plan("Flux2Transformer2DModel", tp=2, ulysses=2)
    assert right.ok and right.first_divergent is None, right.table()
    rows = {row.name: row for row in right.rows}
    assert rows["transformer_blocks.0.attn.norm_q"].diff is not None  # compared, not skipped
    wrong = tmp_path / "wrong_plan.py"
    wrong.write_text(
        "from paradiff import TensorParallelPlan\n"
        "from paradiff.plans.flux2 import tensor_parallel_plan as builtin\n"
        "def tensor_parallel_plan(config):\n"
        "    styles = dict(builtin(config).styles)\n"
        "    styles['transformer_blocks.*.ff.linear_in'] = 'colwise'  # SwiGLU's value and gate halves: packed\n"
        "    return TensorParallelPlan(styles=styles)\n"
    )
    result = check_plan("Flux2Transformer2DModel", tp=2, ulysses=2, plan=str(wrong))
    assert not result.ok and result.first_divergent.name == "transformer_blocks.0.ff.act_fn.gate_fn", result.table()
    assert result.table().splitlines()[-1].endswith("(it runs whole on what the modules before it give it)")


def test_check_plan_command_passes_a_builtin_plan_and_reports_every_module(tmp_path, capsys):
    """`paradiff check-plan` at tp2 x ulysses2: exit 0, one row per module with its difference and plan; a degree
    the heads refuse: exit 2 and the reason (through the command's in-process entry point, `paradiff.cli.main`: the
    passing run above is the real subprocess, and the refusal comes before any process or weight matters)."""
    from paradiff.cli import main

    argv = ["-m", "paradiff.cli", "check-plan", "WanTransformer3DModel", "--tp", "2"]
    passed = command.run(argv + ["--ulysses", "2"], timeout=240)
    assert passed.returncode == 0, passed.stdout[-2000:] + passed.stderr[-2000:]
    assert "PASS: WanTransformer3DModel at tp2 x ulysses2" in passed.stdout, passed.stdout[-2000:]
    rows = {line.split()[0]: line.split()[2:] for line in passed.stdout.splitlines()[1:-1]}
    assert "blocks.0.attn1.norm_q" in rows and "proj_out" in rows
    compared = [name for name, rest in rows.items() if rest[0] != "-"]
    assert len(compared) > 0.8 * len(rows)  # shards and token chunks were aligned, not skipped
    assert "norm_across_heads" in " ".join(rows["blocks.0.attn1.norm_q"])
    capsys.readouterr()
    bad_code = main(argv[2:-2] + ["--tp", "5"])
    bad = capsys.readouterr()
    assert bad_code == 2 and "tp_degree=5 is larger than the attention head count" in bad.out + bad.err


def test_plans_command_prints_a_plan_module_that_loads(tmp_path):
    out = command.run(["-m", "paradiff.cli", "plans", "WanTransformer3DModel", "--auto"], timeout=120)
    assert out.returncode == 0, out.stderr
    tensor_source = out.stdout.split('"""Plan for')[1]
    (tmp_path / "plan.py").write_text('"""Plan for' + tensor_source)
    from paradiff.plan_tools.check_plan import load_plan_file

    plan = load_plan_file(str(tmp_path / "plan.py"), "tensor")(None)
    assert plan.styles["blocks.*.attn1.norm_q"] == "norm_across_heads"


def test_plans_command_prints_every_listed_class(tmp_path):
    """`paradiff plans CLASS` for every class the coverage table lists: a built-in plan prints as plan modules that
    load (styles computed from the config, e.g. FLUX's packed single-stream projections, printed as their values),
    a class without one, or that its default arguments cannot build, gives its one-line error; nothing ends in a
    traceback."""
    import argparse
    import contextlib
    import io

    from paradiff.cli.args import CliError
    from paradiff.cli.plans import plans_command
    from paradiff.plan_tools.check_plan import load_plan_file
    from paradiff.plan_tools.coverage import unplanned_transformers
    from paradiff.plans import families

    planned = [name for family in families() for name in family.model_classes]
    refused = []
    for class_name in planned + unplanned_transformers(set(planned)):
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                plans_command(argparse.Namespace(model=class_name, auto=False, pipelines=False, markdown=False))
        except CliError as exc:
            assert "\n" not in str(exc) and class_name in str(exc), str(exc)
            refused.append(class_name)
            continue
        text = out.getvalue()
        assert "<function" not in text and "<lambda" not in text, class_name
        modules = text.split('"""Plan for')[1:]
        assert len(modules) == 2, class_name
        for kind, source in zip(("tensor", "context"), modules):
            path = tmp_path / f"{class_name}_{kind}.py"
            path.write_text('"""Plan for' + source)
            assert load_plan_file(str(path), kind)(None) is not None, class_name
    # planned, but diffusers' defaults build no model (control_layers_places=None) and no tiny example names it
    assert set(refused) - set(unplanned_transformers(set(planned))) == {"ZImageControlNetModel"}
    flux2 = load_plan_file(str(tmp_path / "Flux2Transformer2DModel_tensor.py"), "tensor")(None)
    assert flux2.styles["single_transformer_blocks.*.attn.to_qkv_mlp_proj"].blocks == [1, 1, 1, 3, 3]


def test_readme_coverage_table_is_generated_from_the_code():
    readme = (ROOT / "docs" / "coverage.md").read_text()
    table = coverage_table(markdown=True)
    assert table in readme, "docs/coverage.md's table is stale: run `python tools/verify_plans.py --readme`"
    for family, _, class_name in examples.all_examples():
        assert re.search(rf"\| `{class_name}` \|", readme), class_name
    # diffusers' transformers without a built-in plan are listed as such, and only those
    from paradiff.plan_tools.coverage import unplanned_transformers

    planned = {name for _, _, name in examples.all_examples()}
    missing = unplanned_transformers(planned)
    assert "WanAnimate2Transformer3DModel" in missing or "WanAnimate2Transformer3DModel" in planned
    for class_name in missing:
        assert re.search(rf"\| `{class_name}` \| none \| no \|", readme), class_name


def test_an_input_context_parallelism_cannot_split_is_refused_with_the_reason(pools):
    for message in pools.get(2).run(cases.unsupported_input_message):
        assert "'local_add_cond' is not supported under context parallelism" in message, message
        assert "tensor parallelism only" in message, message
