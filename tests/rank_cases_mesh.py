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


def a_parallelism_of_its_own_gets_a_dimension_and_its_patches(rank_order: str = "after cfg") -> dict:
    """A parallelism declared here, outside paradiff, in a registry of the test's own: its dimension in the mesh,
    its patch put on by attach in the registry's order and taken off again, the other modes' code untouched."""
    import torch.distributed as dist
    from torch import nn

    from paradiff.api.attach import attach
    from paradiff.api.parallelisms import REGISTRY
    from paradiff.distributed.mesh import MESH_DIMS, build_mesh
    from paradiff.distributed.parallelism import PARALLELISMS, Parallelism
    from paradiff.runtime.patches import add_hook, patches, remove_patches

    class PipeParallelism(Parallelism):
        name, dims = "pipe", ("pipe",)
        splits_model = True  # its ranks compute one forward together: the mesh's model group

        def degrees(self, config):
            return {"pipe": dist.get_world_size()}

        def apply(self, model, resolved, mesh, state):
            stage = mesh.local_rank("pipe")
            add_hook(model, lambda module, args, output: output + stage * resolved, by=self.name)

    registry = REGISTRY.adding(PipeParallelism(), after="cfg", apply_after="cp")
    mesh = build_mesh(paradiff.ParallelConfig(), registry=registry)
    model = nn.Linear(4, 4)
    inputs = torch.ones(1, 4)
    with torch.no_grad():
        before = model(inputs)
    attach(model, mesh, None, None, registry=registry, plans={"pipe": 10.0})
    applied = [str(patch) for _, patch in patches(model)]
    with torch.no_grad():
        patched = model(inputs)
    removed = remove_patches(model)
    return {
        "mesh_dims": list(mesh.device_mesh.mesh_dim_names),
        "describe": mesh.describe(),
        "pipe_rank": mesh.local_rank("pipe"),
        "model_dims": list(mesh.model_dims()),
        "model_group_is_pipe": mesh.model_group is mesh.group("pipe"),
        "applied": applied,
        "patched_shift": float((patched - before).max()),
        "removed": removed,
        "left": [str(patch) for _, patch in patches(model)],
        "unpatched_equal": torch.equal(model(inputs).detach(), before),
        "global_dims_unchanged": PARALLELISMS.dims == MESH_DIMS and "pipe" not in MESH_DIMS,
        "apply_order": list(registry.apply_order),
    }
