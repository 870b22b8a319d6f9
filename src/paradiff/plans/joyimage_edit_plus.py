"""JoyImage Edit Plus (`JoyImageEditPlusTransformer3DModel`): JoyImage's blocks over a padded sequence of patches
from the target and variable-size reference images, with per-sample rotary tables and an [image, text] key mask."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import joyimage
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, PerSample, Uniform, Value, text_mask

MODEL_CLASSES = ("JoyImageEditPlusTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return joyimage.tensor_parallel_plan(config)


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={
            "double_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)},
            "double_blocks.*": {"image_rotary_emb": Split(1),
                                "attention_mask": Split(-1, parts=("hidden_states", "encoder_hidden_states"))},
        },
        gather_outputs={"proj_out": 1},
    )


EXAMPLES = {"joyimage-edit-plus": ("JoyImageEditPlusTransformer3DModel", joyimage._BASE)}


# the target (frames x height x width patches) and a reference image; the second sample's reference is smaller, so
# its patch sequence is padded to the longest (the first's)
INPUTS = dict(
    hidden_states=Noise(("batch", "frames * height * width + 6", "in_channels", "patch_size[0]", "patch_size[1]",
                         "patch_size[2]")),
    timestep=Uniform(1000),
    encoder_hidden_states=Noise(("batch", "text", "text_dim")),
    encoder_hidden_states_mask=text_mask("long", keep="text // 2"),  # the last prompt is shorter
    shape_list=PerSample(Value("[(frames, height, width), (1, 2, 2 if index == 1 else 3)]")),
    return_dict=False,
)


FAMILY = Family.of(__name__)
