"""Per-rank memory on paper, from a model's config alone: nothing is read, no process group exists.

`per_rank_bytes` builds the model on the meta device and takes each weight's share with the code the load itself
uses: the TP plan resolved for the rank (`tensor_parallel.plan.resolve_plan`), then FSDP2's rows of that slice
(`fsdp.shard.chunk_rows`). So its `weights` figure is the bytes a real load holds (tests/test_fsdp.py checks it
against one). The gathered and activation figures are estimates: FSDP2 holds the running block and the prefetched
next one gathered, or the largest module outside the blocks while it runs (each is a unit of its own), plus any
weights left to the root; activations count the
residual stream, q / k / v / attention output and the MLP hidden of one block at a time, for this rank's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paradiff.config import ParallelConfig
from paradiff.fsdp.shard import chunk_rows, outside_units
from paradiff.runtime.repeated_blocks import repeated_blocks

GIB = 1 << 30


@dataclass
class RankMemory:
    """Bytes one rank needs; `peak` is their sum."""

    weights: int  # held between steps: its shards (all of a weight FSDP or TP does not split)
    gathered: int  # while running: two blocks' (running + prefetched) or the largest outside unit, and the root's
    activations: int  # one block's activations for this rank's tokens (estimate)
    tokens: int  # this rank's sequence length (image / video tokens after CP, plus the text)
    host: int = 0  # with fsdp_offload: the shards, held in CPU memory instead of `weights` on the device

    @property
    def peak(self) -> int:
        return self.weights + self.gathered + self.activations

    def lines(self) -> list[str]:
        offloaded = [f"CPU (offloaded)  {size(self.host)}  (FSDP's shards, --fsdp-offload)"] if self.host else []
        return [f"weights held     {size(self.weights)}", *offloaded, f"gathered (FSDP)  {size(self.gathered)}",
                f"activations      {size(self.activations)}  ({self.tokens} tokens / rank, estimate)",
                f"peak             {size(self.peak)}"]


def size(count: int) -> str:
    return f"{count / GIB:8.2f} GiB" if count >= GIB // 10 else f"{count / (1 << 20):8.2f} MiB"


def meta_model(model_cls: type, config: dict) -> nn.Module:
    """The model of `config` on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        return model_cls.from_config(config)


def per_rank_bytes(model: nn.Module, parallel: ParallelConfig, dtype: torch.dtype = torch.bfloat16, *,
                   tp_plan: Any = None, image_tokens: int = 0, text_tokens: int = 0,
                   weight_bytes_per_element: float | None = None) -> RankMemory:
    """Rank 0's memory under `parallel` for `model` (on meta). `tp_plan`: the TP plan resolved for rank 0 (the
    caller's `resolve_plan`; needed when tp > 1). `weight_bytes_per_element`: e.g. 1 for int8 weight-only (scales
    aside), default the dtype's size. With `parallel.fsdp_offload` the shards are counted in `host`, not on the
    device."""
    itemsize = weight_bytes_per_element or torch.empty((), dtype=dtype).element_size()
    act_itemsize = torch.empty((), dtype=dtype).element_size()
    fsdp = parallel.fsdp_degree

    def local_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        spec = tp_plan.spec_for(name) if tp_plan is not None else None
        return tuple(shape) if spec is None else spec.local_shape(shape)

    def numel(shape) -> int:
        count = 1
        for size in shape:
            count *= size
        return count

    blocks = repeated_blocks(model)
    block_of = {id(p): name for name, block in blocks for p in block.parameters()}
    unit_of = {id(p): index for index, unit in enumerate(outside_units(model, [block for _name, block in blocks]))
               for p in unit.parameters()}
    held, block_full, unit_full, root_full = 0, {}, {}, 0
    for name, param in model.named_parameters():
        shape = local_shape(name, tuple(param.shape))
        whole = numel(shape)
        if fsdp > 1 and shape:
            whole = chunk_rows(shape[0], 0, fsdp)[1] * numel(shape[1:])
        held += int(whole * itemsize)
        full = int(numel(shape) * itemsize)
        if id(param) in block_of:
            block_full[block_of[id(param)]] = block_full.get(block_of[id(param)], 0) + full
        elif id(param) in unit_of:
            unit_full[unit_of[id(param)]] = unit_full.get(unit_of[id(param)], 0) + full
        else:
            root_full += full
    gathered = 0
    if fsdp > 1:
        largest = sorted(block_full.values(), reverse=True)[:2]
        gathered = root_full + max(sum(largest), max(unit_full.values(), default=0))
    config = getattr(model, "config", {})
    heads = config.get("num_attention_heads", 1)
    hidden = heads * config.get("attention_head_dim", 64)
    mlp = config.get("ffn_dim") or int(config.get("mlp_ratio", 4.0) * hidden)
    cp = parallel.ring_degree * parallel.ulysses_degree
    tokens = -(-image_tokens // cp) + text_tokens
    tp = parallel.tp_degree
    activations = tokens * act_itemsize * (2 * hidden + (4 * hidden + mlp) // tp)
    if parallel.fsdp_offload:  # FSDP2's CPU offload keeps every shard (blocks and root) in host memory
        return RankMemory(weights=0, gathered=gathered, activations=activations, tokens=tokens, host=held)
    return RankMemory(weights=held, gathered=gathered, activations=activations, tokens=tokens)


def image_tokens_of(config: dict, height: int, width: int, frames: int | None, vae_scale: int = 8,
                    temporal_scale: int = 4) -> int:
    """Latent tokens the transformer sees at this resolution and frame count (patch size from the config; a model
    with patch_size 1 and 64 or more input channels takes latents packed 2x2 by its pipeline, as FLUX does)."""
    patch = config.get("patch_size", 1)
    if patch == 1 and config.get("in_channels", 0) >= 64:
        patch = 2
    patch_t, patch_h, patch_w = (tuple(patch) if isinstance(patch, (list, tuple)) else (1, patch, patch))
    latent_frames = 1 if not frames else (frames - 1) // temporal_scale + 1
    return (-(-latent_frames // patch_t)) * (height // vae_scale // patch_h) * (width // vae_scale // patch_w)


def fsdp_to_fit(model: nn.Module, parallel: ParallelConfig, budget_bytes: int, **kwargs: Any) -> int | None:
    """The smallest FSDP degree (a power of two up to 64, equal to the CP degree when CP is on) whose peak fits
    `budget_bytes`; None when none does."""
    cp = parallel.ring_degree * parallel.ulysses_degree
    candidates = [cp] if cp > 1 else [2 ** k for k in range(1, 7)]
    for degree in candidates:
        trial = ParallelConfig.from_degrees(tp=parallel.tp_degree, ulysses=parallel.ulysses_degree,
                                            ring=parallel.ring_degree, cfg=parallel.cfg_degree,
                                            data=parallel.data_degree, fsdp=degree)
        if per_rank_bytes(model, trial, **kwargs).peak <= budget_bytes:
            return degree
    return None
