"""What every part of the command line shares, below the parser (`args.py`) and the commands' own modules: the
user-error type, the dtypes a user may name, and the options' values as the workers and the preflight checks read
them (--lora, --quantize-skip, --plan)."""

from __future__ import annotations

import argparse
import math

DTYPES = ("float32", "bfloat16", "float16")  # as api/load_spec.py's (cli/ is imported without torch)


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


# the flag of each LoadSpec field whose flag is not its name (api/load_spec.py; cli/worker.py: load_spec_of)
SPEC_FLAGS = {"loras": "--lora", "gguf": "--gguf", "parallel": "--fsdp", "adapter_slots": "--prompts-file",
              "shard_text_encoders": "--whole-text-encoders", "parallel_vae": "--no-parallel-vae"}


def flag_error(exc) -> CliError:
    """A LoadSpecError as the command line says it: the flag, its value, what would be valid."""
    flag = SPEC_FLAGS.get(exc.field, "--" + exc.field.replace("_", "-"))
    return CliError(f"{flag} {exc.value}: {exc.reason}")


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
        if not path or not math.isfinite(scale):
            raise CliError(f"--lora {spec}: expected PATH[:SCALE] with a finite scale, e.g. style.safetensors:0.8")
        specs.append({"adapter_name": f"lora{index}", "path": path, "scale": scale})
    return specs


def quantize_skip(args: argparse.Namespace) -> tuple[str, ...]:
    """--quantize-skip MODULE[,MODULE] as a tuple of module names (empty without it)."""
    return tuple(name.strip() for name in (getattr(args, "quantize_skip", None) or "").split(",") if name.strip())


def _plan_argument(value: str | None, kind: str):
    """--plan / --cp-plan: None (built-in), "auto", or a plan file (api/load_spec.py: plan_argument)."""
    from paradiff.api.load_spec import plan_argument

    return plan_argument(value, kind)
