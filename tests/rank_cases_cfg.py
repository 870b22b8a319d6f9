"""Functions run on every rank of a pool by tests/test_cfg.py (gloo, CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import paradiff
from paradiff.runtime.cfg import install_cfg_parallel
from paradiff.testing.models import Lengths, build_model, make_inputs, run_forward


def cfg_pairs(family: str = "flux2", steps: int = 3, meta: bool = True, compiled: bool = False) -> dict:
    """Conditional / unconditional calls per step as a pipeline makes them, through the CFG splitter on 2 ranks;
    `meta=False` takes the meta-device run away, as for a model whose forward cannot run on meta tensors."""
    reference = build_model(family)
    model = build_model(family)
    if compiled:
        paradiff.compile(model, backend="aot_eager")
    splitter = install_cfg_parallel(model, dist.new_group([0, 1]))
    if not meta and splitter.structure is not None:
        def no_meta_model():
            raise NotImplementedError("this forward cannot run on meta tensors")

        splitter.structure._build = no_meta_model
    cond = make_inputs(family, model.config, batch=2, lengths=Lengths(3, 5, 7), seed=1)
    uncond = dict(cond, encoder_hidden_states=make_inputs(family, model.config, batch=2,
                                                          lengths=Lengths(3, 5, 7), seed=2)["encoder_hidden_states"])
    diffs = []
    for _ in range(steps):
        first = run_forward(model, cond)  # cfg rank 1: a placeholder, filled when the second call returns
        second = run_forward(model, uncond)
        diffs.append(max(float((first - run_forward(reference, cond)).abs().max()),
                         float((second - run_forward(reference, uncond)).abs().max())))
    return {"rank": dist.get_rank(), "computed": splitter.computed, "diff": max(diffs)}
