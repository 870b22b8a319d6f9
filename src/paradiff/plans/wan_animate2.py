"""Wan-Animate 2 (`WanAnimate2Transformer3DModel`): Wan-style blocks run twice over a KV cache. The reference pass
(`kv_cache_mode="extract"`) stores each self-attention's pre-rotary K/V; every denoising step (`"cached"`) attends
over the generation tokens plus, per generation frame, the cached reference frame before it, which diffusers packs
into a 128-aligned buffer of full-video-sized frame slots (zeros where the segment is smaller) behind a flex
BlockMask.

Under TP the cache holds each rank's heads. Under CP each rank projects its own tokens, the self-attention's keys
and values are all-gathered (so the cache holds every token's, on every rank) and each rank attends its own query
rows; the packed layout is attended one query frame at a time over exactly the slots the mask lets it see, zero
slots included (`SelfAttention`, models/wan_animate2.py)."""


from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.models.wan_animate2 import SelfAttention, prepare_example, run_example
from paradiff.plans.common import mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Dim, Full, Noise, PerSample, Ref, Tensor, Uniform, Value

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


EXAMPLES = {
    "wan-animate2": ("WanAnimate2Transformer3DModel", dict(
        patch_size=(1, 2, 2), text_len=8, in_dim=8, dim=64, ffn_dim=128, freq_dim=32, text_dim=32, out_dim=4,
        num_heads=4, num_layers=2, refer_stride=2)),
}


def _latents(frames: Dim, width: str) -> PerSample:
    # latents and condition latents are each half of in_dim (concatenated by the model)
    return PerSample(Noise(("in_dim // 2", f"{frames} * patch_size[0]", "height * patch_size[1]",
                            f"({width}) * patch_size[2]")))


# A reference of 2 frames x 3 x 4 tokens (its own grid); a generation segment of grid's size, both smaller than the
# full video's 3 + 1 frames x 20 tokens (origin_len 8, 64 x 80 pixels), so the packed slots hold zeros. Both passes
# take the same texts (of their own lengths, padded by the model to text_len; the last is shorter) and image context.
INPUTS = dict(
    extract=dict(
        encoder_hidden_states=PerSample(Noise(("text - 3 * (index == batch - 1)", "text_dim"))),
        encoder_hidden_states_image=Noise(("batch", 4, 1280)),
        return_dict=False,
        hidden_states=_latents(2, "width - 1"),
        condition_latents=_latents(2, "width - 1"),
        timestep=Full(("batch",), 0.0),
        seq_len=Value("2 * height * (width - 1)"),
        offset_grid_sizes=Tensor((2, "height", "width - 1"), per_sample=True),
    ),
    cached=dict(
        encoder_hidden_states=Ref("extract.encoder_hidden_states"),
        encoder_hidden_states_image=Ref("extract.encoder_hidden_states_image"),
        return_dict=False,
        hidden_states=_latents("frames", "width"),
        condition_latents=_latents("frames", "width"),
        timestep=Uniform(1000),
        seq_len=Value("frames * height * width"),
        reference_grid_sizes=Ref("extract.offset_grid_sizes"),
        origin_len=8,
        origin_area=[64, 80],
    ),
)


FAMILY = Family.of(__name__)
