"""Functions run on every rank of a pool by tests/test_cost_model.py (gloo, CPU)."""

from __future__ import annotations

import torch.distributed as dist

from paradiff.plan_tools.calibrate import calibrate_rank


def calibrate_tiny() -> dict:
    """Calibration's measurements at tiny sizes (the collectives through distributed/comm.py)."""
    return calibrate_rank(dist.get_rank(), dist.get_world_size(), device="cpu", dtypes=("float32",), gemm_size=32,
                          attention_tokens=32, sizes=(64, 4096), repeats=2, copy_numel=4096,
                          elementwise_numel=4096, burst=2)
