"""Bad inputs run on every rank by tests/test_tp_errors.py (gloo, CPU), under a watch that forbids weight reads and
collectives.

Each scenario builds its inputs outside the watch (loading a reference model may read files and is not under test),
then calls paradiff inside it. Inside the watch every weight read and every collective raises `ForbiddenCall`
instead of running, and is recorded: an error raised "before any weight is read or any collective is issued" leaves
the record empty, and a rank that got further cannot block the others in a collective. The scenario's error comes
back as text (nothing raises out of the case, so the pool stays up), and the case ends with one all-reduce over the
world, which proves every rank is still in step.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Callable, Iterator

import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh_module
from torch import nn
from torch.distributed import distributed_c10d

import paradiff
import paradiff.distributed.mesh
from paradiff.io.checkpoint import SINGLE_FILE, Checkpoint
from paradiff.runtime.state import get_state
from paradiff.tensor_parallel.layers import ShardedLinear
from paradiff.tensor_parallel.styles import PackedColwise
from paradiff.testing.models import Lengths, UnplannedTransformer, make_inputs, model_class, run_forward

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend",
    "irecv", "batch_isend_irecv", "new_group", "new_subgroups", "new_subgroups_by_enumeration",
)


class ForbiddenCall(Exception):
    """A weight read or a collective happened inside `watch()`."""


@contextmanager
def watch() -> Iterator[list[str]]:
    """Replace every weight-reading and collective entry point by a spy that records the call and raises."""
    calls: list[str] = []
    saved: list[tuple[object, str, object]] = []

    def forbid(owner: object, attr: str, label: str) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return

        def spy(*args, **kwargs):
            calls.append(label)
            raise ForbiddenCall(f"{label} was called before paradiff raised")

        saved.append((owner, attr, original))
        setattr(owner, attr, spy)

    for name in COLLECTIVES:
        forbid(dist, name, f"dist.{name}")
        forbid(distributed_c10d, name, f"dist.{name}")
    forbid(paradiff.distributed.mesh, "init_device_mesh", "init_device_mesh")
    forbid(device_mesh_module, "init_device_mesh", "init_device_mesh")
    forbid(Checkpoint, "read", "Checkpoint.read")
    forbid(os, "pread", "os.pread")
    forbid(os, "preadv", "os.preadv")
    forbid(torch, "load", "torch.load")
    forbid(safetensors.torch, "load_file", "safetensors.torch.load_file")
    forbid(safetensors.torch, "load", "safetensors.torch.load")
    try:
        yield calls
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def describe(call: Callable[[], object]) -> tuple[str, list[str]]:
    """Run `call` under the watch; return ("Type: message" or "no error", the forbidden calls it made)."""
    with watch() as calls:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the message is the result
            return f"{type(exc).__name__}: {exc}", list(calls)
    return "no error", list(calls)


# ---------------------------------------------------------------------------------------------------------------
# Scenarios: name -> setup(folders) returning the call to watch. Setup runs unwatched.

SCENARIOS: dict[str, Callable[[dict[str, str]], Callable[[], object]]] = {}


def scenario(function: Callable[[dict[str, str]], Callable[[], object]]):
    SCENARIOS[function.__name__] = function
    return function


FLUX2 = model_class("flux2")
WAN = model_class("wan")


def _tp(degree: int) -> paradiff.TensorParallelConfig:
    return paradiff.TensorParallelConfig(tp_degree=degree)


def _load(folders: dict[str, str], plan=None, tp: int = 2, key: str = "flux2", cls: type = FLUX2, **kwargs):
    return lambda: paradiff.from_pretrained(cls, folders[key], parallel_config=_tp(tp), plan=plan, **kwargs)


def _enable(model: nn.Module, config, **kwargs):
    return lambda: paradiff.enable_parallelism(model, config, **kwargs)


# from_pretrained: the world and the degrees


@scenario
def fp_tp_larger_than_world(f):
    return _load(f, tp=8)


@scenario
def fp_tp_not_dividing_world(f):
    return _load(f, tp=3)


@scenario
def fp_parallel_config_product(f):
    return lambda: paradiff.from_pretrained(
        FLUX2, f["flux2"], parallel_config=paradiff.ParallelConfig(tensor_parallel_config=_tp(3))
    )


@scenario
def fp_tp_beyond_heads(f):
    return _load(f, tp=4, key="heads3")


@scenario
def fp_device_unavailable(f):
    return _load(f, device="cuda:99")


# from_pretrained: the checkpoint


@scenario
def fp_bin_only(f):
    return _load(f, key="bin_only")


@scenario
def fp_config_disagrees_with_weights(f):
    return _load(f, key="mismatch")


# from_pretrained: the plan


@scenario
def fp_no_builtin_plan(f):
    return _load(f, key="unplanned", cls=UnplannedTransformer)


@scenario
def fp_plan_not_a_dict(f):
    return _load(f, plan=["transformer_blocks.*.attn.to_q"])


@scenario
def fp_plan_missing_module(f):
    return _load(f, plan={"transformer_blocks.*.attn.to_qq": "colwise"})


@scenario
def fp_plan_missing_top_module(f):
    return _load(f, plan={"context_embedderr": "rowwise_split_input"})


@scenario
def fp_plan_unknown_style(f):
    return _load(f, plan={"transformer_blocks.*.attn.to_q": "colwize"})


@scenario
def fp_plan_two_stars(f):
    return _load(f, plan={"transformer_blocks.*.attn.*": "colwise"})


@scenario
def fp_plan_partial_star(f):
    return _load(f, plan={"transformer_blocks.0.attn.to_*": "colwise"})


@scenario
def fp_plan_star_glued_to_name(f):
    return _load(f, plan={"transformer_blocks*.attn.to_q": "colwise"})


@scenario
def fp_plan_star_not_over_module_list(f):
    return _load(f, plan={"norm_out.*": "rowwise_split_input"})


@scenario
def fp_plan_star_over_missing_list(f):
    return _load(f, plan={"blocks.*.attn.to_q": "colwise"})


@scenario
def fp_plan_not_a_linear(f):
    return _load(f, plan={"transformer_blocks.*.attn": "colwise"})


@scenario
def fp_plan_module_matched_twice(f):
    return _load(f, plan={"transformer_blocks.*.attn.to_q": "colwise", "transformer_blocks.0.attn.to_q": "rowwise"})


@scenario
def fp_packed_proportions_not_dividing(f):
    # to_q has 64 outputs in the tiny config: three equal parts do not exist
    return _load(f, plan={"transformer_blocks.*.attn.to_q": PackedColwise([1, 1, 1])})


@scenario
def fp_packed_block_smaller_than_tp(f):
    return _load(f, plan={"transformer_blocks.*.attn.to_q": PackedColwise(lambda config: [63, 1])})


@scenario
def fp_packed_sizes_wrong_sum(f):
    return _load(f, plan={"transformer_blocks.*.attn.to_q": PackedColwise(lambda config: [32, 16])})


@scenario
def fp_packed_without_blocks(f):
    return _load(f, plan={"transformer_blocks.*.attn.to_q": PackedColwise()})


# enable_parallelism: model states that cannot be sharded


def plain_model(cls: type, folder: str) -> nn.Module:
    """The checkpoint loaded without paradiff (plain diffusers + safetensors; no accelerate needed, unlike
    `cls.from_pretrained` for models with fp32-kept modules such as Wan)."""
    model = cls.from_config(cls.load_config(folder))
    model.load_state_dict(safetensors.torch.load_file(os.path.join(folder, SINGLE_FILE)), strict=True)
    return model.eval()


def _model(f: dict[str, str], key: str = "flux2", cls: type = FLUX2) -> nn.Module:
    return plain_model(cls, f[key])


@scenario
def en_not_a_module(f):
    return _enable("transformer", _tp(2))


@scenario
def en_quantized(f):
    model = _model(f)
    object.__setattr__(model, "is_quantized", True)
    return _enable(model, _tp(2))


@scenario
def en_hf_quantizer(f):
    model = _model(f)

    class BitsAndBytesQuantizer:  # stands for a diffusers quantizer object
        pass

    object.__setattr__(model, "hf_quantizer", BitsAndBytesQuantizer())
    return _enable(model, _tp(2))


@scenario
def en_accelerate_device_map(f):
    model = _model(f)
    object.__setattr__(model, "hf_device_map", {"": "cpu"})
    return _enable(model, _tp(2))


@scenario
def en_accelerate_offload_hook(f):
    model = _model(f)

    class AlignDevicesHook:  # stands for accelerate's offload hook
        pass

    object.__setattr__(model.get_submodule("transformer_blocks.0.attn"), "_hf_hook", AlignDevicesHook())
    return _enable(model, _tp(2))


@scenario
def en_diffusers_group_offload(f):
    model = _model(f)
    registry = SimpleNamespace(hooks={"group_offloading": object()})
    object.__setattr__(model.get_submodule("single_transformer_blocks.0"), "_diffusers_hook", registry)
    return _enable(model, _tp(2))


@scenario
def en_lora_child(f):
    model = _model(f)
    model.get_submodule("transformer_blocks.0.attn.to_q").add_module("lora_A", nn.ModuleDict())
    return _enable(model, _tp(2))


@scenario
def en_peft_config(f):
    model = _model(f)
    object.__setattr__(model, "peft_config", {"default": {"r": 4}})
    return _enable(model, _tp(2))


@scenario
def en_called_twice(f):
    model = _model(f)
    paradiff.enable_parallelism(model, _tp(2))  # the first call is fine (and issues collectives, unwatched)
    return _enable(model, _tp(2))


@scenario
def en_no_builtin_plan(f):
    return _enable(_model(f, "unplanned", UnplannedTransformer), _tp(2))


@scenario
def en_plan_unknown_style(f):
    return _enable(_model(f), _tp(2), plan={"transformer_blocks.*.ff.linear_out": "row"})


@scenario
def en_tp_larger_than_world(f):
    return _enable(_model(f), _tp(8))


@scenario
def en_tp_not_dividing_world(f):
    return _enable(_model(f), _tp(3))


@scenario
def en_tp_beyond_heads(f):
    return _enable(_model(f, "heads3"), _tp(4))


def error_case(name: str, folders: dict[str, str]) -> dict:
    """Run scenario `name` watched; report its error, the forbidden calls made, and whether the world is in step."""
    call = SCENARIOS[name](folders)
    error, calls = describe(call)
    total = torch.ones(1)
    dist.all_reduce(total)  # every rank must get here, not be parked in a collective
    return {"rank": dist.get_rank(), "error": error, "calls": calls, "in_step": int(total.item())}


# ---------------------------------------------------------------------------------------------------------------
# User plans that work: equal to single-process diffusers.

FLUX2_FFN_PLAN = {
    # a hand-written plan unlike the built-in one: only the MLPs and the text projection are split
    "transformer_blocks.*.ff.linear_in": PackedColwise([1, 1]),
    "transformer_blocks.*.ff.linear_out": "rowwise",
    "transformer_blocks.*.ff_context.linear_in": PackedColwise([1, 1]),
    "transformer_blocks.*.ff_context.linear_out": "rowwise",
    "context_embedder": "rowwise_split_input",
}

WAN_PLAN = {
    # Wan has no built-in TP plan (its QK-norm spans all heads); its MLPs and embedders still split cleanly
    "blocks.*.ffn.net.0.proj": "colwise",
    "blocks.*.ffn.net.2": "rowwise",
    "condition_embedder.time_embedder.linear_1": "colwise",
    "condition_embedder.time_embedder.linear_2": "rowwise",
    "condition_embedder.text_embedder.linear_1": "colwise",
    "condition_embedder.text_embedder.linear_2": "rowwise",
}


def user_plan(family: str, folder: str, via: str) -> dict:
    cls = model_class(family)
    plan = {"flux2": FLUX2_FFN_PLAN, "wan": WAN_PLAN}[family]
    reference = plain_model(cls, folder)
    config = _tp(dist.get_world_size())
    if via == "from_pretrained":
        model = paradiff.from_pretrained(cls, folder, parallel_config=config, plan=dict(plan))
    else:
        model = plain_model(cls, folder)
        paradiff.enable_parallelism(model, config, plan=dict(plan))
    inputs = make_inputs(family, reference.config, batch=2, lengths=Lengths(height=3, width=4, text=6))
    expected = run_forward(reference, inputs)
    actual = run_forward(model, inputs)
    state = get_state(model)
    sharded = sorted(name for name, module in model.named_modules() if isinstance(module, ShardedLinear))
    return {
        "diff": float((actual - expected).abs().max()),
        "shape_ok": actual.shape == expected.shape,
        "sharded": sharded,
        "planned": sorted(state.tp_plan.linears),
        "local_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
        "full_bytes": sum(t.numel() * t.element_size() for t in reference.state_dict().values()),
    }
