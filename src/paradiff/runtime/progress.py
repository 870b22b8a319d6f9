"""Progress output for long work: a bar on rank 0 when stderr is a terminal, silence otherwise."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist


def is_main_rank() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


@contextmanager
def byte_progress(total: int, description: str, enabled: bool | None = None) -> Iterator[callable]:
    """Yield an `advance(nbytes)` callback; the bar shows only on rank 0 and only on a terminal unless forced."""
    show = is_main_rank() and (sys.stderr.isatty() if enabled is None else enabled)
    if not show:
        yield lambda nbytes: None
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=description, file=sys.stderr)
    try:
        yield bar.update
    finally:
        bar.close()
