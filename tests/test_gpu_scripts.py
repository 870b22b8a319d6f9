"""The GPU speed script (`tools/gpu_bench.py`, issue 42) stays ready to run as is: its `--dry-run` runs every model
and variant end to end on CPU at tiny sizes (the GPU run itself never runs in CI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_bench_dry_run_measures_every_model_and_variant(tmp_path):
    # --budget-s guards a GPU's minutes: here it must not stop variants early on a loaded machine
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_bench.py"), "--dry-run", "--budget-s", "3600",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    (written,) = tmp_path.glob("gpu_bench-dry-run-*.json")
    result = json.loads(written.read_text())
    assert result["dry_run"] is True and result["gemm_bf16_flops"] > 0
    assert [model["model"] for model in result["models"]] == ["flux.1-dev", "qwen-image", "wan2.1-i2v-14b"]
    for model in result["models"]:
        assert model.get("error") is None, model
        variants = model["variants"]
        for name in ("diffusers", "paradiff world 1", "paradiff compile"):
            assert variants[name]["forward_s"] > 0 and variants[name]["steps_50_s"] > 0, (model["model"], name)
        # FP8 GEMMs need a CUDA device: skipped on CPU, saying why
        assert "CUDA" in variants["paradiff fp8 compile"]["skipped"]
