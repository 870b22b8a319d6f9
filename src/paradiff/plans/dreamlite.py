"""DreamLite (`DreamLiteTransformer2DModel`): the U-Net's continuous-input 2-D transformer, BasicTransformerBlocks whose
self-attention may be removed (`use_self_attention=False`), with cross-attention to the text."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import transformer2d
from paradiff.plans.common import Grid, attention, feed_forward
from paradiff.plans.family import Family

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


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    text_mask = torch.ones(batch, grid.text, dtype=torch.bool)
    text_mask[-1, -2:] = False  # the last prompt is padded
    inputs = dict(
        hidden_states=torch.randn(batch, config.in_channels, grid.height, grid.width, generator=generator),
        encoder_hidden_states=torch.randn(batch, grid.text, config.cross_attention_dim, generator=generator),
        encoder_attention_mask=text_mask,
        return_dict=False,
    )
    if config.use_self_attention:
        mask = torch.ones(batch, grid.height * grid.width, dtype=torch.bool)
        mask[-1, -2:] = False  # and its last image tokens masked out as keys
        inputs["attention_mask"] = mask
    return inputs


FAMILY = Family.of(__name__)
