"""One DeviceMesh with named dimensions (data, cfg, fsdp, ring, ulysses, tp: the registered parallelisms' dimensions,
`distributed/parallelism.py`), the process groups cut from it, and each rank's coordinates along those dimensions.

Ulysses sits inside ring and tp innermost: the dimensions that talk the most get neighbouring ranks, which on one node
means the fastest links.

A user-given DeviceMesh maps onto paradiff's dimensions by name:
- a dimension named `data`, `cfg`, `fsdp`, `ring`, `ulysses` or `tp` is that dimension;
- dimensions with other names are taken, in their order, as the paradiff dimensions of degree > 1 that no mesh
  dimension names, in paradiff's order (data, cfg, fsdp, ring, ulysses, tp); their sizes must agree. So a 1-D mesh
  of size N with tp_degree=N is the TP dimension, and a ("replicas", "model") mesh with data_degree=2, tp_degree=2
  is data x tp;
- user dimensions of size 1 that no degree needs are ignored, and paradiff dimensions the mesh lacks have size 1.
Anything else raises ParallelConfigError naming the mesh's dimensions and the degrees it must carry.
"""

from __future__ import annotations

import atexit
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paradiff.config import ParallelConfig
from paradiff.distributed.parallelism import CONTEXT, DATA, PARALLELISMS, Parallelism, Registry
from paradiff.errors import DistributedError, ParallelConfigError

MESH_DIMS = PARALLELISMS.dims
CP_DIMS = CONTEXT.dims
REPLICA_DIMS = tuple(dim for dim in MESH_DIMS if dim not in DATA.dims)  # the ranks of one data-parallel replica
FSDP_GROUP = ("fsdp weights",)  # flat_groups' key of the FSDP group (its dims are config.fsdp_dims)


@dataclass(frozen=True)
class MeshCoordinates:
    """One rank's index and the size along each of the mesh's dimensions.

    A group of dimensions numbers its ranks row-major over the dimensions as given (the first outermost), the order
    `dist.new_group` receives them in `_add_flat_groups`.
    """

    sizes: dict[str, int]
    indices: dict[str, int]

    def size(self, *dims: str) -> int:
        total = 1
        for dim in dims:
            total *= self.sizes[dim]
        return total

    def index(self, *dims: str) -> int:
        position = 0
        for dim in dims:
            position = position * self.sizes[dim] + self.indices[dim]
        return position

    @property
    def tp_rank(self) -> int:
        return self.indices["tp"]

    @property
    def cp_rank(self) -> int:
        return self.index(*CP_DIMS)

    @property
    def replica(self) -> int:
        """Which data-parallel replica this rank belongs to."""
        return self.indices["data"]


def coordinates_from_degrees(degrees: dict[str, int], rank: int) -> MeshCoordinates:
    """Coordinates before any mesh exists: world ranks are laid out over `degrees` in its order (a registry's: data x
    cfg x fsdp x ring x ulysses x tp), innermost last."""
    dims = tuple(degrees)
    indices = {}
    remainder = rank
    for dim in reversed(dims):
        indices[dim] = remainder % degrees[dim]
        remainder //= degrees[dim]
    return MeshCoordinates(sizes={dim: degrees[dim] for dim in dims}, indices={d: indices[d] for d in dims})


def mesh_dim_mapping(degrees: dict[str, int], mesh_names: tuple[str, ...], mesh_sizes: tuple[int, ...]
                     ) -> dict[str, int]:
    """paradiff dimension -> position in the user mesh, by the rule in this module's docstring (the dimensions are
    `degrees`' keys, in their order)."""
    dims = tuple(degrees)
    named = {name: position for position, name in enumerate(mesh_names) if name in dims}
    unnamed = [position for position, name in enumerate(mesh_names) if name not in dims]
    wanted = [dim for dim in dims if dim not in named and degrees[dim] > 1]
    unnamed_used = [position for position in unnamed if mesh_sizes[position] > 1]
    needed = " x ".join(f"{dim}={degrees[dim]}" for dim in dims if degrees[dim] > 1) or "none (every degree is 1)"
    shape = ", ".join(f"{name!r}={size}" for name, size in zip(mesh_names, mesh_sizes))
    if len(unnamed_used) != len(wanted) or any(mesh_sizes[p] != degrees[d] for p, d in zip(unnamed_used, wanted)):
        raise ParallelConfigError(
            f"The given DeviceMesh has dimensions ({shape}) but the config's degrees are {needed}. Name mesh "
            f"dimensions after paradiff's {dims}, or give dimensions of other names in that order with sizes "
            f"matching the degrees not named ({', '.join(f'{d}={degrees[d]}' for d in wanted) or 'none'})."
        )
    mapping = dict(named)
    mapping.update(zip(wanted, unnamed_used))
    for dim, position in named.items():
        if mesh_sizes[position] != degrees[dim]:
            raise ParallelConfigError(
                f"The given DeviceMesh's {mesh_names[position]!r} dimension has size {mesh_sizes[position]}, "
                f"but the config asks for {dim}={degrees[dim]}."
            )
    return mapping


def coordinates_from_mesh(degrees: dict[str, int], mesh: DeviceMesh) -> MeshCoordinates:
    """Coordinates of this rank on a user DeviceMesh, looked up by dimension name (see mesh_dim_mapping)."""
    names = tuple(mesh.mesh_dim_names or ())
    mapping = mesh_dim_mapping(degrees, names, tuple(mesh.mesh.shape))
    coordinate = mesh.get_coordinate() or [0] * len(names)
    indices = {dim: (coordinate[mapping[dim]] if dim in mapping else 0) for dim in degrees}
    return MeshCoordinates(sizes=dict(degrees), indices=indices)


def rank_coordinates(config: ParallelConfig, rank: int | None = None) -> MeshCoordinates:
    """This rank's coordinates under `config`: from its mesh when one is given, else from the degrees and the world
    rank (`rank` defaults to dist.get_rank())."""
    if config.mesh is not None:
        return coordinates_from_mesh(config.degrees(), config.mesh)
    return coordinates_from_degrees(config.degrees(), dist.get_rank() if rank is None else rank)


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def require_distributed() -> None:
    """The default process group, initialised here from torchrun's environment when the script did not: `gloo` on
    CPU, `nccl` with the CUDA device LOCAL_RANK where CUDA is usable; without that environment, an error saying how to
    start the script."""
    if dist.is_available() and dist.is_initialized():
        return
    present = [name for name in TORCHRUN_VARIABLES if os.environ.get(name)]
    if not dist.is_available() or len(present) < len(TORCHRUN_VARIABLES):
        missing = [name for name in TORCHRUN_VARIABLES if name not in present]
        started = f"; the environment lacks {', '.join(missing)}" if present else ""
        raise DistributedError(
            "torch.distributed is not initialised and this process was not started by torchrun"
            f"{started}. Start the script with `torchrun --nproc-per-node N script.py`, or call "
            "torch.distributed.init_process_group(backend=...) first (\"gloo\" on CPU, \"nccl\" on CUDA)."
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    atexit.register(_destroy_default_group)


def _destroy_default_group() -> None:
    """At exit, the group require_distributed made (NCCL warns of one left behind), unless the script destroyed it."""
    if dist.is_initialized():
        dist.destroy_process_group()


def default_device() -> torch.device:
    """`cuda:LOCAL_RANK` when CUDA is usable, else the CPU."""
    if torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend() != "gloo"):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


@dataclass
class ParallelMesh:
    """The resolved mesh: degrees, this rank's coordinates, and one process group per dimension.

    `flat_groups` holds groups spanning several dimensions (e.g. ("ring", "ulysses") for the whole CP group).
    `registry` gives the dimensions and their sizes (paradiff's parallelisms; a test's own registry adds one).
    """

    config: ParallelConfig
    device_mesh: DeviceMesh
    flat_groups: dict[tuple[str, ...], dist.ProcessGroup] = field(default_factory=dict)
    # paradiff dimension -> its position in device_mesh; a dimension absent here has size 1
    positions: dict[str, int] = field(default_factory=dict)
    registry: Registry = PARALLELISMS

    def __post_init__(self) -> None:
        if not self.positions:
            names = tuple(self.device_mesh.mesh_dim_names or ())
            self.positions = mesh_dim_mapping(self.registry.degrees(self.config), names,
                                              tuple(self.device_mesh.mesh.shape))

    def flat_group(self, dims: tuple[str, ...]) -> dist.ProcessGroup:
        return self.flat_groups[dims]

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.device_mesh.get_group(self.positions[dim])

    def size(self, dim: str) -> int:
        return self.device_mesh.size(self.positions[dim]) if dim in self.positions else 1

    def local_rank(self, dim: str) -> int:
        return self.device_mesh.get_local_rank(self.positions[dim]) if dim in self.positions else 0

    @property
    def coordinates(self) -> MeshCoordinates:
        return MeshCoordinates(sizes={dim: self.size(dim) for dim in self.registry.dims},
                               indices={dim: self.local_rank(dim) for dim in self.registry.dims})

    def ranks_along(self, dims: tuple[str, ...]) -> list[list[int]]:
        """Rows of world ranks that share every coordinate but `dims`, each numbered row-major over `dims`."""
        ranks = self.device_mesh.mesh
        present = [self.positions[d] for d in dims if d in self.positions]
        rest = [p for p in range(ranks.dim()) if p not in present]
        width = 1
        for position in present:
            width *= ranks.shape[position]
        return ranks.permute(rest + present).reshape(-1, width).tolist()

    def replica_ranks(self) -> list[int]:
        """The world ranks of this rank's data-parallel replica (same data index: same inputs)."""
        me = dist.get_rank()
        return next(row for row in self.ranks_along(REPLICA_DIMS) if me in row)

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.group("tp")

    @property
    def cp_degree(self) -> int:
        return math.prod(self.size(dim) for dim in CP_DIMS)

    def _in_use(self) -> list[Parallelism]:
        """The registry's parallelisms with a dimension above 1 on this mesh (FSDP sharing the CP ranks: none)."""
        return [p for p in self.registry.parallelisms if any(self.size(dim) > 1 for dim in p.dims)]

    def model_dims(self) -> tuple[str, ...]:
        """The dimensions of the ranks that compute one forward together: every dimension of each parallelism in use
        that splits the model (fsdp x ring x ulysses x tp here: FSDP ranks of their own dimension gather each block
        together, so they must take every decision together)."""
        return tuple(dim for p in self._in_use() if p.splits_model for dim in p.dims)

    @property
    def model_group(self) -> dist.ProcessGroup | None:
        """The ranks of `model_dims`; None when that is this rank alone."""
        dims = self.model_dims()
        if not dims:
            return None
        return self.group(dims[0]) if len(dims) == 1 else self.flat_group(dims)

    def describe(self) -> dict[str, int]:
        return {name: self.size(name) for name in self.registry.dims}

    @property
    def fsdp_group(self) -> dist.ProcessGroup | None:
        """The ranks that share one FSDP group's weight shards (None: no FSDP). A group of its own even where it
        holds the CP ranks, so the weights' all-gathers never queue behind (or interleave with) the sequence's."""
        return self.flat_groups.get(FSDP_GROUP)

    def fsdp_mesh(self) -> DeviceMesh | None:
        """A 1-D DeviceMesh over the FSDP group, the form `fully_shard` takes (None: no FSDP)."""
        group = self.fsdp_group
        if group is None:
            return None
        # The dimension is named after the group: DeviceMesh equality (and the DTensor sharding caches keyed by it)
        # ignores which process group a mesh uses, so a mesh of a later load over the same ranks (the groups of an
        # earlier one destroyed: a server's reload, a test pool's next case) would otherwise be served the cached
        # specs of the earlier mesh, whose group no longer resolves.
        return DeviceMesh.from_group(group, self.device_mesh.device_type, mesh_dim_names=(f"fsdp-{group.group_name}",))


def build_mesh(config: ParallelConfig, device: torch.device | None = None,
               registry: Registry = PARALLELISMS) -> ParallelMesh:
    """Validate the degrees against the world and build (or adopt) the DeviceMesh, one dimension per dimension of
    `registry`'s parallelisms, in their order."""
    require_distributed()
    world_size = dist.get_world_size()
    degrees = registry.degrees(config)
    if config.mesh is not None:
        return _adopt_mesh(config, config.mesh, registry)
    product = math.prod(degrees.values())
    if product != world_size:
        detail = " x ".join(f"{name}={size}" for name, size in degrees.items())
        raise ParallelConfigError(
            f"The parallel degrees multiply to {product} ({detail}) but the world size is {world_size}; "
            "their product must equal the number of processes."
        )
    device_type = (device or default_device()).type
    mesh = init_device_mesh(device_type, tuple(degrees.values()), mesh_dim_names=registry.dims)
    parallel_mesh = ParallelMesh(config=config, device_mesh=mesh, registry=registry)
    _add_flat_groups(parallel_mesh)
    return parallel_mesh


def _add_flat_groups(parallel_mesh: ParallelMesh) -> None:
    """Create the multi-dimension groups every rank must create together (new_group is collective): each
    parallelism in use that owns several dimensions (CP: ring x ulysses), then the model group where it spans several
    parallelisms (ring x ulysses x tp, fsdp x tp), then the FSDP group."""
    in_use = parallel_mesh._in_use()
    wanted = [p.dims for p in in_use if len(p.dims) > 1]
    model_dims = parallel_mesh.model_dims()
    if len([p for p in in_use if p.splits_model]) > 1:
        wanted.append(model_dims)
    me = dist.get_rank()
    for dims in wanted:
        for row in parallel_mesh.ranks_along(dims):
            group = dist.new_group(row)
            if me in row:
                parallel_mesh.flat_groups[dims] = group
    if parallel_mesh.config.fsdp_dims:
        for row in parallel_mesh.ranks_along(parallel_mesh.config.fsdp_dims):
            group = dist.new_group(row)
            if me in row:
                parallel_mesh.flat_groups[FSDP_GROUP] = group


def replica_group(parallel_mesh: ParallelMesh) -> dist.ProcessGroup:
    """The ranks of this rank's data-parallel replica (every dimension but data), made on first use.

    Collective: every rank must ask at the same point (dist.new_group is), which parallelize_vae's callers do.
    """
    if REPLICA_DIMS not in parallel_mesh.flat_groups:
        rows = parallel_mesh.ranks_along(REPLICA_DIMS)
        if len(rows) == 1 and sorted(rows[0]) == list(range(dist.get_world_size())):
            parallel_mesh.flat_groups[REPLICA_DIMS] = dist.group.WORLD
        else:
            me = dist.get_rank()
            for row in rows:
                group = dist.new_group(row)
                if me in row:
                    parallel_mesh.flat_groups[REPLICA_DIMS] = group
    return parallel_mesh.flat_groups[REPLICA_DIMS]


def _adopt_mesh(config: ParallelConfig, mesh: DeviceMesh, registry: Registry = PARALLELISMS) -> ParallelMesh:
    """Use the caller's mesh; ParallelMesh maps its dimensions (and raises on a mismatch) by this module's rule."""
    parallel_mesh = ParallelMesh(config=config, device_mesh=mesh, registry=registry)
    _add_flat_groups(parallel_mesh)
    return parallel_mesh
