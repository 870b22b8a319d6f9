"""`Family`: what one plan module declares about the model classes it knows."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

# The module-level names a plan module declares its family's fields by (`Family.of`): field -> name in the module.
_DECLARED_AS = {"model_classes": "MODEL_CLASSES", "examples": "EXAMPLES", "example_inputs": "INPUTS",
                "extra_modes": "EXTRA_MODES", "fsdp_own_units": "FSDP_OWN_UNITS"}


@dataclass(frozen=True)
class Family:
    """One model family: its classes, its plans and its tiny examples.

    Each plan module ends with `FAMILY = Family.of(__name__)`, which collects its module-level declarations by
    their conventional names (`MODEL_CLASSES`, `tensor_parallel_plan`, `EXAMPLES`, `INPUTS`, ...: the field
    names, the data ones in capitals); a field the module does not declare stays None or empty (no
    context-parallel plan, no example hook)."""

    name: str  # the module's short name, e.g. "flux": what `paradiff check-plan flux:...` and test ids say
    model_classes: tuple[str, ...]
    tensor_parallel_plan: Callable[..., Any] | None = None
    context_parallel_plan: Callable[..., Any] | None = None
    # {example name: (class name, tiny config kwargs)}: the smallest configurations exercising every block type
    examples: Mapping[str, tuple[str, dict]] = field(default_factory=dict)
    # the examples' forward kwargs (or whatever run_example takes), declared as data: `INPUTS`, a dict of records
    # of plans/inputs.py or ByExample({example name: dict}), materialized by plan_tools/example_inputs.py
    example_inputs: Any = None
    # init_example(model): seeds the parameters an example's class leaves uninitialised (torch.empty expert banks)
    init_example: Callable[..., Any] | None = None
    # prepare_example(model): swaps in an equivalent kernel torch's FLOP counter can run (eager flex attention)
    prepare_example: Callable[..., Any] | None = None
    # run_example(model, inputs): the example forward where one call is not the whole story (a cache-filling pass)
    run_example: Callable[..., Any] | None = None
    # model_config(config, class name): the config the class is built from, given the one its folder holds, where they differ
    # (PRX's T5GemmaEncoder is built from the `encoder` part of the encoder-decoder config its checkpoint keeps)
    model_config: Callable[[Any], Any] | None = None
    # {example name: modes beyond tp2 / ulysses2 / ring2 / tp2 x ulysses2, e.g. ("tp4",)} the test suite also runs
    extra_modes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # submodules of a block that the model's forward calls outside that block's forward (DiT's
    # `transformer_blocks.0.norm1.emb`, run again after the blocks): FSDP makes each a unit of its own, gathered
    # whenever it runs, instead of leaving its weights to the block's unit (sharded outside the block's forward)
    fsdp_own_units: tuple[str, ...] = ()

    def plan(self, kind: str) -> Callable[..., Any] | None:
        """The `kind` ("tensor" or "context") plan function, or None."""
        return {"tensor": self.tensor_parallel_plan, "context": self.context_parallel_plan}[kind]

    @classmethod
    def of(cls, module_name: str) -> Family:
        """The family the module `module_name` declares: called at its end, with every declaration made."""
        namespace = vars(sys.modules[module_name])
        declared = {}
        for item in fields(cls):
            if item.name == "name":
                continue
            value = namespace.get(_DECLARED_AS.get(item.name, item.name))
            if value is not None:
                declared[item.name] = value
        return cls(name=module_name.rpartition(".")[2], **declared)
