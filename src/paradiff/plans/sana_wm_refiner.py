"""SANA-WM stage-2 refiner (`SanaWMLTX2RefinerTransformer3DModel`): LTX-2's video blocks (the audio modules are built
but never run) over one block of frames, with per-token timesteps and the rotary tables given as an input. The
forward without a KV cache is split both ways; the sliding-window cache (sink + history keys kept per rank) is
refused under context parallelism."""


from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import ltx2
from paradiff.plans.family import Family
from paradiff.plans.inputs import Call, Noise, Uniform, Value, text_mask

MODEL_CLASSES = ("SanaWMLTX2RefinerTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    plan = ltx2.tensor_parallel_plan(config)
    head_dim = -1 if config.rope_type == "interleaved" else 1
    # the model builds no rotary table itself: each rank keeps its heads' part of the one it is given
    return TensorParallelPlan(styles=plan.styles, head_inputs={"": {"video_rotary_emb": {0: head_dim, 1: head_dim}}})


def context_parallel_plan(config) -> ContextParallelPlan:
    token_dim = 1 if config.rope_type == "interleaved" else 2  # (batch, tokens, dim) or (batch, heads, tokens, dim)
    return ContextParallelPlan(
        split_inputs={"": {"hidden_states": Split(1), "timestep": Split(1),
                           "video_rotary_emb": {0: Split(token_dim), 1: Split(token_dim)}}},
        gather_outputs={"proj_out": 1},
        local_attention=("transformer_blocks.*.attn2",),
        unsupported_inputs={"": {"kv_cache": (
            "the sliding-window cache keeps the keys of the tokens a rank holds, and the sink's keys are re-rotated "
            "whole; run the cached refinement without context parallelism")}},
    )


_BASE = dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
             audio_in_channels=6, audio_out_channels=6, audio_num_attention_heads=4, audio_attention_head_dim=8,
             audio_cross_attention_dim=32, num_layers=2, caption_channels=24)
EXAMPLES = {
    "sana-wm-refiner": ("SanaWMLTX2RefinerTransformer3DModel", _BASE),
    "sana-wm-refiner-split-rope": ("SanaWMLTX2RefinerTransformer3DModel", {**_BASE, "rope_type": "split",
                                                                           "gated_attn": True}),
}


INPUTS = dict(
    hidden_states=Noise(("batch", "frames * height * width", "in_channels")),
    encoder_hidden_states=Noise(("batch", "text", "caption_channels")),
    # the first frame is clean
    timestep=Uniform(1000, ("batch", 1), expand=("batch", "frames * height * width"), set=((":, :height * width", 0),)),
    # absolute frame positions of a later window (frames 4-6 of the source video)
    video_rotary_emb=Call("paradiff.models.sana_wm_refiner:video_rotary_emb",
                          (Value("config"), Value("batch"), [4, 5, 6], Value("height"), Value("width"), 24.0)),
    encoder_attention_mask=text_mask("int64", keep="text - 3"),
    return_dict=False,
)


FAMILY = Family.of(__name__)
