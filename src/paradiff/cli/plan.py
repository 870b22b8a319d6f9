"""`paradiff plan`: every feasible mesh of a world size for a model and a size, with predicted per-rank memory, step
time and latency, and the recommended one; `--calibrate` measures this machine into a profile first (docs/plan.md).

The parser is built here (no torch import); the command imports the cost model only when it runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from paradiff.cli.common import DTYPES, CliError, _positive


def add_plan_parser(commands) -> argparse.ArgumentParser:
    plan = commands.add_parser("plan", help="predict every mesh of --world ranks for a model and a size, and "
                                            "recommend one (from the config alone: no weights; docs/plan.md)")
    plan.add_argument("model", nargs="?", default=None,
                      help="a reference name (flux.1-dev, flux.2-dev, qwen-image, wan2.1-t2v-14b, wan2.1-i2v-14b, "
                           "hunyuan-video, ltx-video), a pipeline or transformer folder, or a config.json")
    plan.add_argument("--height", type=_positive, default=1024)
    plan.add_argument("--width", type=_positive, default=1024)
    plan.add_argument("--frames", type=_positive, default=None, help="frames per video (video models)")
    plan.add_argument("--steps", type=_positive, default=50)
    plan.add_argument("--world", type=_positive, default=1, help="ranks to plan for")
    plan.add_argument("--profile", default="h100-sxm",
                      help="a built-in hardware profile (h100-sxm, h100-pcie, h200, b200, a100-80gb, l40s, rtx4090; "
                           "from public specs) or a calibrated profile's JSON file")
    plan.add_argument("--device-memory", type=float, default=None, metavar="GB",
                      help="memory per device in GB (default: the profile's)")
    plan.add_argument("--dtype", choices=(*DTYPES, "float8"), default="bfloat16")
    plan.add_argument("--guidance-scale", type=float, default=None,
                      help="the pipeline's guidance scale (default: the pipeline's own); at or under 1 no CFG")
    plan.add_argument("--negative-prompt", action="store_true",
                      help="a negative prompt will be given (pipelines like Qwen-Image guide only then)")
    plan.add_argument("--all", action="store_true", help="list every mesh, the infeasible ones with why")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--calibrate", action="store_true",
                      help="measure this machine's devices first (GEMM, attention, collectives at --world ranks) "
                           "and plan with that profile")
    plan.add_argument("--save", default=None, metavar="FILE", help="with --calibrate: write the profile as JSON")
    return plan


def plan_command(args: argparse.Namespace) -> int:
    from paradiff.plan_tools.cost import CostModelError
    from paradiff.plan_tools.hardware import load_profile

    if args.save and not args.calibrate:
        raise CliError("--save FILE writes a calibrated profile: add --calibrate.")
    if args.model is None and not args.calibrate:
        raise CliError("paradiff plan needs a model (a reference name, a folder or a config.json), or --calibrate "
                       "to measure this machine only.")
    if args.device_memory is not None and args.device_memory <= 0:
        raise CliError(f"--device-memory {args.device_memory:g}: give the device's memory in GB, above 0.")
    try:
        if args.calibrate:
            from paradiff.plan_tools.calibrate import calibrate

            profile = calibrate(args.world)
            if args.save:
                Path(args.save).write_text(profile.to_json())
            print(f"calibrated: {profile.source}")
            print(_profile_line(profile))
            if args.model is None:
                return 0
        else:
            profile = load_profile(args.profile)
        from paradiff.plan_tools.planner import plan

        result = plan(args.model, height=args.height, width=args.width, frames=args.frames, steps=args.steps,
                      world=args.world, profile=profile, dtype=args.dtype, device_memory_gb=args.device_memory,
                      guidance_scale=args.guidance_scale, negative_prompt=args.negative_prompt)
    except CostModelError as exc:
        raise CliError(str(exc)) from None
    print(json.dumps(plan_json(result), indent=1) if args.json else plan_text(result, every=args.all))
    return 0 if result.recommended is not None else 1


def _profile_line(profile) -> str:
    gemm = ", ".join(f"{dtype} {rate / 1e12:.3g} TFLOP/s" for dtype, rate in profile.gemm_flops.items())
    links = ", ".join(f"{op} {link.bandwidth / 1e9:.3g} GB/s + {link.latency_s * 1e6:.0f} us"
                      for op, link in profile.links.items())
    elementwise = (profile.elementwise_bandwidth or profile.memory_bandwidth) / 1e9
    factor = f"; block factor {profile.block_factor:.3g}" if profile.block_factor != 1.0 else ""
    fsdp = (f"; FSDP {profile.fsdp_unit_s * 1e3:.3g} ms a unit + {1e-9 / profile.fsdp_byte_s:.3g} GB/s gathered"
            if profile.fsdp_unit_s and profile.fsdp_byte_s else "")
    return (f"GEMM {gemm}; elementwise {elementwise:.3g} GB/s; {profile.op_overhead_s * 1e6:.3g} us per op{factor}; "
            f"{links}{fsdp}")


def plan_text(result, every: bool = False) -> str:
    shape, profile = result.shape, result.profile
    lines = [f"{result.source.name}: {shape.family}, {_count(shape.params)} parameters, {result.latent} latent + "
             f"{shape.text_tokens} text tokens, {result.branches} transformer call(s) per step, {result.steps} steps",
             f"profile {profile.name}: {profile.source}",
             f"{'mesh':<28} {'GB/rank':>8} {'step s':>9} {'latency s':>10} {'img/s':>7} {'comm %':>7}  notes"]
    shown = result.predictions if every else [p for p in result.predictions if p.feasible]
    for p in shown:
        total = p.compute_s + p.comm_s
        comm = 100 * p.comm_s / total if total else 0.0
        mark = " <- recommended" if p is result.recommended else ""
        lines.append(f"{p.mesh.name:<28} {p.memory.total / 1e9:>8.1f} {p.step_s:>9.3f} {p.latency_s:>10.2f} "
                     f"{p.images_per_s:>7.3f} {comm:>6.0f}%  {'; '.join(p.problems)}{mark}")
    hidden = len(result.predictions) - len(shown)
    if hidden:
        lines.append(f"({hidden} infeasible meshes not shown; --all lists them with why)")
    lines.append(f"recommended: {result.recommended.mesh.name if result.recommended else 'none'}: {result.reason}")
    return "\n".join(lines)


def _count(params: float) -> str:
    """A parameter count as people write it: 12.0 B, 86 M, 420 k."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if params >= scale:
            return f"{params / scale:.3g} {unit}"
    return f"{params:.0f}"


def plan_json(result) -> dict:
    return {
        "model": result.source.name, "family": result.shape.family, "parameters": result.shape.params,
        "latent_tokens": result.latent, "text_tokens": result.shape.text_tokens, "steps": result.steps,
        "calls_per_step": result.branches, "profile": result.profile.name, "profile_source": result.profile.source,
        "recommended": result.recommended.mesh.name if result.recommended else None, "reason": result.reason,
        "meshes": [{"mesh": p.mesh.name, "feasible": p.feasible, "problems": p.problems,
                    "memory_bytes": {"weights": p.memory.weights, "gathered": p.memory.gathered,
                                     "activations": p.memory.activations, "total": p.memory.total},
                    "forward_flops": p.forward.flops, "forward_bytes": p.forward.bytes,
                    "step_flops": p.forward.flops * p.forwards, "wire_bytes_per_forward": p.forward.wire_bytes(),
                    "compute_s": p.compute_s, "comm_s": p.comm_s, "step_s": p.step_s, "latency_s": p.latency_s,
                    "images_per_s": p.images_per_s, "imbalance": p.imbalance} for p in result.predictions],
    }


def resolve_auto_parallel(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """`--parallel auto` of generate / serve: set the degrees `paradiff plan` recommends for the model folder, the
    size, the guidance and --world, and return the argv the workers get, with the degrees written out (so every
    worker runs the same mesh without planning again). Under torchrun each rank plans from the same files and
    arguments: a pure function of them, so every rank picks the same mesh."""
    import os

    from paradiff.plan_tools.cost import CostModelError
    from paradiff.plan_tools.hardware import load_profile
    from paradiff.plan_tools.planner import plan

    given = [f"--{name} {getattr(args, name)}" for name in ("tp", "ulysses", "ring", "cfg", "dp", "fsdp")
             if getattr(args, name) != 1]
    if given:
        raise CliError(f"--parallel auto picks the degrees itself: drop {', '.join(given)} (or drop --parallel auto)")
    world = args.world or (int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None)
    if world is None:
        raise CliError("--parallel auto needs the number of ranks: add --world N (under torchrun, its WORLD_SIZE)")
    if args.model is None:
        from paradiff.cli.embedded import embedded_default

        model = str(embedded_default())
    else:
        model = args.model
    try:
        result = plan(model, height=args.height, width=args.width, frames=args.frames, steps=args.steps or 4,
                      world=world, profile=load_profile(args.profile), dtype=args.dtype,
                      guidance_scale=args.true_cfg_scale if args.true_cfg_scale is not None else args.guidance_scale,
                      negative_prompt=args.negative_prompt is not None)
    except CostModelError as exc:
        raise CliError(f"--parallel auto: {exc}") from None
    choice = next((p for p in result.predictions if p.feasible and _fsdp_holds(args, p.mesh)), None)
    if choice is None:
        raise CliError(f"--parallel auto: no mesh of {world} ranks fits: {result.reason}")
    mesh = choice.mesh
    args.tp, args.ulysses, args.ring, args.cfg, args.dp = mesh.tp, mesh.ulysses, mesh.ring, mesh.cfg, mesh.data
    args.fsdp = mesh.fsdp
    args.parallel = args.world = None  # resolved: the degrees now say it all (and the workers' argv drops both)
    if os.environ.get("RANK", "0") == "0":
        from paradiff.runtime.console import say

        say(f"paradiff: --parallel auto on {world} ranks ({result.profile.name}): {mesh.name}, predicted "
            f"{choice.step_s:.3g} s per step, {choice.memory.total / 1e9:.3g} GB per rank")
    kept, skip = [], 0
    for index, item in enumerate(argv):
        if skip:
            skip -= 1
            continue
        if item in ("--parallel", "--world", "--profile"):
            skip = 1
            continue
        if item.startswith(("--parallel=", "--world=", "--profile=")):
            continue
        kept.append(item)
    return kept + ["--tp", str(mesh.tp), "--ulysses", str(mesh.ulysses), "--ring", str(mesh.ring),
                   "--cfg", str(mesh.cfg), "--dp", str(mesh.data), "--fsdp", str(mesh.fsdp)]


def _fsdp_holds(args: argparse.Namespace, mesh) -> bool:
    """Whether `--fsdp` takes this mesh with the run's other flags: the rules api/fsdp.py's check_fsdp raises."""
    from paradiff.fsdp.refusals import fsdp_refusal

    return mesh.fsdp == 1 or fsdp_refusal(mesh.fsdp, mesh.tp, getattr(args, "quantize", None),
                                          single_file=bool(getattr(args, "gguf", None)),
                                          stages=bool(getattr(args, "stages", False))) is None
