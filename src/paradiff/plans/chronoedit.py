"""ChronoEdit (`ChronoEditTransformer3DModel`): Wan 2.1 I2V's architecture; its rotary table skips to the last of
`rope_temporal_skip_len` temporal positions when given two frames (input image and edited image)."""

from paradiff.context_parallel.plan import ContextParallelPlan
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import wan
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, Noise, Uniform

MODEL_CLASSES = ("ChronoEditTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return wan.tensor_parallel_plan(config)


def context_parallel_plan(config) -> ContextParallelPlan:
    return wan.context_parallel_plan(config)


_BASE = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
             text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64, image_dim=24,
             added_kv_proj_dim=64, rope_temporal_skip_len=4)
EXAMPLES = {
    "chronoedit": ("ChronoEditTransformer3DModel", _BASE),
    # two frames take the temporal-skip rotary path; 2 x 21 x 5 tokens, which 4 ranks do not divide
    "chronoedit-two-frames": ("ChronoEditTransformer3DModel", _BASE),
}


def _inputs(frames: str, rows: int) -> dict:
    # 512 replicated text tokens: enough video tokens (`rows` x the grid's height) that the split work dominates
    # (see wan2.1-i2v)
    return dict(
        hidden_states=Noise(("batch", "in_channels", f"{frames} * patch_size[0]", f"{rows} * height * patch_size[1]",
                             "width * patch_size[2]")),
        encoder_hidden_states=Noise(("batch", 512, "text_dim")),
        encoder_hidden_states_image=Noise(("batch", 4, "image_dim")),
        timestep=Uniform(1000),
        return_dict=False,
    )


INPUTS = ByExample({"chronoedit": _inputs("frames", 5), "chronoedit-two-frames": _inputs("2", 7)})


FAMILY = Family.of(__name__)
