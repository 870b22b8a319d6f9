"""Which bytes of an original-format single file (GGUF) each diffusers parameter is made of.

diffusers' `from_single_file` runs the model class's checkpoint converter (`diffusers.loaders.single_file_utils`,
through its SINGLE_FILE_LOADABLE_CLASSES table) on the whole state dict: renames, and for fused original tensors
row splits (`torch.chunk` of FLUX's fused QKV), row swaps (the (shift, scale) -> (scale, shift) of a final AdaLN)
and row concatenations. paradiff runs the same converter, once, on *probe* tensors: one per stored tensor, with
its number of rows but a single column, each row holding (tensor index, row index) as an exact float64. What comes
out names, for every diffusers parameter, the runs of source rows it is made of, with no weight read. A converter
that changes values, mixes columns or drops rows cannot be followed this way and is refused by parameter name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from paradiff.errors import CheckpointError

_ROW_BITS = 32  # a probe value is index * 2**32 + row: exact in float64 for 2**21 tensors of up to 2**32 rows


@dataclass(frozen=True)
class Run:
    """Rows [start, start + length) of stored tensor `source` are rows [at, at + length) of a parameter."""

    source: str
    start: int
    length: int
    at: int


def _probe(index: int, shape: Sequence[int]) -> torch.Tensor:
    if not shape:
        return torch.tensor(float(index << _ROW_BITS), dtype=torch.float64)
    rows = torch.arange(shape[0], dtype=torch.float64) + float(index << _ROW_BITS)
    return rows.reshape(shape[0], *([1] * (len(shape) - 1)))


def converter_for(model_cls: type) -> Any:
    """diffusers' checkpoint converter for `model_cls` (the single-file loader's own table), or a clear error."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES, _get_single_file_loadable_mapping_class

    name = _get_single_file_loadable_mapping_class(model_cls)
    if name is None:
        raise CheckpointError(
            f"{model_cls.__name__} has no single-file loader in diffusers (from_single_file supports "
            f"{', '.join(SINGLE_FILE_LOADABLE_CLASSES)}), so paradiff cannot map a GGUF file's tensor names to it."
        )
    return SINGLE_FILE_LOADABLE_CLASSES[name]["checkpoint_mapping_fn"]


def parameter_runs(model_cls: type, config: Any, stored: dict[str, tuple[int, ...]],
                   expected: dict[str, tuple[int, ...]]) -> dict[str, list[Run]]:
    """diffusers state_dict name -> the runs of stored rows it is made of, for every name in `expected` (name ->
    shape). `stored`: stored tensor name -> torch-order shape. As diffusers does, a file whose names already are
    the model's is taken as it is."""
    names = list(stored)
    if set(expected) == set(stored):
        converted = {name: _probe(i, stored[name]) for i, name in enumerate(names)}
    else:
        from diffusers.loaders.single_file_model import _get_mapping_function_kwargs

        convert = converter_for(model_cls)
        probes = {name: _probe(i, stored[name]) for i, name in enumerate(names)}
        kwargs = _get_mapping_function_kwargs(convert, config=config)
        try:
            with torch.no_grad():
                converted = convert(checkpoint=probes, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised with what paradiff needs
            raise CheckpointError(
                f"diffusers' converter {getattr(convert, '__name__', convert)} for {model_cls.__name__} failed on "
                f"the file's tensor names and row structure ({type(exc).__name__}: {exc}); it needs whole tensors, "
                "which paradiff does not read on every rank. Convert the file to diffusers names first."
            ) from None
    missing = sorted(name for name in expected if name not in converted)
    if missing:
        raise CheckpointError(
            f"{len(missing)} tensor(s) of {model_cls.__name__} are not in the single file after diffusers' name "
            f"conversion, e.g. {missing[:5]}."
        )
    return {name: _runs(name, converted[name], names, stored, expected[name]) for name in expected}


def _runs(name: str, probe: Any, names: list[str], stored: dict[str, tuple[int, ...]],
          shape: tuple[int, ...]) -> list[Run]:
    def refuse(why: str) -> CheckpointError:
        return CheckpointError(
            f"{name}: diffusers' converter builds this parameter from the single file in a way paradiff cannot "
            f"slice ({why}); only renames and row splits, swaps and concatenations are followed."
        )

    if not isinstance(probe, torch.Tensor) or probe.dtype != torch.float64:
        raise refuse(f"it is a {type(probe).__name__} {getattr(probe, 'dtype', '')}, not a stored tensor's rows")
    values = probe.reshape(probe.shape[0], -1) if probe.dim() else probe.reshape(1, 1)
    if values.shape[1] != 1:
        raise refuse(f"its columns were combined, shape {list(probe.shape)}")
    values = values[:, 0]
    if not torch.equal(values, values.floor()) or (values < 0).any():
        raise refuse("its values were changed")
    codes = values.to(torch.int64)
    indices, rows = (codes >> _ROW_BITS).tolist(), (codes & ((1 << _ROW_BITS) - 1)).tolist()
    runs: list[Run] = []
    for at, (index, row) in enumerate(zip(indices, rows)):
        if index >= len(names):
            raise refuse("its values were changed")
        source = names[index]
        last = runs[-1] if runs else None
        if last is not None and last.source == source and last.start + last.length == row:
            runs[-1] = Run(source, last.start, last.length + 1, last.at)
        else:
            runs.append(Run(source, row, 1, at))
    rows_out = shape[0] if shape else 1
    if len(codes) != rows_out:
        raise refuse(f"it has {len(codes)} rows where the model expects shape {list(shape)}")
    for run in runs:
        source_shape = stored[run.source]
        if tuple(source_shape[1:]) != tuple(shape[1:]) or len(source_shape) != len(shape):
            raise CheckpointError(
                f"{name}: made of rows of stored tensor {run.source!r} of shape {list(source_shape)}, but the model "
                f"expects shape {list(shape)}."
            )
    return runs
