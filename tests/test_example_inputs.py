"""The materializer of the families' INPUTS declarations (plans/inputs.py): shapes from config and grid, draws in
declaration order, masks, conditions, references; a bad expression is a PlanError naming it."""

import pytest
import torch

from paradiff.errors import PlanError
from paradiff.plan_tools.example_inputs import materialize
from paradiff.plans.common import Grid
from paradiff.plans.inputs import (Arange, ByExample, Cat, Full, GridIds, GridPositions, Integers, Noise, PerSample,
                                   Ref, Repeat, Tensor, Uniform, Value, When, text_mask)

CONFIG = {"in_channels": 4, "patch_size": (1, 2, 2), "axes": [4, 6, 6], "guidance": False}


def test_declaration_materializes_in_order_with_shapes_masks_conditions_and_references():
    declared = ByExample({"one": dict(
        latents=Noise(("batch", "in_channels", "frames * patch_size[0]", "height * patch_size[1]", "width")),
        timestep=Uniform(1000, ("batch", 1), expand=("batch", "height * width"), set=((":, :width", 0),)),
        half=Ref("timestep", 0.5),
        labels=Integers(10),
        mask=text_mask("long", keep="text // 2"),
        guidance=When("guidance", Full(("batch",), 3.5)),
        ids=Cat((Full(("text", 3), 0.0), GridIds("height", "width", "len(axes)"))),
        coords=GridPositions(("frames", "height"), scale=(2.0, 1.0), per_sample=True),
        sizes=Tensor(("height * 8.0", 1), per_sample=True),
        rope=[Arange("frames"), Arange("text", start=2)],
        layers=Repeat(Noise(("batch", 2)), 2),
        texts=PerSample(Noise(("text - index", 3))),
        frames=Value("(frames, field('missing', 7))"),
        return_dict=False,
    )})
    grid = Grid(frames=2, height=3, width=5, text=6)
    made = materialize(declared, "one", CONFIG, 2, grid, torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(made["latents"], torch.randn(2, 4, 2, 6, 5, generator=generator))  # declaration order
    assert torch.equal(made["timestep"][:, 5], torch.rand(2, generator=generator) * 1000)
    assert made["timestep"].shape == (2, 15) and not made["timestep"][:, :5].any()
    assert torch.equal(made["half"], made["timestep"] * 0.5)
    assert torch.equal(made["labels"], torch.randint(0, 10, (2,), generator=generator))
    assert made["mask"].dtype == torch.long and made["mask"].sum() == 6 + 3 and not made["mask"][-1, 3:].any()
    assert "guidance" not in made
    assert made["ids"].shape == (6 + 15, 3) and made["ids"][6 + 7].tolist() == [0, 1, 2]
    assert made["coords"].shape == (2, 2, 6) and made["coords"][0, :, -1].tolist() == [2.0, 2.0]
    assert made["sizes"].tolist() == [[24.0, 1.0]] * 2
    assert [r.tolist() for r in made["rope"]] == [[0, 1], [2, 3, 4, 5]]
    assert [t.shape for t in made["layers"]] == [(2, 2)] * 2 and [t.shape for t in made["texts"]] == [(6, 3), (5, 3)]
    assert made["frames"] == (2, 7) and made["return_dict"] is False
    again = materialize(declared, "one", CONFIG, 2, grid, torch.Generator().manual_seed(0))
    assert torch.equal(made["latents"], again["latents"])  # one seed, one set of inputs
    assert all(torch.equal(a, b) for a, b in zip(made["texts"] + made["layers"], again["texts"] + again["layers"]))


@pytest.mark.parametrize("declared,named", [
    ({"x": Noise(("batch", "channels"))}, "'channels'"),
    ({"x": Noise(("batch", "__import__('os')"))}, "__import__"),
    ({"x": Ref("y")}, "'y'"),
    (ByExample({"other": {}}), "'one'"),
])
def test_bad_declarations_name_the_bad_part(declared, named):
    with pytest.raises(PlanError, match=named):
        materialize(declared, "one", CONFIG, 2, Grid(), torch.Generator())
