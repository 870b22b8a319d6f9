"""The parallelisms paradiff composes on one mesh, each a registered `Parallelism`, and the registry that orders them.

A parallelism declares the mesh dimensions it owns (in mesh order), the sizes a `ParallelConfig` gives them, why a
config's degrees cannot be (a refusal naming what to change), how it resolves its plan for a model, what it puts on
a loaded model (through `runtime/patches.py`, so every change is recorded and removable) and its per-step hooks.

This module is the lowest layer of it (it imports nothing of paradiff: `config.py` reads the dimensions and the
refusals from it): here each built-in parallelism is declared by its dimensions and degrees; its model face
(`validate`, `resolve_plan`, `apply`, the step hooks) is bound where its mechanism lives (`api/parallelisms.py`),
by a subclass of the same name and dimensions. The registry is an immutable tuple built at import: the mesh's
dimension list (`distributed/mesh.py: MESH_DIMS`) and the spelling of parallel modes (`config.py: parse_mode`) are
read from it. A new parallelism is one more instance in `PARALLELISMS` (docs/architecture.md, "Adding a
parallelism"); a test builds a registry of its own with `Registry.adding` and passes it where a registry is taken,
never changing this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class Parallelism:
    """One way of spreading a model's work over ranks. Subclasses set `name` and `dims` and override what they need;
    the defaults are "owns no degree above 1" and "nothing to check, resolve, put on the model or run per step"."""

    name: str = ""
    dims: tuple[str, ...] = ()  # the mesh dimensions it owns, outermost first
    aliases: tuple[tuple[str, str], ...] = ()  # (spelling, dimension): other names in a parallel mode ("dp")
    # Whether its ranks compute one forward together (and so take every decision together: the mesh's model group),
    # rather than each computing a forward of its own (data replicas, CFG branches).
    splits_model: bool = False

    # --- the mesh face: numbers only, checked before torch.distributed exists ------------------------------------
    def degrees(self, config: Any) -> dict[str, int]:
        """The size of each of its dimensions under `config` (a ParallelConfig); 1 where unused."""
        return dict.fromkeys(self.dims, 1)

    def refusal(self, config: Any) -> str | None:
        """Why `config`'s degrees cannot be, naming the bad values and what would be valid; None when they can."""
        return None

    def enabled(self, config: Any) -> bool:
        """Whether `config` uses it (a degree above 1 on one of its dimensions)."""
        return any(size > 1 for size in self.degrees(config).values())

    # --- the model face: bound where the mechanism lives (api/parallelisms.py) ------------------------------------
    def validate(self, config: Any, model: Any, plan: Any) -> None:
        """Refuse, naming the bad value, a model or plan this parallelism cannot run: before any weight is read or
        any collective issued."""

    def resolve_plan(self, config: Any, model: Any, plan: Any, coordinates: Any) -> Any:
        """This rank's resolved plan for `model` (`plan`: the caller's, or None for the model family's), or None
        when it has nothing to resolve."""
        return None

    # the load-time phase: inside the load sequence (`api/load_sequence.py`), on a component whose weights are read
    # already split (shard-on-read): `component` is its `Component` (model, resolved plans, the TP group, FSDP blocks)
    def before_read(self, component: Any, mesh: Any, device: Any, read: str) -> None:
        """Change the model after the mesh is built and before any weight is read (on the meta device when `read` is
        "all"): what the read must find in place, so each rank reads only its own part."""

    def after_read(self, component: Any, mesh: Any, read: str) -> None:
        """Change the model once every rank read its weights, before the quantized weights are put in place and
        before `apply`."""

    def apply(self, model: Any, resolved: Any, mesh: Any, state: Any) -> None:
        """Put its changes on a loaded model, each through `runtime/patches.py` (recorded with `by=self.name`)."""

    def apply_to_pipeline(self, pipeline: Any, models: list[Any], mesh: Any) -> None:
        """Put its changes on a loaded pipeline whose transformers (`models`) were attached: what needs the
        pipeline's own facts (its CFG rule, its guiders)."""

    # --- the per-step lifecycle: a pipeline call runs these once per denoising step (`runtime/steps.py`) ----------
    def before_step(self, model: Any, step: int) -> None:
        """Run before denoising step `step` (0 first in each call), at the step's first transformer call."""

    def after_step(self, model: Any, step: int) -> None:
        """Run after denoising step `step`, once the scheduler stepped (or when the call ends)."""

    @property
    def has_step_hooks(self) -> bool:
        """Whether it runs anything per step (a pipeline whose parallelisms have none puts no step hook on)."""
        return (type(self).before_step is not Parallelism.before_step
                or type(self).after_step is not Parallelism.after_step)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, dims={self.dims})"


class DataParallelism(Parallelism):
    """Replicas of the whole model, each given its own share of the inputs (`api/data_parallel.py`)."""

    name, dims, aliases = "data", ("data",), (("dp", "data"),)

    def degrees(self, config: Any) -> dict[str, int]:
        return {"data": config.data_degree}


class CfgParallelism(Parallelism):
    """The conditional and unconditional branches of classifier-free guidance on different ranks (`runtime/cfg.py`,
    put on a pipeline's transformers by `api/pipeline.py`)."""

    name, dims = "cfg", ("cfg",)

    def degrees(self, config: Any) -> dict[str, int]:
        return {"cfg": config.cfg_degree}


class FsdpParallelism(Parallelism):
    """FSDP2 per repeated block (`fsdp/`, `api/fsdp.py`): its own dimension without context parallelism; with it,
    it shares the CP ranks and adds no rank (`ParallelConfig.fsdp_dims`)."""

    name, dims = "fsdp", ("fsdp",)
    splits_model = True

    def degrees(self, config: Any) -> dict[str, int]:
        cp = config.ring_degree * config.ulysses_degree
        return {"fsdp": config.fsdp_degree if cp == 1 else 1}

    def refusal(self, config: Any) -> str | None:
        if config.fsdp_offload and config.fsdp_degree == 1:
            return ("fsdp_offload=True with fsdp_degree=1: the offload keeps FSDP's shards in CPU memory, and nothing "
                    "is FSDP-sharded; set fsdp_degree > 1 (or use diffusers' own offload without paradiff's mesh).")
        cp = config.ring_degree * config.ulysses_degree
        if config.fsdp_degree > 1 and cp > 1 and config.fsdp_degree != cp:
            return (f"fsdp_degree={config.fsdp_degree} with context parallelism of {cp} ranks (ring="
                    f"{config.ring_degree} x ulysses={config.ulysses_degree}): FSDP shards over the CP ranks, so fsdp "
                    f"must equal {cp} (or be 1). Use a separate fsdp dimension only without ring / ulysses.")
        return None


class ContextParallelism(Parallelism):
    """The token sequence split over ring x ulysses ranks (`context_parallel/`): Ulysses inside ring, so the
    all-to-alls get neighbouring ranks."""

    name, dims = "cp", ("ring", "ulysses")
    splits_model = True

    def degrees(self, config: Any) -> dict[str, int]:
        return {"ring": config.ring_degree, "ulysses": config.ulysses_degree}


class TensorParallelism(Parallelism):
    """Every planned weight split over the tp ranks (`tensor_parallel/`): innermost, the dimension that talks most."""

    name, dims = "tp", ("tp",)
    splits_model = True

    def degrees(self, config: Any) -> dict[str, int]:
        return {"tp": config.tp_degree}


@dataclass(frozen=True)
class Registry:
    """The parallelisms of one mesh, in mesh order (the first outermost), and the order they are applied to a model
    in (`apply_order`, names; torchtitan's: TP, CP, then compile, then FSDP). Immutable: `adding` and `binding`
    return a new one."""

    parallelisms: tuple[Parallelism, ...]
    apply_order: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        names = [p.name for p in self.parallelisms]
        dims = [dim for p in self.parallelisms for dim in p.dims]
        repeated = sorted({n for n in names if names.count(n) > 1} | {d for d in dims if dims.count(d) > 1})
        if repeated or not all(names) or not all(p.dims for p in self.parallelisms):
            raise ValueError(f"a registry's parallelisms need distinct, non-empty names and dimensions; got "
                             f"{[(p.name, p.dims) for p in self.parallelisms]} (repeated: {repeated}).")
        if not self.apply_order:
            object.__setattr__(self, "apply_order", tuple(names))
        if sorted(self.apply_order) != sorted(names):
            raise ValueError(f"apply_order {self.apply_order} must name each of {names} once.")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parallelisms)

    @property
    def dims(self) -> tuple[str, ...]:
        """Every mesh dimension, outermost first."""
        return tuple(dim for p in self.parallelisms for dim in p.dims)

    @property
    def aliases(self) -> dict[str, str]:
        return {alias: dim for p in self.parallelisms for alias, dim in p.aliases}

    def get(self, name: str) -> Parallelism:
        for parallelism in self.parallelisms:
            if parallelism.name == name:
                return parallelism
        raise KeyError(f"no parallelism named {name!r}; registered: {', '.join(self.names)}.")

    def owner(self, dim: str) -> Parallelism:
        """The parallelism that owns mesh dimension `dim`."""
        for parallelism in self.parallelisms:
            if dim in parallelism.dims:
                return parallelism
        raise KeyError(f"no parallelism owns a mesh dimension {dim!r}; the dimensions are {', '.join(self.dims)}.")

    def in_apply_order(self) -> tuple[Parallelism, ...]:
        return tuple(self.get(name) for name in self.apply_order)

    def degrees(self, config: Any) -> dict[str, int]:
        """Every mesh dimension's size under `config`, outermost first."""
        sizes: dict[str, int] = {}
        for parallelism in self.parallelisms:
            given = parallelism.degrees(config)
            sizes.update((dim, given.get(dim, 1)) for dim in parallelism.dims)
        return sizes

    def refusal(self, config: Any) -> str | None:
        """The first parallelism's refusal of `config`, in mesh order; None when every one accepts it."""
        for parallelism in self.parallelisms:
            why = parallelism.refusal(config)
            if why is not None:
                return why
        return None

    def adding(self, parallelism: Parallelism, *, after: str | None = None, apply_after: str | None = None
               ) -> "Registry":
        """A new registry with `parallelism` placed in mesh order after the one named `after` (None: outermost)
        and applied after `apply_after` (None: first); this one is unchanged."""
        position = 0 if after is None else self.names.index(self.get(after).name) + 1
        applied = 0 if apply_after is None else self.apply_order.index(self.get(apply_after).name) + 1
        return Registry(self.parallelisms[:position] + (parallelism,) + self.parallelisms[position:],
                        self.apply_order[:applied] + (parallelism.name,) + self.apply_order[applied:])

    def binding(self, *parallelisms: Parallelism) -> "Registry":
        """A new registry in which each of `parallelisms` replaces the registered one of its name (same dimensions:
        a model face bound to a declared parallelism)."""
        given = {p.name: p for p in parallelisms}
        for name, parallelism in given.items():
            if parallelism.dims != self.get(name).dims:
                raise ValueError(f"{parallelism!r} binds {name!r} with dimensions {parallelism.dims}; the registered "
                                 f"one owns {self.get(name).dims}.")
        return Registry(tuple(given.get(p.name, p) for p in self.parallelisms), self.apply_order)


# Mesh order, outermost first: data x cfg x fsdp x ring x ulysses x tp (the dimensions that talk the most get
# neighbouring ranks). Applied to a model in torchtitan's order: TP, then CP, then FSDP (compile is not a
# parallelism: `runtime/compilation.py` runs after attach); data and CFG put nothing on the transformer itself.
DATA, CFG, FSDP, CONTEXT, TENSOR = (DataParallelism(), CfgParallelism(), FsdpParallelism(), ContextParallelism(),
                                    TensorParallelism())
PARALLELISMS = Registry((DATA, CFG, FSDP, CONTEXT, TENSOR), apply_order=("tp", "cp", "fsdp", "cfg", "data"))
