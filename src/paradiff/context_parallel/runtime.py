"""Attention interception: every `F.scaled_dot_product_attention` issued inside an attention module is routed to
ring / Ulysses / unified attention.

diffusers' processors all end in SDPA when the attention backend is "native" (the default), whatever the processor
class, so intercepting SDPA with a TorchFunctionMode active only while an attention module runs serves every model
without knowing its processors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from paradiff.distributed.comm import (CommStats, all_gather_int, all_gather_ints, all_gather_uneven, all_true, group_name)
from paradiff.errors import ParallelConfigError
from paradiff.context_parallel.attention import even_sizes, local_attention, ring_attention, ulysses_attention
from paradiff.context_parallel.kernels import BACKENDS, RETURNS_LSE, check_backend, default_scale, merge_lse


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


@dataclass
class ContextParallelRuntime:
    """The groups and settings one CP model's attention uses. Owned by the model's ParallelState."""

    mode: str  # "ring", "ulysses" or "unified"
    cp_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup | None
    ulysses_group: dist.ProcessGroup | None
    backend: str = "native"
    stats: CommStats | None = None
    # full lengths of the arguments split in the current forward, by argument name, recorded where they are split
    full_tokens: dict[str, int] = field(default_factory=dict)
    # stream -> (full tokens, tokens per rank) of its last GridSplit, which Split(like=stream) follows
    grid_layouts: dict[str, tuple[int, list[int]]] = field(default_factory=dict)

    @property
    def cp_rank(self) -> int:
        return dist.get_rank(self.cp_group)

    @property
    def cp_size(self) -> int:
        return dist.get_world_size(self.cp_group)

    def set_backend(self, name: str) -> None:
        check_backend(name, self.mode)
        self.backend = name

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, local: bool = False, gather_keys: bool = False, prefix: int | None = None):
        if prefix is not None and key.shape[2] == prefix:
            # keys and queries are the replicated prefix alone (Cosmos3's causal text): every rank computes it whole
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if gather_keys:
            key, value, attn_mask = self.gathered_keys(key, value, attn_mask)
            local = True
        if enable_gqa and key.shape[1] != query.shape[1]:
            # grouped K/V heads: give every query head its K/V head, as SDPA's enable_gqa does (exact)
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
            enable_gqa = False
        if dropout_p != 0.0 or is_causal or enable_gqa:
            raise NotImplementedError(
                f"Context-parallel attention supports dropout_p=0, is_causal=False, enable_gqa=False; got "
                f"dropout_p={dropout_p}, is_causal={is_causal}, enable_gqa={enable_gqa}."
            )
        scale = default_scale(query.shape[-1]) if scale is None else scale
        if prefix is not None:
            return self.prefix_attention(query, key, value, attn_mask, scale, prefix)
        text, image = self.full_tokens.get("encoder_hidden_states"), self.full_tokens.get("hidden_states")
        if torch.compiler.is_compiling():
            # One opaque op for Dynamo: the ring's point-to-point transfers, the length exchanges that size the
            # uneven splits and the ranks' agreement on a mask cannot be traced, and need not be (they run between
            # two graph ops).
            from paradiff.context_parallel.ops import cp_attention

            return cp_attention(query, key, value, attn_mask, float(scale), self.mode, self.backend, local,
                                group_name(self.cp_group), group_name(self.ring_group), group_name(self.ulysses_group),
                                text, image)
        return attend(query, key, value, attn_mask, scale, self.mode, self.backend, local, self.cp_group,
                      self.ring_group, self.ulysses_group, text, image, self.stats)

    def prefix_attention(self, query, key, value, attn_mask, scale, prefix: int):
        """Keys [replicated prefix, this rank's split tokens]: the prefix is attended locally, the split tokens across
        the ranks, and the two parts merged by log-sum-exp. Exact."""
        if attn_mask is not None:
            raise NotImplementedError("Attention over a replicated key prefix takes no mask.")
        if not RETURNS_LSE[self.backend]:
            raise ParallelConfigError(f"Attention over a replicated key prefix merges partial results by log-sum-exp, "
                                      f"which backend {self.backend!r} does not return.")
        kernel = BACKENDS[self.backend]
        extra = (key[:, :, :prefix], value[:, :, :prefix])
        key, value = key[:, :, prefix:], value[:, :, prefix:]
        if self.mode == "ring":
            out, lse = ring_attention(query, key, value, None, scale, kernel, self.ring_group, self.stats,
                                      return_lse=True)
            out, _ = merge_lse(out, lse, *kernel(query, *extra, None, scale))
            return out.to(query.dtype)
        ring_group = self.ring_group if self.mode == "unified" else None
        return ulysses_attention(query, key, value, None, scale, kernel, self.ulysses_group, self.stats,
                                 ring_group=ring_group, extra_kv=extra)

    def gathered(self, tensor: torch.Tensor, dim: int, sizes: list[int] | None = None) -> tuple[torch.Tensor, int]:
        """Every rank's `tensor` concatenated along `dim` in rank order (lengths may differ), and where this rank's
        piece starts: for a computation a plan runs over the whole sequence (a recurrence over frames). `sizes`, the
        lengths in rank order when the caller knows them, saves gathering them."""
        if sizes is None:
            sizes = all_gather_int(tensor.shape[dim % tensor.dim()], self.cp_group, tensor.device)
        return all_gather_uneven(tensor, dim, sizes, self.cp_group, self.stats), sum(sizes[: self.cp_rank])

    def gathered_keys(self, key, value, attn_mask):
        """Every rank's keys and values (and the key mask's columns when it covers only this rank's keys), in rank
        order: for cross-attention from split queries to another split, short stream (Motif-Video's text)."""
        lengths = all_gather_int(key.shape[2], self.cp_group, key.device)
        key = all_gather_uneven(key, 2, lengths, self.cp_group, self.stats)
        value = all_gather_uneven(value, 2, lengths, self.cp_group, self.stats)
        if attn_mask is not None:
            mask = normalise_mask(attn_mask)
            if mask.shape[2] != 1:
                raise NotImplementedError(f"Attention with gathered keys takes a key mask (one row for all queries); "
                                          f"got shape {tuple(attn_mask.shape)}.")
            if lengths[self.cp_rank] == 0:
                # a rank holding none of these keys has no mask columns either; a model cutting the key mask from
                # the end of a longer one by a negative offset ([-0:]) hands it every column
                mask = mask[..., :0]
            # the ranks decide together: a rank holding every key cannot tell a local mask from a whole one alone
            if all_true(mask.shape[-1] == lengths[self.cp_rank], self.cp_group, mask.device):
                mask = all_gather_uneven(mask.expand(key.shape[0], *mask.shape[1:]).contiguous(), 3, lengths,
                                         self.cp_group, self.stats)
            attn_mask = mask
        return key, value, attn_mask


def attend(query, key, value, attn_mask, scale: float, mode: str, backend: str, local: bool,
           cp_group: dist.ProcessGroup, ring_group: dist.ProcessGroup | None,
           ulysses_group: dist.ProcessGroup | None, text_tokens: int | None = None, image_tokens: int | None = None,
           stats: CommStats | None = None) -> torch.Tensor:
    """This rank's rows of attention over the whole (split) sequence, by `mode`; `local` attends to local keys only.

    `text_tokens` / `image_tokens`: full lengths of the two streams split in this forward (None when not split),
    which place a whole-sequence mask's rows and columns in the order the ranks hold the tokens."""
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
    kernel = BACKENDS[backend]
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


class AttentionInterceptor(TorchFunctionMode):
    """Active only inside an attention module's forward; replaces SDPA by the CP attention."""

    def __init__(self, runtime: ContextParallelRuntime, local: bool, gather_keys: bool = False) -> None:
        super().__init__()
        self.runtime = runtime
        self.local = local
        self.gather_keys = gather_keys
        self.prefix: int | None = None  # replicated key prefix of the call in flight (prefix_attention modules)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.runtime.attention(*args, **kwargs, local=self.local, gather_keys=self.gather_keys,
                                          prefix=self.prefix)
        if func is torch.Tensor.unflatten and torch.compiler.is_compiling():
            # Dynamo inlines every call routed through a mode; Tensor.unflatten's Python wrapper calls
            # super().unflatten, which it cannot trace, while the functional form is an ordinary graph op.
            func = torch.unflatten
        return func(*args, **kwargs)


def require_native_processors(model: torch.nn.Module, replaced: frozenset[str] = frozenset()) -> None:
    """diffusers backends other than native bypass SDPA (and so the interception): refuse them up front, except in
    the modules whose processor the plan replaces."""
    for name, module in model.named_modules():
        if name in replaced:
            continue
        processor = getattr(module, "processor", None)
        backend = getattr(processor, "_attention_backend", None)
        if backend is not None and str(getattr(backend, "value", backend)) != "native":
            raise ParallelConfigError(
                f"{name}: diffusers attention backend {backend!r} bypasses paradiff's attention; reset it with "
                "model.reset_attention_backend() and choose a kernel with paradiff.set_attention_backend(model, name)."
            )
