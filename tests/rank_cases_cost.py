"""Functions run on every rank of a pool by tests/test_cost_model.py (gloo, CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from paradiff.plan_tools.calibrate import calibrate_rank


def calibrate_tiny() -> dict:
    """Calibration's measurements at tiny sizes (the collectives through distributed/comm.py)."""
    return calibrate_rank(dist.get_rank(), dist.get_world_size(), device="cpu", dtypes=("float32",), gemm_size=32,
                          attention_tokens=32, sizes=(64, 4096), repeats=2, copy_numel=4096,
                          elementwise_numel=4096, burst=2, gap_gemm=32, fsdp_widths=(32, 256))


def tp_all_reduce_bytes(family: str) -> list[int]:
    """The bytes of every all-reduce one forward of the family's tiny model makes at tp2, in call order."""
    import paradiff
    from paradiff.testing.models import Lengths, build_model, make_inputs

    model = build_model(family)
    paradiff.enable_parallelism(model, paradiff.ParallelConfig.from_degrees(tp=dist.get_world_size()))
    inputs = make_inputs(family, model.config, lengths=Lengths(height=4, width=6, text=5))
    sizes = []
    issue = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        sizes.append(tensor.numel() * tensor.element_size())
        return issue(tensor, *args, **kwargs)
    dist.all_reduce = recording
    try:
        with torch.no_grad():
            model(**inputs, return_dict=False)
    finally:
        dist.all_reduce = issue
    return sizes
