"""What a split VAE carries while it runs: its group, the region call in progress, and the halo plans it learnt.

A region (an encoder or a decoder) is entered with the same full input on every rank; each rank keeps its share of
rows, runs the region's own forward on them and the convolutions, norms and attention inside consult the call in
progress. Stored on the VAE instance, never in a global, so two VAEs in one process stay independent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from paradiff.distributed.comm import CommStats, all_gather_ints
from paradiff.errors import ParadiffError
from paradiff.runtime.patches import PRIVATE_PREFIX
from paradiff.vae.layout import ConvRows, HaloPlan, plan_halo

VAE_ATTR = PRIVATE_PREFIX + "vae"
# Halo plans of this many (region, input height) pairs are kept; a miss costs one small all-gather per convolution.
_KEPT_SHAPES = 8


@dataclass
class RegionCall:
    """One call of a split region: its name and full input height (which fix every layout inside), and how many
    times each convolution ran so far (a module may run more than once per call)."""

    region: str
    height: int
    runs: dict[str, int] = field(default_factory=dict)
    # (first, stop, height) of the output rows of the last split convolution, for noise drawn over a whole frame
    last_conv_rows: tuple[int, int, int] | None = None

    def next_run(self, name: str) -> int:
        run = self.runs.get(name, 0)
        self.runs[name] = run + 1
        return run


@dataclass
class VaeRuntime:
    group: dist.ProcessGroup
    output_rank: int | None = None
    stats: CommStats | None = None
    active: RegionCall | None = None
    # region -> (rows of its input, rows of its output) this rank held in its last split call
    last_split: dict[str, tuple[int, int]] = field(default_factory=dict)
    # (region, input height) -> (module name, run) -> its halo plan or every rank's rows
    _plans: dict[tuple[str, int], dict[tuple[str, int], object]] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def halo_plan(self, name: str, local_height: int, conv: ConvRows, device: torch.device) -> HaloPlan:
        """The exchange for this run of convolution `name`: learnt from every rank's local height the first time
        the region runs at this input height, then reused (every rank misses and hits together, since every rank
        runs the same sequence of convolutions for the same full input)."""
        run, plan = self._learnt(name, local_height, device, lambda heights: plan_halo(conv, heights, self.rank))
        start, stop = plan.in_ranges[self.rank]
        self._check_height(name, run, local_height, stop - start)
        return plan

    def band_heights(self, name: str, local_height: int, device: torch.device) -> tuple[int, ...]:
        """Every rank's rows of the input of this run of module `name`, learnt and reused like the halo plans."""
        run, heights = self._learnt(f"{name}:rows", local_height, device, tuple)
        self._check_height(name, run, local_height, heights[self.rank])
        return heights

    def _learnt(self, name: str, local_height: int, device: torch.device, build):
        call = self.active
        key = (name, call.next_run(name))
        shape_key = (call.region, call.height)
        learnt = self._plans.get(shape_key)
        if learnt is None:
            if len(self._plans) >= _KEPT_SHAPES:
                self._plans.pop(next(iter(self._plans)))
            learnt = self._plans[shape_key] = {}
        value = learnt.get(key)
        if value is None:
            heights = [row[0] for row in all_gather_ints([local_height], self.group, device, self.stats,
                                                         "all_gather_heights")]
            value = learnt[key] = build(heights)
        return key[1], value

    def _check_height(self, name: str, run: int, local_height: int, learnt_height: int) -> None:
        if learnt_height != local_height:
            raise ParadiffError(
                f"{name}: this rank holds {local_height} rows where run {run} of the same region at height "
                f"{self.active.height} held {learnt_height}; the module's input height changed between runs of one "
                "call, which paradiff's split VAE does not support."
            )


def get_vae_runtime(vae) -> VaeRuntime | None:
    return getattr(vae, VAE_ATTR, None)


def set_vae_runtime(vae, runtime: VaeRuntime) -> None:
    object.__setattr__(vae, VAE_ATTR, runtime)  # kept out of nn.Module's registries
