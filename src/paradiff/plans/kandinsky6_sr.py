"""Kandinsky 6 SR (`Kandinsky6SRTransformer3DModel`): text-free video super-resolution blocks whose self-attention is
NABLA block-sparse (blocks of 64 tokens chosen from block means, diffusers runs it on flex attention)."""

from paradiff.context_parallel.nabla import NablaAttentionProcessor
from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import DEFAULT_HEAD_ATTRS, TensorParallelPlan
from paradiff.plans.common import feed_forward, mlp
from paradiff.plans.kandinsky6 import _attention
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Uniform
from paradiff.models.kandinsky6_sr import prepare_example

MODEL_CLASSES = ("Kandinsky6SRTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    # NABLA chooses blocks per head: each rank chooses for its own heads, as the whole model would
    blocks = "visual_transformer_blocks.*"
    return TensorParallelPlan(styles={
        **_attention(f"{blocks}.self_attention"),
        **feed_forward(f"{blocks}.feed_forward"),
        f"{blocks}.visual_modulation.out_layer": "rowwise_split_input",
        **mlp("time_embeddings.timestep_embedder"),
        "out_layer.modulation.out_layer": "rowwise_split_input",
    }, head_attrs=DEFAULT_HEAD_ATTRS + ("num_heads",))


def context_parallel_plan(config) -> ContextParallelPlan:
    blocks = "visual_transformer_blocks"
    return ContextParallelPlan(
        # tokens arrive in NABLA's block order (8 x 8 tiles); the (tokens, 1, dim, 2, 2) rotary table follows them
        split_inputs={f"{blocks}.0": {"hidden_states": Split(1)}, f"{blocks}.*": {"rotary_emb": Split(0)}},
        gather_outputs={f"{blocks}.{config.num_visual_blocks - 1}": 1},
        processors={f"{blocks}.*.self_attention": NablaAttentionProcessor},
    )


EXAMPLES = {
    # a (1, 1, 1) window keeps only each block's own block a priori: the rest is NABLA's choice
    "kandinsky6-sr": ("Kandinsky6SRTransformer3DModel", dict(
        in_visual_dim=4, out_visual_dim=8, time_dim=32, patch_size=(1, 1, 1), model_dim=64, ff_dim=128,
        num_visual_blocks=2, axes_dims=(4, 6, 6), nabla_threshold=0.5, nabla_window=(1, 1, 1))),
}


# NABLA needs the token rows and columns in whole 8 x 8 tiles: one tile per frame, 3 blocks of 64 tokens, which
# 2 ranks split mid-block
INPUTS = dict(
    # (batch, frames, height, width, noisy + anchor latent + anchor mask)
    hidden_states=Noise(("batch", "frames * patch_size[0]", "8 * patch_size[1]", "8 * patch_size[2]",
                         "2 * in_visual_dim + 1")),
    timestep=Uniform(1000),
    return_dict=False,
)


FAMILY = Family.of(__name__)
