"""CFG parallelism: the conditional and unconditional transformer calls of one denoising step run at the same time
on the two halves of the mesh's cfg dimension, and the predictions are exchanged.

Pipelines call the transformer twice per step (first the conditional branch, then the unconditional one), and use
the first prediction only after the second call returns. So cfg rank 0 computes the first call while cfg rank 1
returns a placeholder and computes the second call; at the end of the second call the two predictions are exchanged
and the placeholder is filled in place. The first step runs both calls on both halves (serially, like diffusers) to
learn the output's structure; every later step runs in parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .comm import all_gather_pieces
from .errors import ParallelConfigError


def _sample_of(output: Any) -> torch.Tensor:
    if torch.is_tensor(output):
        return output
    if isinstance(output, tuple):
        return output[0]
    return output.sample


def _with_sample(template: Any, sample: torch.Tensor) -> Any:
    if torch.is_tensor(template):
        return sample
    if isinstance(template, tuple):
        return (sample,) + tuple(template[1:])
    return type(template)(sample=sample)


@dataclass
class CfgSplitter:
    group: dist.ProcessGroup
    cfg_rank: int
    calls: int = 0
    computed: int = 0  # forwards this rank really ran (for tests and reports)
    probed: bool = False
    placeholder: torch.Tensor | None = None  # cfg rank 1: the first prediction, filled at the exchange
    first_output: torch.Tensor | None = None  # cfg rank 0: its first prediction, kept until the exchange
    template: Any = field(default=None, repr=False)

    def reset(self) -> None:
        self.calls = 0
        self.placeholder = None

    def finish(self) -> None:
        if self.calls % 2:
            raise ParallelConfigError(
                "cfg_degree=2 needs the pipeline to call the transformer twice per step (conditional and "
                f"unconditional), but it made {self.calls} calls. Enable classifier-free guidance (e.g. a negative "
                "prompt with true_cfg_scale > 1, or guidance_scale > 1) or use cfg_degree=1."
            )

    def __call__(self, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        slot = self.calls % 2
        self.calls += 1
        if not self.probed or slot == self.cfg_rank:
            self.computed += 1
        if not self.probed:  # first pair: serial on both halves, records the output structure
            output = forward(*args, **kwargs)
            if slot == 1:
                self.probed = True
            self.template = output
            return output
        sample_template = _sample_of(self.template)
        if slot == 0:
            if self.cfg_rank == 0:
                output = forward(*args, **kwargs)
                self.first_output = _sample_of(output)
                return output
            self.placeholder = torch.empty_like(sample_template)
            return _with_sample(self.template, self.placeholder)
        # second call of the pair: cfg rank 1 computes it; then both predictions are exchanged
        if self.cfg_rank == 1:
            mine = _sample_of(forward(*args, **kwargs))
        else:
            mine, self.first_output = self.first_output, None
        first, second = all_gather_pieces(mine, self.group)
        if self.placeholder is not None:
            self.placeholder.copy_(first)
            self.placeholder = None
        return _with_sample(self.template, second)


def install_cfg_parallel(model: nn.Module, group: dist.ProcessGroup) -> CfgSplitter:
    """Wrap `model.forward` (instance attribute, so hooks still run) with a CfgSplitter on `group` (size 2)."""
    if dist.get_world_size(group) != 2:
        raise ParallelConfigError(f"the cfg group must have 2 ranks, it has {dist.get_world_size(group)}.")
    splitter = CfgSplitter(group=group, cfg_rank=dist.get_rank(group))
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return splitter(original, args, kwargs)

    model.forward = forward
    return splitter
