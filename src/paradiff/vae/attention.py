"""A VAE's self-attention over tokens split by rows: every `F.scaled_dot_product_attention` issued inside a
declared attention module runs over the keys of every rank.

"tokens": unmasked attention over the rank's rows (diffusers' Attention, Wan's per-frame block) goes through
paradiff's ring attention, so no rank holds more than two ranks' keys at once.
"causal_frames": tokens ordered (frame, row, column) where a query sees keys of its own and earlier frames
(HunyuanVideo's mid block). The model's mask was built from the local shape and is replaced: keys and values are
gathered, regrouped frame by frame, and each query frame attends to the prefix of frames it may see.
"linear" (DC-AE's ReLU linear attention, no SDPA) is `paradiff.vae.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from paradiff.distributed.comm import all_gather_int, all_gather_uneven
from paradiff.context_parallel.attention import ring_attention
from paradiff.context_parallel.kernels import BACKENDS, default_scale
from paradiff.errors import ParadiffError
from paradiff.vae.runtime import VaeRuntime

KINDS = ("tokens", "causal_frames", "linear")  # "linear": paradiff/vae/linear.py


class RowAttention(TorchFunctionMode):
    """Active only while its module runs inside a split region."""

    def __init__(self, runtime: VaeRuntime, kind: str, name: str, require_call: bool = True) -> None:
        super().__init__()
        self.runtime = runtime
        self.kind = kind
        self.name = name
        # a module with a processor must attend through SDPA, or it would attend to this rank's rows only
        self.require_call = require_call
        self.frames = 0
        self.calls = 0

    def frames_from(self, _block, args) -> None:
        """Pre-hook of the block around a "causal_frames" attention: its (batch, channels, frames, ...) input."""
        self.frames = args[0].shape[2]

    def enter(self, _module, _args) -> None:
        if self.runtime.active is None:
            return
        self.calls = 0
        self.__enter__()

    def leave(self, _module, _args, output) -> None:
        if self.runtime.active is None:
            return
        self.__exit__(None, None, None)
        if self.require_call and self.calls == 0 and output is not None:  # None when the forward raised
            # a processor that does not end in SDPA would have attended to this rank's rows only
            raise ParadiffError(
                f"{self.name} ran without calling torch.nn.functional.scaled_dot_product_attention, so paradiff "
                "could not spread its attention over every rank's rows; use diffusers' AttnProcessor2_0."
            )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        return self.attention(*args, **kwargs)

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        if dropout_p != 0.0 or is_causal or enable_gqa:
            raise NotImplementedError(
                f"{self.name}: split VAE attention supports dropout_p=0, is_causal=False, enable_gqa=False; got "
                f"dropout_p={dropout_p}, is_causal={is_causal}, enable_gqa={enable_gqa}."
            )
        scale = default_scale(query.shape[-1]) if scale is None else scale
        if query.dim() == 3:  # (batch, tokens, dim): one head
            mask = None if attn_mask is None else attn_mask.unsqueeze(-3)
            return self.attention(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask, scale=scale
                                  ).squeeze(1)
        if self.kind == "tokens":
            if attn_mask is not None:
                raise NotImplementedError(f"{self.name}: a masked attention was declared as unmasked ('tokens').")
            return ring_attention(query, key, value, None, scale, _kernel(query), self.runtime.group,
                                  self.runtime.stats)
        return self._causal_frames(query, key, value, attn_mask, scale)

    def _causal_frames(self, query, key, value, attn_mask, scale):
        frames, local = self.frames, query.shape[2]
        if attn_mask is not None and tuple(attn_mask.shape[-2:]) != (local, local):
            raise NotImplementedError(f"{self.name}: expected the model's own (local x local) frame mask, got "
                                      f"{tuple(attn_mask.shape)}.")
        lengths = all_gather_int(key.shape[2], self.runtime.group, key.device)
        if any(length % frames for length in lengths):
            raise ParadiffError(f"{self.name}: token counts {lengths} are not whole frames of {frames}.")

        def by_frame(tensor):  # rank-major -> (batch, heads, frames, all tokens of a frame, dim)
            full = all_gather_uneven(tensor, 2, lengths, self.runtime.group, self.runtime.stats, "all_gather_kv")
            return torch.cat([piece.unflatten(2, (frames, -1)) for piece in full.split(lengths, dim=2)], dim=3)

        keys, values = by_frame(key), by_frame(value)
        queries = query.unflatten(2, (frames, -1))
        out = [F.scaled_dot_product_attention(queries[:, :, t], keys[:, :, : t + 1].flatten(2, 3),
                                              values[:, :, : t + 1].flatten(2, 3), scale=scale)
               for t in range(frames)]
        return torch.stack(out, dim=2).flatten(2, 3)


def _kernel(query: torch.Tensor):
    """A kernel that returns the log-sum-exp for this head size. VAE mid blocks attend with one head of 384-512
    channels: CUDA's flash and memory-efficient kernels are built for head sizes up to 256, so larger heads take the
    plain fp32 kernel there (its score block is local queries x one rank's keys)."""
    if query.device.type == "cuda" and query.shape[-1] > 256:
        return BACKENDS["math"]
    return BACKENDS["native"]
