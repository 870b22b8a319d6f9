"""JoyImage Edit Plus (`JoyImageEditPlusTransformer3DModel`): JoyImage's blocks over a padded sequence of patches
from the target and variable-size reference images, with per-sample rotary tables and an [image, text] key mask."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import joyimage
from paradiff.plans.common import Grid
from paradiff.plans.family import Family

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


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    # the target (frames x height x width patches) and a reference image; the last sample's reference is smaller,
    # so its patch sequence is padded
    target = (grid.frames, grid.height, grid.width)
    shapes = [[target, (1, 2, 3)], [target, (1, 2, 2)]][:batch] + [[target, (1, 2, 3)]] * max(0, batch - 2)
    patches = max(sum(t * h * w for t, h, w in sample) for sample in shapes)
    mask = torch.ones(batch, grid.text, dtype=torch.long)
    mask[-1, grid.text // 2:] = 0  # the last prompt is shorter
    return dict(
        hidden_states=torch.randn(batch, patches, config.in_channels, *config.patch_size, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, grid.text, config.text_dim, generator=generator),
        encoder_hidden_states_mask=mask,
        shape_list=shapes,
        return_dict=False,
    )


FAMILY = Family.of(__name__)
