"""What context parallelism needs of the attention backends (`paradiff/attention/`): which can serve a CP mode, and
the log-sum-exp (LSE) merge of partial results.

Ring attention computes a query block against one key/value block at a time; the partial outputs are combined
exactly with their LSEs: out = sum_i exp(lse_i - lse) * out_i, lse = log sum_i exp(lse_i). Merging happens in fp32.
The kernels and their registry live in `paradiff/attention/` (below this package: the same backends run a model
without CP); their names stay importable from here.
"""

from __future__ import annotations

import torch

from paradiff.attention.backends import (  # noqa: F401 - the backends' names, still importable from here
    BACKENDS, RETURNS_LSE, AttentionBackend, Kernel, able_backends, available_backends, backend_named, check_available)
from paradiff.attention.kernels import (  # noqa: F401
    aligned_bias, dead_rows, default_scale, flash_attn_attention, math_attention, native_attention, sdpa_attention)
from paradiff.errors import ParallelConfigError


def check_backend(name: str, mode: str) -> None:
    """A backend must exist here and, for ring and unified attention, return the LSE."""
    backend = check_available(name)
    if mode in ("ring", "unified") and not backend.returns_lse:
        can = able_backends(needs_lse=True)
        raise ParallelConfigError(
            f"Attention backend {name!r} returns no log-sum-exp, which {mode} attention needs to merge blocks; "
            f"backends that can serve {mode}: {can}."
        )


def merge_lse(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention results over disjoint key sets (fp32): `out` (fp32, not aliasing `block_out`)
    is updated in place and returned, no output-sized tensor allocated; the first call takes `block_out` as it is.

    A row whose keys are all masked in both has lse = -inf: it keeps a zero output (its weights are exp(-inf) = 0,
    taken against 0 instead of the -inf total)."""
    if out is None:
        return block_out.float(), block_lse.float()
    new_lse = torch.logaddexp(lse, block_lse)
    total = new_lse.nan_to_num(neginf=0.0)  # -inf only where both are: their weights below are then exp(-inf) = 0
    keep_old = torch.sub(lse, total).exp_().unsqueeze(-1)
    keep_new = torch.sub(block_lse, total).exp_().unsqueeze(-1)
    return out.mul_(keep_old).addcmul_(block_out, keep_new), new_lse
