"""Wan-Animate 2 (`WanAnimate2Transformer3DModel`): Wan-style blocks run twice over a KV cache. The reference pass
(`kv_cache_mode="extract"`) stores each self-attention's pre-rotary K/V; every denoising step (`"cached"`) attends
over the generation tokens plus, per generation frame, the cached reference frame before it, which diffusers packs
into a 128-aligned buffer of full-video-sized frame slots (zeros where the segment is smaller) behind a flex
BlockMask.

Under TP the cache holds each rank's heads. Under CP each rank projects its own tokens, the self-attention's keys
and values are all-gathered (so the cache holds every token's, on every rank) and each rank attends its own query
rows; the packed layout is attended one query frame at a time over exactly the slots the mask lets it see, zero
slots included (`SelfAttention`, models/wan_animate2.py)."""

import torch

from paradiff.runtime.patches import set_processor
from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.models.wan_animate2 import SelfAttention
from paradiff.plans.common import Grid, mlp
from paradiff.plans.family import Family

MODEL_CLASSES = ("WanAnimate2Transformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        "blocks.*.ffn.0": "colwise",
        "blocks.*.ffn.2": "rowwise",
        **mlp("text_embedding", "0", "2"),
        **mlp("time_embedding", "0", "2"),
        "time_projection.1": "rowwise_split_input",
    }
    for attn in ("self_attn", "cross_attn"):  # QK-norms are RMSNorms over all heads: split with them
        styles.update({f"blocks.*.{attn}.to_{x}": "colwise" for x in "qkv"})
        styles.update({f"blocks.*.{attn}.to_out.0": "rowwise", f"blocks.*.{attn}.norm_q": "norm_across_heads",
                       f"blocks.*.{attn}.norm_k": "norm_across_heads"})
    if config.use_img_emb:  # CLIP image tokens get their own K/V
        styles.update({"blocks.*.cross_attn.add_k_proj": "colwise", "blocks.*.cross_attn.add_v_proj": "colwise",
                       "blocks.*.cross_attn.norm_added_k": "norm_across_heads", **mlp("img_emb.proj", "1", "3")})
    return TensorParallelPlan(styles=styles, heads_config_key="num_heads")


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={"blocks.0": {"hidden_states": Split(1)}},
        gather_outputs={"head": 1},
        # self-attention gathers its keys itself (SelfAttention); cross-attention reads the replicated context
        processors={"blocks.*.self_attn": SelfAttention},
        local_attention=("blocks.*.self_attn", "blocks.*.cross_attn"),
    )


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


EXAMPLES = {
    "wan-animate2": ("WanAnimate2Transformer3DModel", dict(
        patch_size=(1, 2, 2), text_len=8, in_dim=8, dim=64, ffn_dim=128, freq_dim=32, text_dim=32, out_dim=4,
        num_heads=4, num_layers=2, refer_stride=2)),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    p_t, p_h, p_w = config.patch_size
    channels = config.in_dim // 2  # latents and condition latents, concatenated

    def latents(frames, height, width):
        return [torch.randn(channels, frames * p_t, height * p_h, width * p_w, generator=generator)
                for _ in range(batch)]

    # a reference of 2 frames x 3 x 4 tokens (its own grid); a generation segment of grid's size, both smaller than
    # the full video's 3 + 1 frames x 20 tokens (origin_len 8, 64 x 80 pixels), so the packed slots hold zeros
    reference_grid = torch.tensor([[2, grid.height, grid.width - 1]] * batch)
    # texts of their own lengths, padded by the model to text_len; the last is shorter
    text = [torch.randn(grid.text - 3 * (index == batch - 1), config.text_dim, generator=generator)
            for index in range(batch)]
    common = dict(encoder_hidden_states=text, return_dict=False,
                  encoder_hidden_states_image=torch.randn(batch, 4, 1280, generator=generator))
    return {
        "extract": dict(hidden_states=latents(2, grid.height, grid.width - 1),
                        condition_latents=latents(2, grid.height, grid.width - 1),
                        timestep=torch.zeros(batch), seq_len=2 * grid.height * (grid.width - 1),
                        offset_grid_sizes=reference_grid, **common),
        "cached": dict(hidden_states=latents(grid.frames, grid.height, grid.width),
                       condition_latents=latents(grid.frames, grid.height, grid.width),
                       timestep=torch.rand(batch, generator=generator) * 1000,
                       seq_len=grid.frames * grid.height * grid.width, reference_grid_sizes=reference_grid,
                       origin_len=8, origin_area=[64, 80], **common),
    }


FAMILY = Family.of(__name__)
