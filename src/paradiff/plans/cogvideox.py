"""CogVideoX 1.0 / 1.5 (`CogVideoXTransformer3DModel`): how it splits under tensor and context parallelism."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, attention, feed_forward, mlp, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import Call, Noise, Uniform, Value, When

MODEL_CLASSES = ("CogVideoXTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    # the QK LayerNorm is per head (head_dim wide): it stays whole on every rank
    styles = {
        **attention("transformer_blocks.*.attn1"),
        **feed_forward("transformer_blocks.*.ff"),
        **split_input("transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm2.linear", "patch_embed.text_proj",
                      "norm_out.linear"),
        **mlp("time_embedding"),
    }
    if getattr(config, "ofs_embed_dim", None):  # ConsisID reuses this plan and has no ofs
        styles.update(mlp("ofs_embedding"))
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    # Split after the patch embedding (it adds sin-cos positions for the full joint sequence). Text and video run
    # through the blocks' norms and feed-forward together and attend jointly, so both are split; the rotary table
    # (a (cos, sin) pair over the video tokens) follows the video tokens.
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)},
            "": {"image_rotary_emb": Split(0)},
        },
        gather_outputs={"proj_out": 1},
    )


_BASE = dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=32,
             text_embed_dim=32, num_layers=2, patch_size=2, sample_width=10, sample_height=6, sample_frames=9)
EXAMPLES = {
    # CogVideoX-2b: sin-cos positions added to the joint sequence (the text must be max_text_seq_length long)
    "cogvideox1.0-2b": ("CogVideoXTransformer3DModel", {**_BASE, "max_text_seq_length": Grid().text}),
    # CogVideoX-5b: 3-D rotary table over the video tokens
    "cogvideox1.0-5b": ("CogVideoXTransformer3DModel", {**_BASE, "use_rotary_positional_embeddings": True}),
    # CogVideoX 1.5 I2V: temporal patches (a Linear patch embedding), rotary, and the ofs embedding
    "cogvideox1.5-i2v": ("CogVideoXTransformer3DModel", {
        **_BASE, "patch_size_t": 2, "use_rotary_positional_embeddings": True, "ofs_embed_dim": 32,
        "patch_bias": False}),
}


_SLICED = "field('patch_size_t', None)"  # 1.5 only (and not ConsisID): temporal patches, a sliced rotary grid
INPUTS = dict(
    hidden_states=Noise(("batch", f"frames * ({_SLICED} or 1)", "in_channels", "height * patch_size",
                         "width * patch_size")),
    encoder_hidden_states=Noise(("batch", "text", "text_embed_dim")),
    timestep=Uniform(1000),
    return_dict=False,
    image_rotary_emb=When("use_rotary_positional_embeddings", Call(
        "diffusers.models.embeddings:get_3d_rotary_pos_embed",
        (Value("attention_head_dim"), Value("((0, 0), (height, width))"), Value("(height, width)"), Value("frames")),
        {"grid_type": When(_SLICED, "slice"), "max_size": When(_SLICED, Value("(height, width)"))})),
    ofs=When("field('ofs_embed_dim', None)", Uniform(2)),
)


FAMILY = Family.of(__name__)
