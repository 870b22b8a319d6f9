"""MiniMax-H3 (`MiniMaxH3Transformer3DModel`): one packed sequence of text, video and audio rows, full
self-attention, AdaLN parameters picked per row from a (timestep, modality) table; a text token refiner before."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention, feed_forward, mlp, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import Arange, Cat, Full, GridPositions, Noise, Tensor

MODEL_CLASSES = ("MiniMaxH3Transformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    # heads x head_dim is wider than the residual stream here; QK-norms are per head
    return TensorParallelPlan(styles={
        **attention("transformer_blocks.*.attn"),
        **feed_forward("transformer_blocks.*.ff", gated=True),
        **split_input("transformer_blocks.*.adaln_proj.linear", "context_embedder", "norm_out.linear"),
        **attention("token_refiner.refiner_blocks.*.attn"),
        **feed_forward("token_refiner.refiner_blocks.*.ff", gated=True),
        **mlp("time_embedder"),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    # The packed sequence is split at the first block with its per-row tables (AdaLN row index, rotary angles,
    # timestep index at the output norm); both output heads are gathered before the model picks their rows. The
    # text refiner runs on the whole, replicated text before packing: its attention stays local.
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1)},
            "transformer_blocks.*": {"adaln_indices": Split(0)},
            "norm_out": {"timestep_indices": Split(0)},
        },
        split_outputs={"rope": {0: Split(0), 1: Split(0)}},
        gather_outputs={"proj_out": 1, "audio_proj_out": 1},
        local_attention=("token_refiner.refiner_blocks.*.attn",),
    )


EXAMPLES = {
    "minimax-h3": ("MiniMaxH3Transformer3DModel", dict(
        num_attention_heads=4, attention_head_dim=16, hidden_size=48, num_layers=2, num_refiner_layers=1,
        ffn_dim=96, in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=32, freq_dim=32,
        time_embed_hidden_dim=32, time_embed_dim=24, rope_freq_dim=2)),
}


# packed as [text, video (first frame a clean condition), 6 audio tokens]
_VIDEO, _ALL = "frames * height * width", "text + frames * height * width + 6"
INPUTS = dict(
    hidden_states=Noise(("batch", _VIDEO, "in_channels * 4")),
    audio_hidden_states=Noise(("batch", 6, "audio_in_channels")),
    encoder_hidden_states=Noise(("batch", "text", "text_dim")),
    timestep=Tensor((0.0, 0.7)),
    timestep_indices=Full((_ALL,), 1, "long", set=((":text + height * width", 0),)),  # the text and clean frame: 0
    token_tags=Full((_ALL,), 0, "long", set=((":text", 1), (f"text + {_VIDEO}:", 2))),
    # text at (0, 0, 0), video at (frame + 1, row, column), audio at (index + 1, 0, 0)
    position_ids=Cat((Full(("text", 3), 0, "long"),
                      GridPositions(("frames", "height", "width"), offset=(1, 0, 0), points_first=True),
                      GridPositions((6, 1, 1), offset=(1, 0, 0), points_first=True))),
    text_indices=Arange("text"),
    video_indices=Arange(f"text + {_VIDEO}", start="text"),
    audio_indices=Arange(_ALL, start=f"text + {_VIDEO}"),
    return_dict=False,
)


FAMILY = Family.of(__name__)
