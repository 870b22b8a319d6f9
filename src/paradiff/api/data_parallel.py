"""Data parallelism over a pipeline's replicas: which replica this rank is in, and its share of a list of inputs."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch.distributed as dist

from paradiff.runtime.state import get_state


def data_coordinates(pipeline_or_model: Any = None) -> tuple[int, int]:
    """(index, size) of this rank along the data dimension (world rank/size when nothing is parallelised)."""
    model = getattr(pipeline_or_model, "transformer", pipeline_or_model)
    state = get_state(model) if model is not None else None
    if state is not None:
        return state.mesh.local_rank("data"), state.mesh.size("data")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1



@contextmanager
def split_between_processes(items: Sequence[Any], pipeline_or_model: Any = None,
                            apply_padding: bool = False) -> Iterator[Sequence[Any]]:
    """Yield this data-parallel replica's contiguous share of `items` (same contract as accelerate's).

    Replicas get sizes differing by at most one; with `apply_padding` every share is padded with the last item to
    the longest share, so collective steps stay in lockstep.
    """
    index, size = data_coordinates(pipeline_or_model)
    base, extra = divmod(len(items), size)
    start = index * base + min(index, extra)
    share = items[start : start + base + (1 if index < extra else 0)]
    if apply_padding and len(items) and len(share) < base + (1 if extra else 0):
        share = list(share) + [items[-1]] * (base + (1 if extra else 0) - len(share))
    yield share
