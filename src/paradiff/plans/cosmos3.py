"""Cosmos3 Omni (`Cosmos3OmniTransformer`): a packed sequence (no batch axis) of a causal text prefix ("und") and
generation tokens (vision, sound, action; "gen") through mixture-of-transformers layers with grouped K/V heads."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import DEFAULT_HEAD_ATTRS, TensorParallelPlan
from paradiff.tensor_parallel.styles import ColwiseHeads
from paradiff.plans.common import mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Arange, Cat, GridPositions, Integers, Noise, Uniform, Value

MODEL_CLASSES = ("Cosmos3OmniTransformer",)


def _mlp(prefix: str, gated: bool) -> dict:
    styles = {f"{prefix}.up_proj": "colwise", f"{prefix}.down_proj": "rowwise"}
    if gated:
        styles[f"{prefix}.gate_proj"] = "colwise"
    return styles


def tensor_parallel_plan(config) -> TensorParallelPlan:
    # one attention holds both streams' projections; K/V have fewer (grouped) heads; QK-norms are per head
    kv = ColwiseHeads(lambda c: c.head_dim)
    gated = config.hidden_act == "silu"
    styles = {
        **{f"layers.*.self_attn.{name}": "colwise" for name in ("to_q", "add_q_proj")},
        **{f"layers.*.self_attn.{name}": kv for name in ("to_k", "to_v", "add_k_proj", "add_v_proj")},
        **{f"layers.*.self_attn.{name}": "rowwise" for name in ("to_out", "to_add_out")},
        **_mlp("layers.*.mlp", gated),
        **_mlp("layers.*.mlp_moe_gen", gated),
        **mlp("time_embedder"),
    }
    return TensorParallelPlan(styles=styles,
                              head_attrs=DEFAULT_HEAD_ATTRS + ("num_attention_heads", "num_key_value_heads"))


def context_parallel_plan(config) -> ContextParallelPlan:
    # The generation tokens are split; the short causal text prefix stays whole on every rank (its causal
    # attention is computed whole, the generation tokens attend to it locally and to each other across the ranks).
    # The split generation stream is gathered after the stack's last norm, before the model picks its rows.
    return ContextParallelPlan(
        split_inputs={
            "layers.0": {"gen_seq": Split(0)},
            "layers.*": {"rotary_emb": {2: Split(0), 3: Split(0)}},  # (cos, sin) of the text, then of the rest
        },
        gather_outputs={"norm_moe_gen": 0},
        prefix_attention={"layers.*.self_attn": "und_seq"},
    )


EXAMPLES = {
    "cosmos3-omni": ("Cosmos3OmniTransformer", dict(
        head_dim=16, hidden_size=64, intermediate_size=128, latent_channel=4, latent_patch_size=2,
        num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, patch_latent_dim=16,
        rope_theta=10000.0, vocab_size=64, sound_gen=True, sound_dim=6, rope_axes_dim=[4, 2, 2])),
}


# The model has no batch axis (one packed sequence per call). Layout: [text, video (first frame a clean
# condition), 5 sound tokens (first step clean)]; predictions are read for the noisy rows.
_VIDEO = "text + frames * height * width"  # where the video ends
_LENGTH = f"{_VIDEO} + 5"
INPUTS = dict(
    input_ids=Integers("vocab_size", ("text",)),
    text_indexes=Arange("text"),
    # text and sound at their index (sound after the text) on all three axes, video at (text + frame, row, column)
    position_ids=Cat((Cat((GridPositions(("text",)),) * 3),
                      GridPositions(("frames", "height", "width"), offset=("text", 0, 0)),
                      Cat((GridPositions((5,), offset=("text",)),) * 3)), dim=1),
    und_len=Value("text"),
    sequence_length=Value(_LENGTH),
    vision_tokens=[Noise((1, "latent_channel", "frames", "height * latent_patch_size", "width * latent_patch_size"))],
    vision_token_shapes=[Value("(frames, height, width)")],
    vision_sequence_indexes=Arange(_VIDEO, start="text"),
    vision_mse_loss_indexes=Arange(_VIDEO, start="text + height * width"),
    vision_timesteps=Uniform(1000, ("(frames - 1) * height * width",)),
    vision_noisy_frame_indexes=[Arange("frames", start=1)],
    sound_tokens=[Noise(("sound_dim", 5))],
    sound_token_shapes=[(5, 1, 1)],
    sound_sequence_indexes=Arange(_LENGTH, start=_VIDEO),
    sound_mse_loss_indexes=Arange(_LENGTH, start=f"{_VIDEO} + 1"),
    sound_timesteps=Uniform(1000, (4,)),
    sound_noisy_frame_indexes=[Arange(5, start=1)],
    return_dict=False,
)


FAMILY = Family.of(__name__)
