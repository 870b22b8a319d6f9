"""Krea 2 (`Krea2Transformer2DModel`): a single-stream [text, image] DiT with grouped-query attention and a sigmoid
output gate, after a small text-fusion transformer over the tapped text-encoder layers.

Grouped-query attention: K/V have fewer heads than Q. `ColwiseHeads` splits them by whole heads up to their count
and, beyond it, gives each group of tp / kv_heads ranks the one K/V head its Q heads use; `num_kv_heads` then reads 1
on every rank, so the processor's repeat factor (num_heads // num_kv_heads) stays right.
"""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import ColwiseHeads
from paradiff.plans.common import mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Cat, Full, GridIds, Noise, Uniform, text_mask

MODEL_CLASSES = ("Krea2Transformer2DModel",)
_TEXT_BLOCKS = ("text_fusion.layerwise_blocks.*", "text_fusion.refiner_blocks.*")


def _block(prefix: str, head_dim: int) -> dict:
    return {
        f"{prefix}.attn.to_q": "colwise",
        f"{prefix}.attn.to_k": ColwiseHeads(head_dim),
        f"{prefix}.attn.to_v": ColwiseHeads(head_dim),
        # the gate multiplies the flattened heads: colwise keeps this rank's heads' channels
        f"{prefix}.attn.to_gate": "colwise",
        f"{prefix}.attn.to_out.0": "rowwise",
        f"{prefix}.ff.gate": "colwise",
        f"{prefix}.ff.up": "colwise",
        f"{prefix}.ff.down": "rowwise",
    }


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = _block("transformer_blocks.*", config.attention_head_dim)
    text_head_dim = config.text_hidden_dim // config.text_num_attention_heads
    for stack in _TEXT_BLOCKS:
        styles.update(_block(stack, text_head_dim))
    styles.update({
        **mlp("time_embed"),
        **mlp("txt_in"),
        # shared modulation, dim -> 6 dim
        "time_mod_proj": "rowwise_split_input",
    })
    return TensorParallelPlan(styles=styles, head_attrs=("num_heads", "num_kv_heads"))


def context_parallel_plan(config) -> ContextParallelPlan:
    # The joint [text, image] sequence is split at the first block with its rotary table and key-padding mask, and
    # gathered after the last one, before the model slices the text off by its full length. The text fusion runs
    # whole on every rank (a few text tokens; its layer-wise blocks attend across tapped layers, not tokens).
    last = config.num_layers - 1
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1)},
            "transformer_blocks.*": {"image_rotary_emb": Split(0), "attention_mask": Split(-1)},
        },
        gather_outputs={f"transformer_blocks.{last}": 1},
        local_attention=tuple(f"{stack}.attn" for stack in _TEXT_BLOCKS),
    )


EXAMPLES = {
    # 4 query heads, 2 K/V heads: tp2 splits both, tp4 replicates each K/V head on two ranks
    "krea2": ("Krea2Transformer2DModel", dict(
        in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, timestep_embed_dim=32, text_hidden_dim=32, num_text_layers=3,
        text_num_attention_heads=4, text_num_key_value_heads=2, text_intermediate_size=48,
        num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6))),
}
EXTRA_MODES = {"krea2": ("tp4",)}


INPUTS = dict(
    hidden_states=Noise(("batch", "height * width", "in_channels")),
    encoder_hidden_states=Noise(("batch", "text", "num_text_layers", "text_hidden_dim")),
    timestep=Uniform(),
    # the text tokens at 0, the image tokens at their row and column
    position_ids=Cat((Full(("text", 3), 0.0), GridIds("height", "width", 3))),
    encoder_attention_mask=text_mask(),  # the last prompt is padded
    return_dict=False,
)


FAMILY = Family.of(__name__)
