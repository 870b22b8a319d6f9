"""Nucleus-MoE Image (`NucleusMoEImageTransformer2DModel`): image queries attend to [image, text] keys (grouped K/V
heads); the feed-forwards are dense in the first blocks and expert-choice mixtures of experts after.

TP: every expert of a bank is split like a dense SwiGLU (fused gate/up by column halves, down by rows) and the bank's
partial output all-reduced; the router stays whole. CP: the text, used only as keys, is split with the image, and the
experts route over the whole sequence with the scores shared between the ranks (context_parallel/experts.py).
"""

from paradiff.context_parallel.experts import ExpertChoice
from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import AttentionHeads, TensorParallelPlan
from paradiff.tensor_parallel.styles import ColwiseHeads, SplitParameter
from paradiff.plans.common import feed_forward, mlp, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, PerSample, Uniform, Value, text_mask
from paradiff.models.nucleusmoe import init_example

MODEL_CLASSES = ("NucleusMoEImageTransformer2DModel",)

_DENSE_FIRST = {"leave_first_three_and_last_block_dense": 3, "leave_first_three_blocks_dense": 3,
                "leave_first_block_dense": 1, "all_moe": 0}


def moe_blocks(config) -> list[int]:
    """The blocks whose feed-forward is a mixture of experts, by the config's dense_moe_strategy."""
    if not config.moe_enabled or config.dense_moe_strategy == "all_dense":
        return []
    first = _DENSE_FIRST.get(config.dense_moe_strategy, 0)  # diffusers makes unknown strategies all-MoE
    last = config.num_layers - (config.dense_moe_strategy == "leave_first_three_and_last_block_dense")
    return list(range(first, last))


def tensor_parallel_plan(config) -> TensorParallelPlan:
    head_dim = config.attention_head_dim
    attn = "transformer_blocks.*.attn"
    styles = {
        f"{attn}.to_q": "colwise", f"{attn}.to_k": ColwiseHeads(head_dim), f"{attn}.to_v": ColwiseHeads(head_dim),
        f"{attn}.add_k_proj": ColwiseHeads(head_dim), f"{attn}.add_v_proj": ColwiseHeads(head_dim),
        f"{attn}.to_out.0": "rowwise",
        # per-block text projection and modulation, on replicated inputs
        "transformer_blocks.*.encoder_proj": "rowwise_split_input",
        **split_input("transformer_blocks.*.img_mod.1", "norm_out.linear"),
        **mlp("time_text_embed.timestep_embedder"),
    }
    moe = moe_blocks(config)
    for index in range(config.num_layers):
        mlp_prefix = f"transformer_blocks.{index}.img_mlp"
        if index not in moe:
            styles.update(feed_forward(mlp_prefix, gated=True))
            continue
        styles.update({**feed_forward(f"{mlp_prefix}.shared_expert", gated=True),
                       f"{mlp_prefix}.experts.gate_up_proj": SplitParameter(2, blocks=(1, 1)),
                       f"{mlp_prefix}.experts.down_proj": SplitParameter(1)})
    heads = AttentionHeads(query_heads=config.num_attention_heads,
                           kv_heads=config.num_key_value_heads or config.num_attention_heads,
                           per_query_head=("heads", "inner_dim"), per_kv_head=("inner_kv_dim",))
    return TensorParallelPlan(styles=styles, head_attrs=(), attention={attn: heads},
                              reduce_outputs=tuple(f"transformer_blocks.{index}.img_mlp.experts" for index in moe))


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1)},
            # the model passes the whole text, its rotary table and the [image, text] key mask to every block
            "transformer_blocks.*": {
                "encoder_hidden_states": Split(1),
                "image_rotary_emb": {0: Split(0), 1: Split(0)},
                "attention_kwargs": Split(1, parts=("hidden_states", "encoder_hidden_states")),
            },
        },
        gather_outputs={"proj_out": 1},
        expert_choice={f"transformer_blocks.{index}.img_mlp": ExpertChoice() for index in moe_blocks(config)},
        unsupported_inputs={"": {
            f"attention_kwargs.cached_txt_{what}": "cached text keys/values cover the whole text; run without them"
            for what in ("key", "value")}},
    )


_BASE = dict(patch_size=2, in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=4,
             joint_attention_dim=32, axes_dims_rope=(4, 6, 6), num_experts=4, moe_intermediate_dim=32)
EXAMPLES = {
    # grouped K/V heads, a dense first block, softmax routing
    "nucleus-moe": ("NucleusMoEImageTransformer2DModel", dict(
        _BASE, num_key_value_heads=2, dense_moe_strategy="leave_first_block_dense", capacity_factors=2.0)),
    # every block a mixture, sigmoid routing, per-layer capacity factors (each expert takes 4 or 6 of 15 tokens)
    "nucleus-moe-sigmoid": ("NucleusMoEImageTransformer2DModel", dict(
        _BASE, dense_moe_strategy="all_moe", use_sigmoid=True, capacity_factors=[1.0, 1.5])),
}
EXTRA_MODES = {"nucleus-moe": ("tp4",)}  # 2 K/V heads over 4 ranks: replicated in pairs


INPUTS = dict(
    hidden_states=Noise(("batch", "height * width", "in_channels")),
    img_shapes=PerSample(Value("(1, height, width)")),
    encoder_hidden_states=Noise(("batch", "text", "joint_attention_dim")),
    encoder_hidden_states_mask=text_mask(),  # the last prompt is padded: exercises the key mask
    timestep=Uniform(),
    return_dict=False,
)


FAMILY = Family.of(__name__)
