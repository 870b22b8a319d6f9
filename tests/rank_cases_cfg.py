"""Functions run on every rank of a pool by tests/test_cfg.py (gloo, CPU)."""

from __future__ import annotations

import numpy as np
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


def pipeline_cfg(family: str, folder: str, degrees: dict, expected: dict, steps: int = 3,
                 pipeline_class: str | None = None, call: dict | None = None) -> dict:
    """A whole pipeline at cfg2 (x tp2 on 4 ranks) against diffusers' single-process call, same seed (`expected`:
    paradiff_testkit.pipelines.References.run's pixels and first-block inputs, made once in the test process); with
    what the first transformer block of this rank computed on (its batch, and its input against the reference's)."""
    from paradiff_testkit.pipelines import default_call_kwargs

    torch.set_num_threads(1)
    import diffusers

    kwargs = dict(default_call_kwargs(family), num_inference_steps=steps, **(call or {}))
    pipeline = paradiff.load_pipeline(folder, parallel_config=paradiff.ParallelConfig.from_degrees(**degrees),
                                      pipeline_cls=getattr(diffusers, pipeline_class) if pipeline_class else None)
    pipeline.set_progress_bar_config(disable=True)
    seen: dict[str, list[torch.Tensor]] = {"reference": list(expected["block_inputs"]), "parallel": []}
    blocks = next(getattr(pipeline.transformer, name) for name in ("transformer_blocks", "joint_transformer_blocks",
                                                                   "layers") if hasattr(pipeline.transformer, name))
    blocks[0].register_forward_pre_hook(
        lambda _module, args, kw: seen["parallel"].append(
            (args[0] if args else kw["hidden_states"]).detach().clone()), with_kwargs=True)
    reference = expected["pixels"]
    actual = _pixels(pipeline(**kwargs, seed=0))
    cfg_rank = pipeline._paradiff_pipeline.cfgs[0].cfg_rank
    block_diffs = []
    for whole, mine in zip(seen["reference"], seen["parallel"]):
        if whole.shape[0] == 2 * mine.shape[0]:  # batch style: this cfg rank's half of the batch
            share = mine.shape[0]
            half = whole[cfg_rank * share:(cfg_rank + 1) * share]
            block_diffs.append(float((mine - half).abs().max() / half.abs().max().clamp_min(1.0)))
    splitter = pipeline._paradiff_pipeline.cfgs[0]
    return {"rank": dist.get_rank(), "cfg_rank": cfg_rank, "style": type(splitter).__name__,
            "diff": float(np.abs(actual - reference).max()), "scale": float(np.abs(reference).max()),
            "reference_batches": [t.shape[0] for t in seen["reference"]],
            "batches": [t.shape[0] for t in seen["parallel"]], "computed": splitter.computed,
            "block_diff": max(block_diffs, default=None)}


def call_refusal(family: str, folder: str, degrees: dict, call: dict) -> str:
    """A call the pipeline's CFG rule refuses: the error, raised before the transformer runs."""
    from paradiff_testkit.pipelines import default_call_kwargs

    pipeline = paradiff.load_pipeline(folder, parallel_config=paradiff.ParallelConfig.from_degrees(**degrees))
    calls = []
    pipeline.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        pipeline(**default_call_kwargs(family), **call)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}" + (" (after a transformer call)" if calls else "")
    return "no error"


def load_refusal(folder: str, degrees: dict) -> str:
    try:
        paradiff.load_pipeline(folder, parallel_config=paradiff.ParallelConfig.from_degrees(**degrees))
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _pixels(output) -> np.ndarray:
    return np.asarray(output.frames if hasattr(output, "frames") else output.images)


def cfg_pair_of_different_shapes() -> dict:
    """Two calls whose outputs differ in length (an output carrying the prompt's tokens, Qwen-Image 2.1's): each cfg
    rank computes one, and both get both predictions whole."""
    from torch import nn

    class Echo(nn.Module):
        def forward(self, hidden_states):
            return (hidden_states * 2 + 1,)

    model = Echo()
    splitter = install_cfg_parallel(model, dist.new_group([0, 1]))
    cond = torch.arange(14, dtype=torch.float32).view(1, 7, 2)  # 7 tokens (a prompt of 3 + 4 image tokens)
    uncond = torch.arange(10, dtype=torch.float32).view(1, 5, 2) + 100  # 5 tokens (a prompt of 1)
    first = model(hidden_states=cond)[0]
    second = model(hidden_states=uncond)[0]
    return {"first": torch.equal(first, cond * 2 + 1), "second": torch.equal(second, uncond * 2 + 1),
            "computed": splitter.computed}
