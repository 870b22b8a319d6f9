"""Wan-Animate 2's self-attention as paradiff runs it, ported from diffusers' `WanAnimate2AttnProcessor` (flex
attention behind a BlockMask) so that it splits: each rank attends its own query rows, one query frame at a time
over exactly the KV-cache slots the mask lets it see, zero slots included. plans/wan_animate2.py says where it goes."""

import torch
import torch.nn.functional as F

from paradiff.context_parallel.attention import even_sizes
from paradiff.runtime.patches import set_processor


class SelfAttention:
    """WanAnimate2AttnProcessor's result for this rank's query rows (all of them without a runtime: the
    single-process form, on SDPA, which torch's FLOP counter can run and eager flex attention cannot)."""

    def __init__(self, runtime=None) -> None:
        self.runtime = runtime

    def __call__(self, attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode, rope_stride=1,
                 reference_rotary_emb=None, reference_grid_sizes=None, reference_rope_stride=1, attention_mask=None,
                 origin_latent_frames=None, origin_latent_hw=None):
        from diffusers.models.transformers.transformer_wan_animate_2 import _get_qkv_projections, rope_apply

        if kv_cache_mode not in ("extract", "cached"):
            raise ValueError(f"`kv_cache_mode` must be either 'extract' or 'cached', got {kv_cache_mode}.")
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        frames, height, width = grid_sizes[0].tolist()
        total, rows = frames * height * width, query.shape[1]
        start = 0
        if self.runtime is not None:  # the split is even_sizes' (context_parallel.apply); keys come in rank order
            start = sum(even_sizes(total, self.runtime.cp_size)[: self.runtime.cp_rank])
            key, value, _ = self.runtime.gathered_keys(key.transpose(1, 2), value.transpose(1, 2), None)
            key, value = key.transpose(1, 2), value.transpose(1, 2)

        def rotate(x, grid, table, stride):
            return rope_apply(x, grid, table, stride).type_as(value)

        # rotary embedding is per token: this rank's rows, placed in a zero sequence of the full length
        whole = query.new_zeros(query.shape[0], total, *query.shape[2:])
        whole[:, start:start + rows] = query
        query = rotate(whole, grid_sizes, rotary_emb, rope_stride)[:, start:start + rows]
        if kv_cache_mode == "extract":
            kv_cache.store(key, value)
        key = rotate(key, grid_sizes, rotary_emb, rope_stride)
        if kv_cache_mode == "extract":
            out = _attend(query, key, value)
        else:
            key_ref, value_ref = kv_cache.get()
            key_ref = rotate(key_ref, reference_grid_sizes, reference_rotary_emb, reference_rope_stride)
            ref_frames, ref_height, ref_width = reference_grid_sizes[0].tolist()
            # the mask's view: a query of generation frame f sees every generation slot (origin frames + 1) and,
            # for f >= 1, reference slot f - 1; a slot holds origin_latent_hw tokens, zero past the segment's
            hw, ref_hw, slot = height * width, ref_height * ref_width, origin_latent_hw
            gen_k, gen_v = (_slots(t, origin_latent_frames + 1, frames, hw, slot).flatten(1, 2)
                            for t in (key, value))
            ref_k, ref_v = (_slots(t, origin_latent_frames, ref_frames, ref_hw, slot) for t in (key_ref, value_ref))
            out = torch.empty_like(query)
            for frame in range(start // hw, (start + rows - 1) // hw + 1):
                part = slice(max(start, frame * hw) - start, min(start + rows, (frame + 1) * hw) - start)
                k, v = gen_k, gen_v
                if 1 <= frame <= origin_latent_frames:
                    k, v = torch.cat([k, ref_k[:, frame - 1]], 1), torch.cat([v, ref_v[:, frame - 1]], 1)
                out[:, part] = _attend(query[:, part], k, v)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _slots(x: torch.Tensor, count: int, frames: int, per_frame: int, slot: int) -> torch.Tensor:
    """(batch, count, slot, heads, head_dim): each frame's tokens at the start of its slot, zeros elsewhere."""
    out = x.new_zeros(x.shape[0], count, slot, *x.shape[2:])
    out[:, :frames, :per_frame] = x[:, :frames * per_frame].unflatten(1, (frames, per_frame))
    return out


def _attend(query, key, value):  # (batch, tokens, heads, head_dim), as diffusers' processors hold them
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (query, key, value))).transpose(1, 2)


def prepare_example(model) -> None:
    # eager flex attention cannot run under torch's FLOP counter: the examples attend through SelfAttention
    # (tests/test_wan_animate2.py checks it equal to diffusers' flex processor)
    for block in model.blocks:
        set_processor(block.self_attn, SelfAttention(), by="example", through_setter=True)


def run_example(model, inputs: dict):
    """Both passes: the reference pass fills a fresh cache, a denoising step reads it; both outputs count."""
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

    # the model builds its BlockMask under torch.compile, ~9 s of inductor per CPU process: built eagerly first (the
    # same mask), under the key the model looks it up by. Only the mask: eager flex attention needs torch.compile
    step = inputs["cached"]
    frames, area = step["origin_len"] // 4 + 1, step["origin_area"][0] * step["origin_area"][1] // 256
    if (frames, area) not in model.block_masks:
        with torch._dynamo.config.patch(disable=True):
            model.block_masks[frames, area] = model.create_mask(frames, area, model.patch_embedding.weight.device)
    cache = WanAnimate2KVCache(len(model.blocks))
    reference = model(**inputs["extract"], kv_cache=cache, kv_cache_mode="extract")
    return reference, model(**step, kv_cache=cache, kv_cache_mode="cached")
