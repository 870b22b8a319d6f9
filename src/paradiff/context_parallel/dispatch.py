"""Context-parallel attention over tensors: this rank's rows of attention over the whole (split) sequence by ring,
Ulysses or unified attention, and the masks it takes.

Below both the interception (`runtime.py`) and the custom op Dynamo sees (`ops.py`), which both call `attend`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paradiff.distributed.comm import CommStats, all_gather_ints, all_true
from paradiff.context_parallel.attention import even_sizes, local_attention, ring_attention, ulysses_attention
from paradiff.attention.backends import BACKENDS, refusal


def normalise_mask(attn_mask: torch.Tensor | None) -> torch.Tensor | None:
    """An SDPA mask as a 4-D (batch or 1, heads or 1, queries or 1, keys) bool mask or additive float bias, its
    leading dims added as SDPA broadcasts them.

    The dtype alone decides bool or bias, never the values, so every rank takes the same path."""
    if attn_mask is None:
        return None
    if not 1 <= attn_mask.dim() <= 4:
        raise NotImplementedError(
            f"Context parallelism takes attention masks of 1 to 4 dims (up to (batch, heads, queries, keys)), as "
            f"SDPA does; got shape {tuple(attn_mask.shape)}."
        )
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    # a key mask expanded over the queries or heads (stride 0, e.g. Lumina's .expand(-1, heads, queries, -1)) is
    # still a key mask: keep one row, which splits with the keys
    if mask.shape[2] > 1 and mask.stride(2) == 0:
        mask = mask[:, :, :1]
    if mask.shape[1] > 1 and mask.stride(1) == 0:
        mask = mask[:, :1]
    return mask


def _one_head_bool_mask(attn_mask: torch.Tensor | None) -> bool:
    """A (batch, 1, rows, keys) bool mask: the same answer on every rank of a forward (it depends on no length)."""
    return attn_mask is not None and attn_mask.dtype == torch.bool and attn_mask.dim() == 4 and attn_mask.shape[1] == 1


def is_square_bool(attn_mask: torch.Tensor | None, queries: int, keys: int) -> bool:
    """A bool mask with one row and one column per token this rank holds (a whole-sequence mask has more)."""
    return (attn_mask is not None and attn_mask.dtype == torch.bool and attn_mask.dim() == 4
            and attn_mask.shape[1] == 1 and queries == keys == attn_mask.shape[2] == attn_mask.shape[3])


def attend(query, key, value, attn_mask, scale: float, mode: str, backend: str, local: bool,
           cp_group: dist.ProcessGroup, ring_group: dist.ProcessGroup | None,
           ulysses_group: dist.ProcessGroup | None, text_tokens: int | None = None, image_tokens: int | None = None,
           stats: CommStats | None = None) -> torch.Tensor:
    """This rank's rows of attention over the whole (split) sequence, by `mode`; `local` attends to local keys only.

    `text_tokens` / `image_tokens`: full lengths of the two streams split in this forward (None when not split),
    which place a whole-sequence mask's rows and columns in the order the ranks hold the tokens.

    A backend that cannot run this call (its device, dtype, mask or head size; the LSE a ring merges by) is refused
    here, before any collective: every rank sees the same kind of call and raises alike."""
    kernel = BACKENDS[backend]
    conditions = dict(device=query.device, dtype=query.dtype, mask=attn_mask is not None,
                      needs_lse=not local and mode != "ulysses", head_dim=query.shape[-1])
    reason = kernel.supports(**conditions)
    if reason is not None:
        raise refusal(backend, reason, **conditions)
    query_mask = None
    if not local and _one_head_bool_mask(attn_mask):
        # Whether this is a padding mask over the rank's own tokens is decided by all ranks together: a rank holding
        # a single token sees a key mask (one row) as a 1 x 1 square, and deciding alone it would take the padding
        # path (with its collective) while the others do not.
        flags = all_gather_ints([int(is_square_bool(attn_mask, query.shape[2], key.shape[2])), attn_mask.shape[2]],
                                cp_group, attn_mask.device, stats, "cp mask kind")
        if all(square for square, _ in flags) and any(rows > 1 for _, rows in flags):
            attn_mask, query_mask = padding_masks(attn_mask, cp_group)
    mask = normalise_mask(attn_mask)
    if local:  # queries and mask rows are both this rank's; keys are whole
        return local_attention(query, key, value, mask, scale, kernel)
    if mask is not None and mask.shape[-1] != key.shape[2] and mask.shape[2] == 1:
        raise NotImplementedError(
            f"A key-padding mask under context parallelism must be split with the keys: it has "
            f"{mask.shape[-1]} keys, this rank holds {key.shape[2]}. Split the mask in the context-parallel plan "
            "where its tokens are split."
        )
    # a mask with one row is a key mask, split with the tokens; one with a row per query covers the whole sequence
    key_mask, sequence_mask = (mask, None) if mask is None or mask.shape[2] == 1 else (None, mask)
    if sequence_mask is not None:
        sequence_mask = in_split_order(sequence_mask, text_tokens, image_tokens, dist.get_world_size(cp_group))
    if mode == "ring":
        out = ring_attention(query, key, value, key_mask, scale, kernel, ring_group, stats,
                             sequence_mask=sequence_mask)
    else:
        out = ulysses_attention(query, key, value, key_mask, scale, kernel, ulysses_group, stats,
                                ring_group=ring_group if mode == "unified" else None, sequence_mask=sequence_mask)
    if query_mask is not None:  # SDPA gives rows with every key masked a zero output
        out = out.masked_fill(~query_mask[:, None, :, None], 0)
    return out


def padding_masks(mask: torch.Tensor, cp_group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """A (batch, 1, tokens, tokens) mask over this rank's own tokens built as valid[q] & valid[k] (HunyuanVideo
    1.5's context padding), as a key mask and a query mask. The ranks decide together whether it is one."""
    valid = mask.diagonal(dim1=-2, dim2=-1)  # (batch, 1, tokens)
    is_padding = torch.equal(mask, valid[..., :, None] & valid[..., None, :])
    if not all_true(is_padding, cp_group, mask.device):
        raise NotImplementedError(
            f"Context parallelism supports (batch, 1, tokens, tokens) masks over a rank's own tokens only when "
            f"they mask padding (valid query & valid key); this {tuple(mask.shape)} mask is another kind (e.g. "
            "causal). Give the mask a row per query of the whole sequence instead."
        )
    return valid[:, :, None, :], valid[:, 0, :]


def in_split_order(mask: torch.Tensor, text: int | None, image: int | None, size: int) -> torch.Tensor:
    """A whole-sequence mask of a joint (text + image) sequence, reordered so that rank r's tokens are the r-th
    contiguous chunk, as ring and Ulysses attention take it: with both streams split, a rank holds
    [its text chunk, its image chunk] (text first), not a contiguous chunk of the joint sequence."""
    if text is None or image is None or mask.shape[-1] != text + image:
        return mask
    order = []
    text_sizes, image_sizes = even_sizes(text, size), even_sizes(image, size)
    for rank in range(size):
        start = sum(text_sizes[:rank])
        order.append(torch.arange(start, start + text_sizes[rank]))
        start = text + sum(image_sizes[:rank])
        order.append(torch.arange(start, start + image_sizes[rank]))
    order = torch.cat(order).to(mask.device)
    return mask.index_select(-2, order).index_select(-1, order)
