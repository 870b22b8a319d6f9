"""Context-parallel attention as a torch.library custom op, the form in which torch.compile sees it.

Dynamo cannot trace what CP attention does between its inputs and its output (length exchanges whose results size
the uneven splits, the ring's batched point-to-point transfers), and has no need to: to the compiled graph it is one
op from this rank's q/k/v rows to this rank's output rows, whose shape the fake implementation states without
running anything. Process groups cross the op boundary by their registered names.
"""

from __future__ import annotations

import torch

from paradiff.distributed.comm import group_from_name
from paradiff.context_parallel.dispatch import attend


@torch.library.custom_op("paradiff::cp_attention", mutates_args=())
def cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    mode: str,
    backend: str,
    local: bool,
    cp_group: str,
    ring_group: str,
    ulysses_group: str,
    text_tokens: int | None,
    image_tokens: int | None,
) -> torch.Tensor:
    out = attend(query, key, value, attn_mask, scale, mode, backend, local, group_from_name(cp_group),
                 group_from_name(ring_group), group_from_name(ulysses_group), text_tokens, image_tokens)
    # The compiled graph assumes the layout the fake implementation states; kernels may return a transposed view.
    return out.contiguous()


@cp_attention.register_fake
def _cp_attention_fake(query, key, value, attn_mask, scale, mode, backend, local, cp_group, ring_group,
                       ulysses_group, text_tokens, image_tokens):
    return query.new_empty(query.shape[:-1] + (value.shape[-1],))
