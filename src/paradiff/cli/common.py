"""What every part of the command line shares, below the parser (`args.py`) and the commands' own modules: the
user-error type, the dtypes a user may name, and the options' values as the workers and the preflight checks read
them (--lora, --quantize-skip, --plan)."""

from __future__ import annotations

import argparse

DTYPES = ("float32", "bfloat16", "float16")


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {number}")
    return number


def lora_specs(args: argparse.Namespace) -> list[dict]:
    """--lora PATH[:SCALE] ... as [{"adapter_name", "path", "scale"}], in order (the names are lora0, lora1...).
    A trailing ':NUMBER' is the scale; a path with other colons (a Hub id, a Windows drive) is left whole."""
    specs = []
    for index, spec in enumerate(getattr(args, "lora", None) or []):
        path, sep, tail = spec.rpartition(":")
        scale = 1.0
        if sep:
            try:
                scale = float(tail)
            except ValueError:
                path = spec
        else:
            path = spec
        if not path:
            raise CliError(f"--lora {spec}: expected PATH[:SCALE], e.g. style.safetensors:0.8")
        specs.append({"adapter_name": f"lora{index}", "path": path, "scale": scale})
    return specs


def quantize_skip(args: argparse.Namespace) -> tuple[str, ...]:
    """--quantize-skip MODULE[,MODULE] as a tuple of module names (empty without it)."""
    return tuple(name.strip() for name in (getattr(args, "quantize_skip", None) or "").split(",") if name.strip())


def _plan_argument(value: str | None, kind: str):
    """--plan / --cp-plan: None (built-in), "auto", or a plan file."""
    if value in (None, "auto"):
        return value
    from paradiff.plan_tools.check_plan import load_plan_file

    return load_plan_file(value, kind)
