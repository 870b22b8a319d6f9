"""One DeviceMesh with named dimensions (data, cfg, ring, ulysses, tp) and the process groups cut from it.

Ulysses sits inside ring and tp innermost: the dimensions that talk the most get neighbouring ranks, which on one node
means the fastest links.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paradiff.config import ParallelConfig
from paradiff.errors import DistributedError, ParallelConfigError

MESH_DIMS = ("data", "cfg", "ring", "ulysses", "tp")


def require_distributed() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedError(
            "torch.distributed is not initialised. Call torch.distributed.init_process_group(backend=...) first "
            "(\"gloo\" on CPU, \"nccl\" on CUDA), or start the script with torchrun."
        )


def default_device() -> torch.device:
    """`cuda:LOCAL_RANK` when CUDA is usable, else the CPU."""
    if torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend() != "gloo"):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


@dataclass
class ParallelMesh:
    """The resolved mesh: degrees, this rank's coordinates, and one process group per dimension.

    `flat_groups` holds groups spanning several dimensions (e.g. ("ring", "ulysses") for the whole CP group).
    """

    config: ParallelConfig
    device_mesh: DeviceMesh
    flat_groups: dict[tuple[str, ...], dist.ProcessGroup] = field(default_factory=dict)

    def flat_group(self, dims: tuple[str, ...]) -> dist.ProcessGroup:
        return self.flat_groups[dims]

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.device_mesh.get_group(dim)

    def size(self, dim: str) -> int:
        return self.device_mesh.size(MESH_DIMS.index(dim)) if dim in self._names() else 1

    def local_rank(self, dim: str) -> int:
        return self.device_mesh.get_local_rank(dim) if dim in self._names() else 0

    def _names(self) -> tuple[str, ...]:
        return tuple(self.device_mesh.mesh_dim_names or ())

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.group("tp")

    @property
    def cp_degree(self) -> int:
        return self.size("ring") * self.size("ulysses")

    @property
    def model_group(self) -> dist.ProcessGroup | None:
        """The ranks that compute one forward together (ring x ulysses x tp); None when that is this rank alone."""
        cp, tp = self.cp_degree > 1, self.size("tp") > 1
        if cp and tp:
            return self.flat_group(("ring", "ulysses", "tp"))
        if cp:
            return self.flat_group(("ring", "ulysses"))
        return self.tp_group if tp else None

    def describe(self) -> dict[str, int]:
        return {name: self.size(name) for name in MESH_DIMS}


def build_mesh(config: ParallelConfig, device: torch.device | None = None) -> ParallelMesh:
    """Validate the degrees against the world and build (or adopt) the DeviceMesh."""
    require_distributed()
    world_size = dist.get_world_size()
    degrees = config.degrees()
    if config.mesh is not None:
        return _adopt_mesh(config, config.mesh)
    if config.world_size != world_size:
        detail = " x ".join(f"{name}={size}" for name, size in degrees.items())
        raise ParallelConfigError(
            f"The parallel degrees multiply to {config.world_size} ({detail}) but the world size is {world_size}; "
            "their product must equal the number of processes."
        )
    device_type = (device or default_device()).type
    mesh = init_device_mesh(device_type, tuple(degrees.values()), mesh_dim_names=MESH_DIMS)
    parallel_mesh = ParallelMesh(config=config, device_mesh=mesh)
    _add_flat_groups(parallel_mesh)
    return parallel_mesh


def _add_flat_groups(parallel_mesh: ParallelMesh) -> None:
    """Create the multi-dimension groups every rank must create together (new_group is collective)."""
    wanted = [("ring", "ulysses")] if parallel_mesh.cp_degree > 1 else []
    if parallel_mesh.cp_degree > 1 and parallel_mesh.size("tp") > 1:
        wanted.append(("ring", "ulysses", "tp"))
    names = tuple(parallel_mesh.device_mesh.mesh_dim_names)
    ranks = parallel_mesh.device_mesh.mesh
    me = dist.get_rank()
    for dims in wanted:
        order = [names.index(d) for d in names if d not in dims] + [names.index(d) for d in dims]
        width = 1
        for d in dims:
            width *= ranks.shape[names.index(d)]
        rows = ranks.permute(order).reshape(-1, width).tolist()
        for row in rows:
            group = dist.new_group(row)
            if me in row:
                parallel_mesh.flat_groups[dims] = group


REPLICA_DIMS = ("cfg", "ring", "ulysses", "tp")


def replica_group(parallel_mesh: ParallelMesh) -> dist.ProcessGroup:
    """The ranks of this rank's data-parallel replica (every dimension but data), made on first use.

    Collective: every rank must ask at the same point (dist.new_group is), which parallelize_vae's callers do.
    """
    if REPLICA_DIMS not in parallel_mesh.flat_groups:
        names = tuple(parallel_mesh.device_mesh.mesh_dim_names or ())
        ranks = parallel_mesh.device_mesh.mesh
        if "data" in names:
            ranks = ranks.movedim(names.index("data"), 0)
            rows = ranks.reshape(ranks.shape[0], -1).tolist()
        else:
            rows = [ranks.flatten().tolist()]
        if len(rows) == 1 and sorted(rows[0]) == list(range(dist.get_world_size())):
            parallel_mesh.flat_groups[REPLICA_DIMS] = dist.group.WORLD
        else:
            me = dist.get_rank()
            for row in rows:
                group = dist.new_group(row)
                if me in row:
                    parallel_mesh.flat_groups[REPLICA_DIMS] = group
    return parallel_mesh.flat_groups[REPLICA_DIMS]


def _adopt_mesh(config: ParallelConfig, mesh: DeviceMesh) -> ParallelMesh:
    names = tuple(mesh.mesh_dim_names or ())
    for name, size in config.degrees().items():
        if size > 1 and name not in names:
            raise ParallelConfigError(
                f"The given DeviceMesh has dimensions {names}; it needs a dimension named {name!r} of size {size}."
            )
        if name in names and mesh.size(names.index(name)) != size:
            raise ParallelConfigError(
                f"The given DeviceMesh's {name!r} dimension has size {mesh.size(names.index(name))}, "
                f"but the config asks for {size}."
            )
    parallel_mesh = ParallelMesh(config=config, device_mesh=mesh)
    _add_flat_groups(parallel_mesh)
    return parallel_mesh
