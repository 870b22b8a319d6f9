"""`paradiff check-plan` and `paradiff plans`."""

from __future__ import annotations

import argparse

from paradiff.errors import ParadiffError
from paradiff.cli.args import CliError


def check_plan_command(args: argparse.Namespace) -> int:
    from paradiff.plan_tools.check_plan import check_plan

    try:
        result = check_plan(args.model, tp=args.tp, ulysses=args.ulysses, ring=args.ring, plan=args.plan,
                            cp_plan=args.cp_plan, example=args.example, inputs=args.inputs,
                            tolerance=args.tolerance)
    except ParadiffError as exc:
        raise CliError(str(exc)) from None
    lines = result.table().splitlines()
    body, tail = lines[:-2 if result.first_divergent else -1], lines[len(lines) - (2 if result.first_divergent else 1):]
    if not args.all and len(body) > 60:
        first = result.first_divergent
        keep = body[:41] + [f"... {len(body) - 61} modules ..."] + body[-20:]
        if first is not None:
            keep += [line for line in body if line.startswith(first.name) and "first divergence" in line]
        body = keep
    print("\n".join(body + tail))
    return 0 if result.ok else 1


def plans_command(args: argparse.Namespace) -> int:
    from paradiff.plan_tools.coverage import coverage_table

    if args.pipelines:
        if args.model is not None or args.auto:
            raise CliError("paradiff plans --pipelines takes no class name and no --auto: it prints the pipeline "
                           "coverage table (add --markdown for docs/pipeline-coverage.md's form).")
        from paradiff.plan_tools.pipeline_coverage import pipeline_coverage_table

        print(pipeline_coverage_table(markdown=args.markdown))
        return 0
    if args.model is None:
        print(coverage_table(markdown=args.markdown))
        return 0
    from paradiff.plans.auto import plan_source
    from paradiff.plan_tools.check_plan import _build, resolve_target
    from paradiff.plans import plan_for

    try:
        target = resolve_target(args.model) if not args.auto else None
    except ParadiffError:
        target = None
    try:
        if target is None:
            from paradiff.plan_tools.family_examples import model_class

            cls = model_class(args.model)
            import torch

            try:
                with torch.device("meta"):
                    model = cls(**_small_config(cls))
            except Exception as exc:  # diffusers' constructors check their defaults with asserts and TypeErrors
                raise CliError(f"{args.model} cannot be built from its default arguments ({type(exc).__name__}: "
                               f"{exc}); give a checkpoint folder of it instead: paradiff plans path/to/model"
                               ) from None
        else:
            model = _build(target)
        given = "auto" if args.auto else None
        for kind in ("tensor", "context"):
            print(plan_source(plan_for(model, given, kind), kind, args.model, model.config))
    except ParadiffError as exc:
        raise CliError(str(exc)) from None
    return 0


def _small_config(cls) -> dict:
    """The class's default config with its layer counts cut to 2: the structure is all the planner reads."""
    import inspect

    config = {}
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if isinstance(parameter.default, int) and not isinstance(parameter.default, bool) and \
                name.startswith("num_") and name.endswith("layers") and parameter.default > 2:
            config[name] = 2
    return config
