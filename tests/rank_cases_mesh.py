"""Functions run on every rank of a pool by tests/test_user_mesh.py (gloo, CPU)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

import paradiff
from paradiff.testing.models import Lengths, make_inputs, model_class, run_forward


def _config(tp: int, data: int, mesh=None) -> paradiff.ParallelConfig:
    return paradiff.ParallelConfig(tensor_parallel_config=paradiff.TensorParallelConfig(tp_degree=tp),
                                   data_degree=data, mesh=mesh)


def user_mesh_matches_built_mesh(family: str, folder: str, tp: int, data: int, shape: tuple[int, ...],
                                 names: tuple[str, ...], via: str) -> dict:
    """Load once on the mesh paradiff builds from the degrees and once on a user mesh; compare shards and outputs."""
    cls = model_class(family)
    user_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    models = []
    for mesh in (None, user_mesh):
        if via == "from_pretrained":
            model = paradiff.from_pretrained(cls, folder, parallel_config=_config(tp, data, mesh))
        else:
            model = cls.from_pretrained(folder).eval()
            paradiff.enable_parallelism(model, _config(tp, data, mesh))
        models.append(model)
    built, user = (model.state_dict() for model in models)
    assert set(built) == set(user)
    differing_shards = [name for name in built if not torch.equal(built[name], user[name])]
    inputs = make_inputs(family, models[0].config, batch=1, lengths=Lengths(height=3, width=4, text=6))
    built_output, user_output = (run_forward(model, inputs) for model in models)
    return {
        "differing_shards": differing_shards,
        "output_diff": float((built_output - user_output).abs().max()),
        "describe": paradiff_describe(models[1]),
    }


def paradiff_describe(model) -> dict[str, int]:
    from paradiff.runtime.state import get_state

    return get_state(model).mesh.describe()
