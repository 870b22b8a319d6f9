"""Exception types: each names what was wrong and what would be valid.

All derive from ValueError or RuntimeError so callers catching the builtin types keep working. `native_message`: any
error's first line as a console line shows it.
"""

import re

# a C++ source location gloo and c10d put before their messages: "[/__w/pytorch/.../unbound_buffer.cc:129] "
NATIVE_SOURCE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cxx|h|hpp):\d+\]\s*")


def native_message(exc: BaseException, limit: int | None = 200) -> str:
    """The first line of an error (at most `limit` characters), without the C++ source location a backend's starts
    with."""
    first = (str(exc).splitlines() or [""])[0]
    return NATIVE_SOURCE.sub("", first)[:limit]


class ParadiffError(Exception):
    """Base of every paradiff error."""


class ParallelConfigError(ParadiffError, ValueError):
    """A degree, combination or mesh that cannot work with the ranks at hand."""


class PlanError(ParadiffError, ValueError):
    """A parallel plan that does not match the model (unknown style, bad glob, indivisible sizes...)."""


class BlockSplitError(PlanError):
    """A blockwise quantized format (NF4 blocks of 64) whose blocks a rank's slice of a layer would cut."""


class CheckpointError(ParadiffError, ValueError):
    """A checkpoint that is missing, not safetensors, truncated, or disagrees with the model."""


class UnsupportedModelError(ParadiffError, ValueError):
    """A model state that cannot be sharded (quantized, offloaded, LoRA-adapted...)."""


class DistributedError(ParadiffError, RuntimeError):
    """torch.distributed is missing, or ranks disagree."""


class AdapterError(ParadiffError, ValueError):
    """A LoRA adapter that does not fit the model (shape, unknown target), cannot be split, or differs between ranks."""


class LoadSpecError(ParadiffError, ValueError):
    """A LoadSpec field with a value that cannot be loaded: `field`, `value`, and `reason` (what would be valid)."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(f"LoadSpec {field}={value!r}: {reason}")
        self.field, self.value, self.reason = field, value, reason


class ServeSettingsError(ParadiffError, ValueError):
    """A server setting (serve/settings.py: ServeSettings) with a value that cannot serve: `field`, `value`, and the
    message, which names each setting it mentions through `said(name)`: as the field (`str(error)`), or as the
    command line's flag (`error.said(lambda field: "--" + field.replace("_", "-"))`)."""

    def __init__(self, field: str, value: object, message: str) -> None:
        # message: a str.format template whose {field} placeholders are the settings it names
        self.field, self.value, self.message = field, value, message
        super().__init__(self.said(str))

    def said(self, name) -> str:
        """The message with each setting it names written as `name(field)`."""
        return self.message.format_map(_Names(name))


class _Names(dict):
    def __init__(self, name) -> None:
        super().__init__()
        self.name = name

    def __missing__(self, field: str) -> str:
        return self.name(field)
