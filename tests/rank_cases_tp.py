"""Functions run on every rank of a pool by tests/test_tensor_parallel.py (gloo, CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import paradiff
from paradiff.runtime.state import get_state
from paradiff.tensor_parallel.layers import ShardedLinear
from paradiff.tensor_parallel.shard import slice_tensor
from paradiff.testing.models import Lengths, make_inputs, model_class, run_forward


def _check_local_slices(model, reference) -> dict:
    """Every parameter equals its slice of the full weights; returns bytes held vs. the full model."""
    state = get_state(model)
    full = reference.state_dict()
    local = model.state_dict()
    assert set(full) == set(local), set(full) ^ set(local)
    sharded = 0
    for name, tensor in local.items():
        spec = state.tp_plan.spec_for(name)
        expected = slice_tensor(full[name].to(tensor.dtype), spec)
        assert tensor.shape == expected.shape, (name, tensor.shape, expected.shape)
        assert torch.equal(tensor, expected), name
        sharded += spec is not None
    assert sharded > 0
    assert any(isinstance(m, ShardedLinear) for m in model.modules())
    return {
        "local_bytes": sum(t.numel() * t.element_size() for t in local.values()),
        "full_bytes": sum(t.numel() * t.element_size() for t in full.values()),
        "sharded_tensors": sharded,
    }


def tp_equivalence(family: str, folder: str, tp: int, via: str, batches=(1, 2)) -> dict:
    cls = model_class(family)
    reference = cls.from_pretrained(folder).eval()
    config = paradiff.TensorParallelConfig(tp_degree=tp)
    if via == "from_pretrained":
        model = paradiff.from_pretrained(cls, folder, parallel_config=config)
    else:
        model = cls.from_pretrained(folder).eval()
        paradiff.enable_parallelism(model, config)
    diffs = {}
    for batch in batches:
        inputs = make_inputs(family, reference.config, batch=batch, lengths=Lengths(height=3, width=4, text=6))
        expected = run_forward(reference, inputs)
        actual = run_forward(model, inputs)
        assert actual.shape == expected.shape
        diffs[batch] = float((actual - expected).abs().max())
    report = _check_local_slices(model, reference)
    report["diffs"] = diffs
    report["rank"] = dist.get_rank()
    return report


def bf16_load(family: str, folder: str, tp: int) -> dict:
    cls = model_class(family)
    reference = cls.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
    model = paradiff.from_pretrained(cls, folder, torch_dtype=torch.bfloat16,
                                     parallel_config=paradiff.TensorParallelConfig(tp))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    report = _check_local_slices(model, reference)
    inputs = make_inputs(family, reference.config, batch=1)
    inputs = {k: (v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}
    expected = run_forward(reference, inputs).float()
    actual = run_forward(model, inputs).float()
    report["diff"] = float((actual - expected).abs().max())
    report["scale"] = float(expected.abs().max())
    return report


def save_round_trip(family: str, folder: str, out: str, tp: int, through: str = "paradiff") -> dict:
    """`through` "model": the model's own save_pretrained (diffusers' method, which on a TP model writes through
    paradiff.save_pretrained; an option that one does not take is refused on every rank before anything is
    gathered)."""
    cls = model_class(family)
    model = paradiff.from_pretrained(cls, folder, parallel_config=paradiff.TensorParallelConfig(tp))
    refused = None
    if through == "model":
        try:
            model.save_pretrained(out, variant="fp16")
        except Exception as exc:  # noqa: BLE001 - the message is the result
            refused = f"{type(exc).__name__}: {exc}"
        model.save_pretrained(out, max_shard_size=20_000)
    else:
        paradiff.save_pretrained(model, out, max_shard_size=20_000)
    original = cls.from_pretrained(folder).state_dict()
    reloaded = cls.from_pretrained(out).state_dict()  # plain diffusers, one process
    assert set(original) == set(reloaded)
    mismatched = [name for name in original if not torch.equal(original[name], reloaded[name])]
    assert not mismatched, mismatched
    return {"tensors": len(reloaded), "refused": refused}


def expect_error(kind: str, folder: str, family: str = "flux2", **kwargs) -> str:
    """Trigger one bad input; return the exception's type and message (the test checks them)."""
    cls = model_class(family)
    try:
        if kind == "from_pretrained":
            paradiff.from_pretrained(cls, folder, **kwargs)
        elif kind == "enable":
            model = cls.from_pretrained(folder)
            for attr, value in kwargs.pop("set_attrs", {}).items():
                object.__setattr__(model, attr, value)
            paradiff.enable_parallelism(model, **kwargs)
        else:
            raise AssertionError(kind)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"
