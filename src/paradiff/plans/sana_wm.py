"""SANA-WM (`SanaWMTransformer3DModel`): Sana-Video-style blocks whose self-attention is a bidirectional gated
delta rule over frames (a D x D state per head carried frame to frame, forwards and backwards), every
`softmax_every_n`-th block softmax attention instead, per-frame timesteps and an optional per-frame validity mask.

TP splits every head-wise piece (fused QKV, the per-head gates and decay parameters, the short convolution over
frames, the Q/K norms across heads) and the feed-forward's channels; diffusers' self- and cross-attention reshape by
their input's full width, so both run a forward that reshapes by the local heads (models/sana_wm.py).

CP splits the latents by whole frames at the model's input (per-frame modulation, the 3x3 convolution and the final
layer stay local; the output is gathered along frames) and the feed-forward's temporal convolution borrows a frame
from each neighbour. In the recurrent blocks each rank runs the delta rule over its own frames: the short
convolution over frames reads the neighbouring ranks' edge frames, and the D x D states enter from the other
ranks' frames through one all-gather of each rank's composed steps (context_parallel/scan.py), forwards and
backwards; exact, with per-rank communication of O(D^2) per head besides the edges. The softmax blocks all-gather
their projected Q/K/V and keep their rows. The rotary table is given to the model whole, as the ranks' local frame
counts would restart its positions at 0. The camera branch (UCPE ray transforms) is not split: `camera_conditions`
is refused under TP and CP. The ported attention is in models/sana_wm.py."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import DEFAULT_HEAD_ATTRS, TensorParallelPlan
from paradiff.tensor_parallel.styles import PackedColwise, SplitParameter
from paradiff.models.sana_wm import CAMERA_REFUSAL, CrossAttention, SelfAttention, WholeInputs, run_example
from paradiff.plans.common import mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Uniform, text_mask

MODEL_CLASSES = ("SanaWMTransformer3DModel",)


def _has_plucker(config, index: int) -> bool:
    blocks = config.chunk_plucker_post_attn_blocks
    return config.use_chunk_plucker_post_attn and (blocks < 0 or index < blocks)


def _convs(config) -> list[str]:
    """The recurrent blocks' short convolutions over frames (depthwise: one channel per head dimension); the softmax
    blocks (every `softmax_every_n`-th) have none."""
    if config.conv_kernel_size <= 0:
        return []
    every = config.softmax_every_n
    names = ("conv_k",) if config.k_conv_only else ("conv_q", "conv_k", "conv_v")
    return [f"blocks.{i}.attn.{name}{branch}" for i in range(config.num_layers)
            if not (every > 0 and (i + 1) % every == 0) for name in names for branch in ("", "_cam")]


def tensor_parallel_plan(config) -> TensorParallelPlan:
    attn, cross = "blocks.*.attn", "blocks.*.cross_attn"
    styles = {
        f"{attn}.qkv": PackedColwise([1, 1, 1]),
        f"{attn}.beta_proj": "colwise",
        f"{attn}.gate_proj": "colwise",
        f"{attn}.A_log": SplitParameter(),
        f"{attn}.dt_bias": SplitParameter(),
        f"{attn}.output_gate": "colwise",
        f"{attn}.proj": "rowwise",
        # the camera branch is refused, but its weights are as large as the main branch's: held split all the same
        **{f"{attn}.{x}_proj_cam": "colwise" for x in "qkv"},
        f"{attn}.out_proj_cam": "rowwise",
        **{f"{conv}.weight": SplitParameter() for conv in _convs(config)},
        f"{cross}.q_linear": "colwise",
        f"{cross}.kv_linear": PackedColwise([1, 1]),
        f"{cross}.proj": "rowwise",
        **{f"blocks.{i}.plucker_proj": "rowwise_split_input" for i in range(config.num_layers)
           if _has_plucker(config, i)},
        "t_block.1": "rowwise_split_input",
        **mlp("t_embedder"),
        **mlp("y_embedder.y_proj", "fc1", "fc2"),
    }
    if config.qk_norm:
        styles.update({f"{attn}.{norm}": "norm_across_heads" for norm in ("q_norm", "k_norm", "q_norm_cam",
                                                                           "k_norm_cam")})
    if config.cross_norm:
        styles.update({f"{cross}.q_norm": "norm_across_heads", f"{cross}.k_norm": "norm_across_heads"})
    if config.ffn_type == "GLUMBConvTemp":  # the GLU's value/gate halves each split; the temporal conv reads all
        styles.update({"blocks.*.mlp.inverted_conv.conv": PackedColwise([1, 1]),
                       "blocks.*.mlp.depth_conv.conv": PackedColwise([1, 1]),
                       "blocks.*.mlp.point_conv.conv": "rowwise", "blocks.*.mlp.t_conv": "rowwise_split_input"})
    elif config.ffn_type == "mlp":
        styles.update(mlp("blocks.*.mlp", "fc1", "fc2"))
    return TensorParallelPlan(
        styles=styles,
        # the short convolutions group by their `hidden_size`, one group per local channel
        head_attrs=DEFAULT_HEAD_ATTRS + ("num_heads", "cam_heads", "hidden_size"),
        head_modules=(attn, *_convs(config)),
        forwards={attn: SelfAttention, cross: CrossAttention},
    )


def context_parallel_plan(config) -> ContextParallelPlan:
    frames = Split(2, ndim=5)  # (batch, channels, frames, height, width)
    per_frame = Split(2, ndim=3)  # (batch, 1, frames)
    rewrite = WholeInputs(config)
    return ContextParallelPlan(
        rewrite_inputs={"": rewrite},
        split_inputs={"": {"hidden_states": frames, "timestep": per_frame, "frame_valid_mask": per_frame,
                           "chunk_plucker": frames, "data_info": frames}},
        gather_outputs={"": {0: 2}},
        halo_convs=("blocks.*.mlp.t_conv",) if config.ffn_type == "GLUMBConvTemp" else (),
        local_attention=("blocks.*.cross_attn",),
        forwards={"blocks.*.attn": SelfAttention},
        unsupported_inputs={"": {name: CAMERA_REFUSAL for name in ("camera_conditions", "cam_pos_embeds", "raymats")}},
    )


_BASE = dict(in_channels=4, num_layers=2, hidden_size=64, num_attention_heads=4, linear_head_dim=16,
             caption_channels=32, chunk_plucker_channels=12, mlp_ratio=2.0)
EXAMPLES = {
    "sana-wm": ("SanaWMTransformer3DModel", _BASE),
    # the second block softmax attention
    "sana-wm-softmax": ("SanaWMTransformer3DModel", {**_BASE, "softmax_every_n": 2}),
}


# frames = the grid's width, so two CP ranks hold 3 and 2 frames (height, width = the grid's height, frames)
INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "width", "height", "frames")),
    # the first frame is clean (image-to-video)
    timestep=Uniform(1000, ("batch", 1, 1), expand=("batch", 1, "width"), set=((":, :, 0", 0),)),
    encoder_hidden_states=Noise(("batch", "text", "caption_channels")),
    encoder_attention_mask=text_mask("int64", keep="text - 3"),
    chunk_plucker=Noise(("batch", "chunk_plucker_channels", "width", "height", "frames")),
    frame_valid_mask=text_mask("float32", keep="width - 1", length="width"),  # the last sample is a frame shorter
    return_dict=False,
)


FAMILY = Family.of(__name__)
