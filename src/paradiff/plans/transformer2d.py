"""The generic `Transformer2DModel`: BasicTransformerBlocks over continuous feature maps (U-Net attention) or patches
(DiT with AdaLN-zero and class labels, PixArt-alpha with AdaLN-single). Discrete latent classes (VQ-Diffusion) split
the same way but have no example here."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import adaln_single, attention, feed_forward, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, Integers, Noise, image_inputs, text_mask

MODEL_CLASSES = ("Transformer2DModel",)
_GATED = ("geglu", "geglu-approximate", "swiglu")


def _has_attn2(config) -> bool:
    return config.cross_attention_dim is not None or config.double_self_attention


def tensor_parallel_plan(config) -> TensorParallelPlan:
    blocks = "transformer_blocks.*"
    styles = {**attention(f"{blocks}.attn1"), **feed_forward(f"{blocks}.ff", gated=config.activation_fn in _GATED)}
    if _has_attn2(config):
        styles.update(attention(f"{blocks}.attn2"))
    if config.norm_type == "ada_norm_zero":  # per block: timestep + class embedding, then dim -> 6 dim
        styles.update({**mlp(f"{blocks}.norm1.emb.timestep_embedder"), f"{blocks}.norm1.linear": "rowwise_split_input",
                       "proj_out_1": "rowwise_split_input"})
    elif config.norm_type == "ada_norm_single":
        styles.update(adaln_single())
        if config.caption_channels is not None:
            styles.update(mlp("caption_projection"))
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    # The tokens are split at the first block and gathered after the last, before the model's output steps (which
    # fold them back into a grid); a self-attention key mask (bias) splits with its keys.
    local = []
    if _has_attn2(config) and not config.double_self_attention:
        local.append("transformer_blocks.*.attn2")  # attends to the replicated text
    if config.only_cross_attention:
        local.append("transformer_blocks.*.attn1")
    return blocks_split(config.num_layers, tuple(local))


def blocks_split(num_layers: int, local_attention: tuple[str, ...]) -> ContextParallelPlan:
    """The tokens split at the first of `num_layers` transformer blocks with the self-attention key mask, gathered
    after the last; the attentions named in `local_attention` attend to replicated inputs."""
    return ContextParallelPlan(
        split_inputs={"transformer_blocks.0": {"hidden_states": Split(1)},
                      "transformer_blocks.*": {"attention_mask": Split(-1)}},
        gather_outputs={f"transformer_blocks.{num_layers - 1}": 1},
        local_attention=local_attention,
    )


_SMALL = dict(num_attention_heads=4, attention_head_dim=16, num_layers=2)
# with AdaLN-zero (DiT) the forward computes its output modulation with block 0's embedder after the blocks ran
# (absent with the other norms: nothing to shard on its own then)
FSDP_OWN_UNITS = ("transformer_blocks.0.norm1.emb",)

EXAMPLES = {
    # a U-Net's spatial transformer: GroupNorm, linear projections, cross-attention
    "transformer2d-continuous": ("Transformer2DModel", dict(
        _SMALL, in_channels=16, norm_num_groups=8, cross_attention_dim=32, use_linear_projection=True)),
    # DiT: patches, AdaLN-zero from timestep and class label, square images
    "transformer2d-dit": ("Transformer2DModel", dict(
        _SMALL, in_channels=4, out_channels=8, sample_size=6, patch_size=2, norm_type="ada_norm_zero",
        num_embeds_ada_norm=10, activation_fn="gelu-approximate", attention_bias=True)),
    # PixArt-alpha: patches, AdaLN-single, captions projected to the model width
    "transformer2d-pixart": ("Transformer2DModel", dict(
        _SMALL, in_channels=4, out_channels=8, sample_size=8, patch_size=2, norm_type="ada_norm_single",
        cross_attention_dim=64, caption_channels=32, activation_fn="gelu-approximate", attention_bias=True,
        norm_elementwise_affine=False, norm_eps=1e-6, num_embeds_ada_norm=1000)),
}


INPUTS = ByExample({
    "transformer2d-continuous": dict(
        hidden_states=Noise(("batch", "in_channels", "height", "width")),
        encoder_hidden_states=Noise(("batch", "text", "cross_attention_dim")),
        # the last sample's last image tokens masked out as self-attention keys, and its prompt padded
        attention_mask=text_mask("long", keep="height * width - 2", length="height * width"),
        encoder_attention_mask=text_mask("long"),
        return_dict=False,
    ),
    "transformer2d-dit": dict(  # DiT unpatchifies a square: 3 x 3 patches
        hidden_states=Noise(("batch", "in_channels", "height * patch_size", "height * patch_size")),
        timestep=Integers("num_embeds_ada_norm"),
        class_labels=Integers("num_embeds_ada_norm"),
        return_dict=False,
    ),
    "transformer2d-pixart": {**image_inputs("caption_channels"), "encoder_attention_mask": text_mask("long"),
                             "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}},
})


FAMILY = Family.of(__name__)
