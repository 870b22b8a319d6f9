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

from paradiff.distributed.comm import CommStats, all_gather_int, all_gather_uneven, all_true, group_name
from paradiff.errors import ParallelConfigError
from paradiff.context_parallel.attention import ring_attention, ulysses_attention
from paradiff.context_parallel.dispatch import (  # noqa: F401 - attend's masks, still importable from here
    _one_head_bool_mask, attend, in_split_order, is_square_bool, normalise_mask, padding_masks)
from paradiff.context_parallel.kernels import BACKENDS, RETURNS_LSE, default_scale, merge_lse
from paradiff.context_parallel.ops import cp_attention


@dataclass
class ContextParallelRuntime:
    """The groups and settings one CP model's attention uses. Owned by the model's ParallelState."""

    mode: str  # "ring", "ulysses" or "unified"
    cp_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup | None
    ulysses_group: dist.ProcessGroup | None
    backend: str = "native"  # an attention/backends.py name, set by paradiff.set_attention_backend (a recorded patch)
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
