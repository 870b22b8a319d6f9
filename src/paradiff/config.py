"""User-facing parallel configurations.

They only hold and validate numbers; turning them into process groups is `mesh.py`'s job, so a config can be built
and checked before torch.distributed exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paradiff.distributed.parallelism import CONTEXT, PARALLELISMS
from paradiff.errors import ParallelConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _check_degree(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParallelConfigError(f"{name} must be an int >= 1, got {value!r} ({type(value).__name__}).")
    if value < 1:
        raise ParallelConfigError(f"{name} must be >= 1, got {value}.")
    return value


@dataclass
class TensorParallelConfig:
    """Split every planned weight of the transformer over `tp_degree` ranks.

    `tp_degree` must divide the world size; the remaining factor replicates the TP group (data parallel).
    `mesh`, when given, must have a dimension named "tp" of size `tp_degree`.
    """

    tp_degree: int = 1
    mesh: "DeviceMesh | None" = None

    def __post_init__(self) -> None:
        _check_degree("tp_degree", self.tp_degree)


@dataclass
class ContextParallelConfig:
    """Split the token sequence over `ring_degree * ulysses_degree` ranks.

    `ulysses_anything` and `ring_anything` exist for compatibility with diffusers' API. paradiff handles any sequence
    length and any head count in every mode (ring, Ulysses and unified), so both flags change nothing.
    """

    ring_degree: int = 1
    ulysses_degree: int = 1
    ulysses_anything: bool = False
    ring_anything: bool = False
    mesh: "DeviceMesh | None" = None

    def __post_init__(self) -> None:
        _check_degree("ring_degree", self.ring_degree)
        _check_degree("ulysses_degree", self.ulysses_degree)
        if self.ring_degree == 1 and self.ulysses_degree == 1:
            raise ParallelConfigError(
                "ContextParallelConfig needs ring_degree > 1 or ulysses_degree > 1 "
                "(got ring_degree=1, ulysses_degree=1): with both at 1 there is nothing to split."
            )

    @property
    def degree(self) -> int:
        return self.ring_degree * self.ulysses_degree

    @property
    def mode(self) -> str:
        if self.ring_degree > 1 and self.ulysses_degree > 1:
            return "unified"
        return "ring" if self.ring_degree > 1 else "ulysses"


@dataclass
class ParallelConfig:
    """Every parallelism on one mesh: data x cfg x fsdp x ring x ulysses x tp (outermost to innermost; the registered
    parallelisms' dimensions, `distributed/parallelism.py`).

    `fsdp_degree` shards the transformer blocks' weights (FSDP2, docs/fsdp.md). With context parallelism it shares
    the CP ranks (it must equal ring x ulysses: the usual sequence-parallel + FSDP layout) and adds no rank; without
    it, it is a dimension of its own whose ranks compute the same forward, each holding 1/fsdp of the weights.
    The product of the mesh's dimensions (`degrees()`) must equal the world size.
    """

    tensor_parallel_config: TensorParallelConfig | None = None
    context_parallel_config: ContextParallelConfig | None = None
    cfg_degree: int = 1
    data_degree: int = 1
    mesh: "DeviceMesh | None" = field(default=None, repr=False)
    fsdp_degree: int = 1
    fsdp_offload: bool = False  # FSDP's shards kept in CPU memory between uses (FSDP2's CPUOffloadPolicy)

    def __post_init__(self) -> None:
        _check_degree("cfg_degree", self.cfg_degree)
        _check_degree("data_degree", self.data_degree)
        _check_degree("fsdp_degree", self.fsdp_degree)
        if self.tensor_parallel_config is not None and not isinstance(
            self.tensor_parallel_config, TensorParallelConfig
        ):
            raise ParallelConfigError(
                f"tensor_parallel_config must be a TensorParallelConfig, got {type(self.tensor_parallel_config).__name__}."
            )
        if self.context_parallel_config is not None and not isinstance(
            self.context_parallel_config, ContextParallelConfig
        ):
            raise ParallelConfigError(
                "context_parallel_config must be a ContextParallelConfig, got "
                f"{type(self.context_parallel_config).__name__}."
            )
        if self.fsdp_offload not in (True, False):
            raise ParallelConfigError(f"fsdp_offload must be True or False, got {self.fsdp_offload!r}.")
        refusal = PARALLELISMS.refusal(self)  # each registered parallelism's rules on its degrees
        if refusal is not None:
            raise ParallelConfigError(refusal)

    @classmethod
    def from_degrees(cls, tp: int = 1, ulysses: int = 1, ring: int = 1, cfg: int = 1, data: int = 1,
                     mesh: "DeviceMesh | None" = None, fsdp: int = 1,
                     fsdp_offload: bool = False) -> "ParallelConfig":
        """The config of these degrees: a TensorParallelConfig only when tp > 1, a ContextParallelConfig only when
        ring or ulysses > 1 (each with 1 would be rejected or mean nothing)."""
        return cls(
            tensor_parallel_config=TensorParallelConfig(tp_degree=tp) if _check_degree("tp", tp) > 1 else None,
            context_parallel_config=(ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses)
                                     if _check_degree("ring", ring) * _check_degree("ulysses", ulysses) > 1
                                     else None),
            cfg_degree=cfg, data_degree=data, mesh=mesh, fsdp_degree=_check_degree("fsdp", fsdp),
            fsdp_offload=fsdp_offload)

    @classmethod
    def from_mode(cls, mode: str, mesh: "DeviceMesh | None" = None) -> "ParallelConfig":
        """The config of a mode spelled as parse_mode reads it ("tp2xulysses2", "fsdp2xulysses2", "single")."""
        degrees = parse_mode(mode)
        return cls.from_degrees(tp=degrees["tp"], ulysses=degrees["ulysses"], ring=degrees["ring"],
                                cfg=degrees["cfg"], data=degrees["data"], mesh=mesh, fsdp=degrees["fsdp"])

    @property
    def tp_degree(self) -> int:
        return self.tensor_parallel_config.tp_degree if self.tensor_parallel_config else 1

    @property
    def ring_degree(self) -> int:
        return self.context_parallel_config.ring_degree if self.context_parallel_config else 1

    @property
    def ulysses_degree(self) -> int:
        return self.context_parallel_config.ulysses_degree if self.context_parallel_config else 1

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """The mesh dimensions whose ranks share one FSDP group: none, the CP ranks, or its own dimension."""
        if self.fsdp_degree == 1:
            return ()
        return CONTEXT.dims if self.ring_degree * self.ulysses_degree > 1 else ("fsdp",)

    def degrees(self) -> dict[str, int]:
        """Mesh dimension sizes, outermost first, as the registered parallelisms give them (fsdp is 1 here when it
        shares the CP ranks: `fsdp_dims`)."""
        return PARALLELISMS.degrees(self)

    @property
    def world_size(self) -> int:
        size = 1
        for value in self.degrees().values():
            size *= value
        return size


# Outermost to innermost, as ParallelConfig.degrees() orders the mesh: the registered parallelisms' dimensions.
MODE_DIMENSIONS = PARALLELISMS.dims
NO_PARALLELISM = "single"
MODE_ALIASES = PARALLELISMS.aliases  # the CLI's --dp


def parse_mode(mode: str) -> dict[str, int]:
    """The degrees of a parallel mode spelled like "tp2xulysses2" (also "tp2 x ulysses2", "tp=2"); "single" or ""
    for no parallelism. Every dimension of MODE_DIMENSIONS is in the result, 1 where the mode does not name it."""
    degrees = dict.fromkeys(MODE_DIMENSIONS, 1)
    text = mode.strip()
    if text in ("", NO_PARALLELISM):
        return degrees
    named: set[str] = set()
    for part in text.split("x"):
        part = part.strip()
        name = part.rstrip("0123456789").rstrip("=").strip()
        name = MODE_ALIASES.get(name, name)
        number = part[len(part.rstrip("0123456789")):]
        if name not in degrees or not number or int(number) < 1:
            raise ValueError(f"parallel mode {mode!r}: bad part {part!r}; write parts like 'tp2' joined by 'x' "
                             f"(e.g. 'tp2xulysses2'), from {', '.join(MODE_DIMENSIONS)}, or {NO_PARALLELISM!r}.")
        if name in named:
            raise ValueError(f"parallel mode {mode!r}: {name!r} is given twice.")
        named.add(name)
        degrees[name] = int(number)
    return degrees


def mode_world_size(mode: str) -> int:
    """How many ranks a mode spans (the product of its mesh's dimensions: fsdp adds none when it shares the CP
    ranks)."""
    return ParallelConfig.from_mode(mode).world_size


def mode_name(degrees: dict[str, int], order: tuple[str, ...] = MODE_DIMENSIONS, separator: str = "x") -> str:
    """The name of these degrees, like "ulysses2xtp2": the dimensions above 1 in `order`, or "single"."""
    unknown = set(degrees) - set(MODE_DIMENSIONS)
    if unknown:
        raise ValueError(f"unknown parallel dimension(s) {sorted(unknown)}; valid: {', '.join(MODE_DIMENSIONS)}.")
    return separator.join(f"{name}{degrees[name]}" for name in order if degrees.get(name, 1) > 1) or NO_PARALLELISM


AnyParallelConfig = TensorParallelConfig | ContextParallelConfig | ParallelConfig


def as_parallel_config(config: Any, world_size: int | None = None) -> ParallelConfig:
    """Normalise any accepted config into a ParallelConfig.

    A bare TP or CP config that does not fill the world is completed with data parallelism, the way a user running
    `torchrun --nproc-per-node 4` with tp_degree=2 expects two independent TP pairs.
    """
    if isinstance(config, ParallelConfig):
        return config
    if isinstance(config, TensorParallelConfig):
        parallel = ParallelConfig(tensor_parallel_config=config, mesh=config.mesh)
    elif isinstance(config, ContextParallelConfig):
        parallel = ParallelConfig(context_parallel_config=config, mesh=config.mesh)
    else:
        raise ParallelConfigError(
            "parallel_config must be a TensorParallelConfig, ContextParallelConfig or ParallelConfig, got "
            f"{type(config).__name__}."
        )
    if world_size is not None and config.mesh is None:
        degree = parallel.world_size
        if degree > world_size:
            raise ParallelConfigError(_too_large(config, degree, world_size))
        if world_size % degree != 0:
            raise ParallelConfigError(
                f"{_describe(config)} needs {degree} ranks, which must divide the world size {world_size} (the "
                f"remaining factor runs data-parallel replicas); valid degrees on {world_size} ranks: "
                f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}. Or pass a ParallelConfig whose "
                "degrees multiply to the world size."
            )
        parallel.data_degree = world_size // degree
    return parallel


def _describe(config: Any) -> str:
    if isinstance(config, TensorParallelConfig):
        return f"tp_degree={config.tp_degree}"
    return f"ring_degree={config.ring_degree} x ulysses_degree={config.ulysses_degree}"


def _too_large(config: Any, degree: int, world_size: int) -> str:
    return (
        f"{_describe(config)} needs {degree} ranks but the world size is {world_size}; start at least {degree} "
        f"processes (e.g. torchrun --nproc-per-node {degree}) or lower the degree."
    )
