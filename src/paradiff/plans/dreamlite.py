"""DreamLite (`DreamLiteTransformer2DModel`): the U-Net's continuous-input 2-D transformer, BasicTransformerBlocks whose
self-attention may be removed (`use_self_attention=False`), with cross-attention to the text."""

from paradiff.context_parallel.plan import ContextParallelPlan
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import transformer2d
from paradiff.plans.common import attention, feed_forward
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, When, text_mask

MODEL_CLASSES = ("DreamLiteTransformer2DModel",)
_GATED = ("geglu", "geglu-approximate", "swiglu")


def tensor_parallel_plan(config) -> TensorParallelPlan:
    norms = ("norm_q", "norm_k") if config.qk_norm and "across_heads" in config.qk_norm else ()
    styles = {**attention("transformer_blocks.*.attn2", norms),
              **feed_forward("transformer_blocks.*.ff", gated=config.activation_fn in _GATED)}
    if config.use_self_attention:
        styles.update(attention("transformer_blocks.*.attn1", norms))
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    # The image tokens are split at the first block and gathered after the last, before the model folds them back
    # into a (height, width) grid for its output projection. A self-attention key mask splits with its keys.
    local = []
    if not config.double_self_attention:
        local.append("transformer_blocks.*.attn2")  # attends to the replicated text
    if config.use_self_attention and config.only_cross_attention:
        local.append("transformer_blocks.*.attn1")
    return transformer2d.blocks_split(config.num_layers, tuple(local))


_BASE = dict(num_attention_heads=4, attention_head_dim=16, in_channels=16, num_layers=2, norm_num_groups=8,
             cross_attention_dim=32, qk_norm="rms_norm", ff_mult=2)
EXAMPLES = {
    "dreamlite": ("DreamLiteTransformer2DModel", _BASE),
    # the "remove self-attention" blocks, with linear in/out projections
    "dreamlite-no-self-attention": ("DreamLiteTransformer2DModel",
                                    {**_BASE, "use_self_attention": False, "use_linear_projection": True}),
}


INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "height", "width")),
    encoder_hidden_states=Noise(("batch", "text", "cross_attention_dim")),
    encoder_attention_mask=text_mask(),  # the last prompt is padded
    # and its last image tokens masked out as keys
    attention_mask=When("use_self_attention", text_mask(keep="height * width - 2", length="height * width")),
    return_dict=False,
)


FAMILY = Family.of(__name__)
