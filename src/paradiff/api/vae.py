"""`paradiff.parallelize_vae`: finds a covered VAE's plan (`plans/vae.py`) and hands it to the mechanism in
`paradiff.vae`, which knows no model."""

from __future__ import annotations

from torch import nn

from paradiff.distributed.comm import CommStats
from paradiff.errors import UnsupportedModelError
from paradiff.plans.vae import VAE_PLANS, vae_plan, vae_refusal
from paradiff.vae import split_vae


def supported_vaes() -> list[str]:
    """The VAE classes paradiff splits across ranks."""
    return sorted(VAE_PLANS)


def parallelize_vae(vae: nn.Module, mesh_or_group=None, *, output_rank: int | None = None,
                    stats: CommStats | None = None) -> nn.Module:
    """Split `vae`'s decode and encode across the ranks of `mesh_or_group`, in place; returns `vae`.

    Afterwards `vae.decode(z)` / `vae.encode(x)`, called on every rank of the group with the same full input, return
    the full result on every rank, equal to a single-device call (see `paradiff.vae.split_vae` for the details,
    `output_rank` and `stats`). `mesh_or_group`: a process group, a paradiff ParallelMesh (each data-parallel replica
    splits over its own ranks), a 1-D DeviceMesh, or None for every process. A VAE class paradiff does not cover is
    refused with the list of those it does, before any collective.
    """
    plan = vae_plan(vae)
    if plan is None:
        raise UnsupportedModelError(
            f"paradiff cannot split {type(vae).__name__} across ranks: {vae_refusal(type(vae).__name__)}; covered "
            f"VAEs: {supported_vaes()}. Leave it as it is: it decodes whole on each rank."
        )
    return split_vae(vae, plan, mesh_or_group, output_rank=output_rank, stats=stats)
