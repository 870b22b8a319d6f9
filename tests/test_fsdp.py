"""FSDP2 weight sharding (docs/fsdp.md): exact against one process, 1/N of the block weights per rank, sharded on
read, and the combinations it cannot hold refused by name before any read."""

from __future__ import annotations

import pytest
import torch

import rank_cases_fsdp as cases
from paradiff.api.fsdp import check_fsdp
from paradiff.fsdp.refusals import fsdp_refusal
from paradiff.config import ParallelConfig
from paradiff.errors import ParallelConfigError, UnsupportedModelError
from paradiff.testing.models import build_model
from test_gguf import gguf_files  # noqa: F401 - the GGUF file of mixed ggml types, for quantized FSDP

RTOL = 1e-5
BF16_RTOL = 2e-2  # bfloat16 on both sides: the parallel run reduces in another order


@pytest.fixture(scope="module")
def fsdp_loras(tmp_path_factory) -> dict[str, str]:
    """family -> a LoRA on every target of the family's test model (rank 4, alpha 8, diffusers' format)."""
    from paradiff_testkit.lora import TARGETS, random_lora, save_lora

    root = tmp_path_factory.mktemp("fsdp-loras")
    return {family: str(save_lora(root / f"{family}.safetensors",
                                  random_lora(build_model(family), TARGETS[family], 4, seed=1), rank=4, alpha=8))
            for family in ("flux2", "wan")}


def test_fsdp_is_exact_holds_its_share_and_reads_only_its_rows(pools, checkpoints, fsdp_loras):
    """... and runs a LoRA exactly (flux2 at fsdp2, wan at fsdp2 x ulysses2: whole factors on every rank, against
    diffusers' LoRA on one process), refusing fuse_lora and diffusers' group offloading by name."""
    runs = [dict(family=family, folder=str(checkpoints[(family, "sharded")]), mode=mode,
                 lora=fsdp_loras[family] if (family, mode) in (("flux2", "fsdp2"), ("wan", "fsdp2xulysses2")) else None)
            for family in ("flux2", "wan") for mode in ("fsdp2", "fsdp2xulysses2")]
    runs.append(dict(family="flux2", folder=str(checkpoints[("flux2", "single")]), mode="fsdp2xulysses2",
                     dtype="bfloat16"))
    results = [r for rank in pools.get(2).run(cases.fsdp_models, runs=runs) for r in rank]
    for result in results:
        bf16 = result["run"].get("dtype") == "bfloat16"
        assert result["diff"] <= (BF16_RTOL if bf16 else RTOL), result
        assert result["repeat_diff"] == 0.0, result  # resharded after forward, gathered again: the same weights
        assert result["blocks"] >= 2, result
        assert result["model_group"] == 2, result  # fsdp2's ranks gather together, so they decide together too
        # its rows of every block weight (torch.chunk's: at most one row each over half), and while running at
        # most the block running plus the next one's gather buffer, prefetched (rows padded to the degree); the
        # first block's gather left to FSDP2 kept its buffer while the block ran: three blocks
        assert result["held_blocks"] <= result["full_blocks"] / 2 + 0.02 * result["full_blocks"], result
        assert result["gathered_peak"] <= result["largest_block"] + result["largest_gather_buffer"], result
        assert result["gathered_peak"] > 0, result
        assert result["outside_gathered"] == 0, result  # embeddings / modulation / final layers: not while blocks run
        assert result["gloo_gathers"] == 0, result  # gathered in place, not through gloo's staging buffer
        assert result["read"] == result["share"], result  # its rows of each weight, each read once
        if result["rank"] == 0:  # --dry-run's figure (rank 0's rows, the larger) is what the load holds
            assert result["predicted_weights"] == result["held"], result
        assert result["share"] < 0.6 * result["full"], result
        lora = result["lora"]
        if result["run"].get("lora"):
            assert all(diff <= RTOL for diff in lora["diffs"].values()), lora
            assert lora["layers"] > 0 and lora["whole"], lora  # FSDP computes whole outputs: whole factors
            assert "FSDP-sharded weights" in lora["refused"]["fuse"], lora
            assert "enable_group_offload on a model loaded with fsdp_degree=2" in lora["refused"]["group offload"]
            assert "fsdp_offload=True" in lora["refused"]["group offload"], lora


def test_fsdp_composes_with_tp_and_cfg(pools, checkpoints, tiny_pipeline_folders, fsdp_loras, tmp_path_factory):
    from paradiff_testkit.lora import save_pipeline_loras


    pool = pools.get(4)
    runs = [dict(family="flux2", folder=str(checkpoints[("flux2", "sharded")]), mode="fsdp2xtp2",
                 lora=fsdp_loras["flux2"])]
    for result in (r for rank in pool.run(cases.fsdp_models, runs=runs) for r in rank):
        assert result["diff"] <= RTOL, result
        assert all(diff <= RTOL for diff in result["lora"]["diffs"].values()), result["lora"]
        assert result["held_blocks"] <= result["full_blocks"] / 4 + 0.02 * result["full_blocks"], result
        assert result["read"] == result["share"], result
        if result["rank"] == 0:
            assert result["predicted_weights"] == result["held"], result
    folder = tiny_pipeline_folders["wan2.2-a14b"]
    lora = save_pipeline_loras("wan2.2-a14b", folder, tmp_path_factory.mktemp("fsdp-pipeline-lora"))["style"]
    results = pool.run(cases.fsdp_pipeline, family="wan2.2-a14b", folder=str(folder), mode="cfg2xfsdp2", lora=str(lora))
    assert [result["output_rank"] for result in results] == [True, False, False, False]  # one replica: one saver
    for result in results:
        assert result["diff"] <= 1e-5, result
        assert result["lora_diff"][0] <= 1e-5 < result["lora_diff"][1], result  # equal, and the LoRA did change it
        assert set(result["fsdp_blocks"]) == {"transformer", "transformer_2"}, result
        for held, whole in result["held"].values():
            assert held < 0.6 * whole, result
        assert set(result["encoders"]) == {"text_encoder"}, result  # UMT5: sharded by FSDP within each branch
        for held, whole in result["encoders"].values():
            assert held < 0.6 * whole, result


def _refusal(tp: int = 1, **kwargs) -> str:
    with pytest.raises((ParallelConfigError, UnsupportedModelError)) as error:
        check_fsdp(build_model("flux2"), ParallelConfig.from_degrees(fsdp=2, tp=tp), **kwargs)
    return str(error.value)


def test_fsdp_refuses_what_it_cannot_hold_by_name():
    from types import SimpleNamespace

    message = _refusal(quantization=SimpleNamespace(name="nf4"))
    assert "nf4 quantization" in message and "Params4bit" in message and "fsdp_degree=1" in message, message
    for scheme in ("int8", "fp8"):  # held as rows (fsdp/packed.py), but not rows of a TP slice
        check_fsdp(build_model("flux2"), ParallelConfig.from_degrees(fsdp=2), quantization=SimpleNamespace(name=scheme))
        message = _refusal(tp=2, quantization=SimpleNamespace(name=scheme))
        assert f"{scheme} quantization" in message and "tp_degree=2" in message, message
    assert "GGUF weights" in _refusal(tp=2, single_file=True)
    assert "pre-quantized checkpoint" in _refusal(saved=True)
    assert "staged execution" in _refusal(stages=True)
    offload = fsdp_refusal(2, 1, group_offload=True)
    assert "enable_group_offload" in offload and "--fsdp-offload" in offload and "fsdp_degree=1" in offload, offload
    with pytest.raises(UnsupportedModelError, match="no repeated blocks"):
        check_fsdp(torch.nn.Linear(2, 2), ParallelConfig.from_degrees(fsdp=2))


def test_dry_run_prints_the_mesh_memory_and_the_flag_that_makes_it_fit(capsys, tmp_path):
    from paradiff.cli import main

    assert main(["generate", "--dry-run", "--device-memory", "0.000001", "--out", str(tmp_path)]) == 0
    single = capsys.readouterr().out
    assert "weights held" in single and "activations" in single and "does not fit --device-memory" in single
    assert main(["generate", "--dry-run", "--fsdp", "2", "--out", str(tmp_path)]) == 0
    sharded = capsys.readouterr().out
    assert "per rank of 2 (fsdp=2" in sharded and "gathered (FSDP)" in sharded
    assert main(["generate", "--dry-run", "--fsdp", "2", "--fsdp-offload", "--out", str(tmp_path)]) == 0
    assert "CPU (offloaded)" in capsys.readouterr().out
    assert main(["generate", "--dry-run", "--fsdp-offload", "--out", str(tmp_path)]) != 0
    assert "--fsdp-offload without --fsdp" in capsys.readouterr().err


def test_dry_run_suggests_the_fsdp_degree_that_fits():
    from paradiff.plan_tools.memory import fsdp_to_fit, meta_model, per_rank_bytes
    from paradiff.testing.models import model_class, tiny_config

    model = meta_model(model_class("wan"), tiny_config("wan", layers=6, single_layers=6))
    single = per_rank_bytes(model, ParallelConfig(), torch.float32, image_tokens=64)
    four = per_rank_bytes(model, ParallelConfig.from_degrees(fsdp=4), torch.float32, image_tokens=64)
    assert four.weights < single.weights / 3 and four.gathered > 0
    assert fsdp_to_fit(model, ParallelConfig(), four.peak, dtype=torch.float32, image_tokens=64) == 4
    offloaded = per_rank_bytes(model, ParallelConfig.from_degrees(fsdp=4, fsdp_offload=True), torch.float32,
                               image_tokens=64)
    assert (offloaded.weights, offloaded.host, offloaded.gathered) == (0, four.weights, four.gathered)
    with pytest.raises(ParallelConfigError, match="fsdp_offload=True with fsdp_degree=1"):
        ParallelConfig.from_degrees(fsdp_offload=True)


def test_fsdp_shards_quantized_bases_without_dequantizing(pools, checkpoints, gguf_files):
    """int8 / fp8 (torchao, quantized on read) and GGUF's packed weights: each rank holds its rows of the quantized
    weights only, and the forward equals the single-process quantized model's (fp8 composed with ulysses)."""
    runs = [dict(family="flux2", folder=str(checkpoints[("flux2", "sharded")]), mode="fsdp2", scheme="int8"),
            dict(family="wan", folder=str(checkpoints[("wan", "sharded")]), mode="fsdp2xulysses2", scheme="fp8"),
            dict(family="flux2", file=gguf_files["mixed"], config=gguf_files["config"], mode="fsdp2", scheme="gguf")]
    for result in (r for rank in pools.get(2).run(cases.fsdp_quantized, runs=runs) for r in rank):
        assert result["diff"] <= RTOL, result
        assert result["repeat_diff"] == 0.0, result
        assert result["packed"] == result["quantized"] > 0, result
        assert result["plain"], result  # rows of the packed data and scales: nothing dequantized, no subclass
        summary = result["summary"]  # what a run reports (runtime/stages.py): its rows, counted as quantized
        assert (summary["quantized_linears"], summary["quantized_bytes"]) == (result["packed"], result["held"]), result
        assert result["held"] <= 0.5 * result["whole"] + 0.02 * result["whole"], result
        assert result["read"] < 0.6 * result["file"], result


def test_fsdp_covers_the_issue_families_and_offloads(pools, tiny_pipeline_folders):
    """Qwen-Image, HunyuanVideo and LTX-2 at fsdp2 and fsdp2 x ulysses2 (FLUX.2 and Wan above), Z-Image,
    HunyuanVideo I2V and DiT at fsdp2; Wan 2.2 A14B's two
    experts at fsdp2 x ulysses2 with the shards offloaded to the CPU (FSDP2's CPUOffloadPolicy: on a CPU nearly a
    no-op, but its path runs)."""
    pool = pools.get(2)
    runs = [dict(family=family, example=example, modes=["fsdp2", "fsdp2xulysses2"])
            for family, example in (("qwenimage", "qwen-image"), ("hunyuan_video", "hunyuan-video-t2v"),
                                    ("ltx2", "ltx-2"))]
    # modules outside the blocks held in containers without a forward (Z-Image's ModuleDict of embedders,
    # HunyuanVideo I2V's ModuleList): their children are the units, not the container
    runs += [dict(family=family, example=example, modes=["fsdp2"])
             for family, example in (("z_image", "z-image"), ("hunyuan_video", "hunyuan-video-i2v"),
                                     # a block's submodule called after the blocks (FSDP_OWN_UNITS)
                                     ("dit", "dit"))]
    results = [r for rank in pool.run(cases.fsdp_families, runs=runs) for r in rank]
    assert {(r["family"], r["mode"]) for r in results} == {(run["family"], mode) for run in runs
                                                           for mode in run["modes"]}
    for result in results:
        assert result["diff"] <= RTOL, result
        assert result["blocks"] >= 2, result
        assert result["held"] < 0.6 * result["whole"], result
    results = pool.run(cases.fsdp_pipeline, family="wan2.2-a14b", folder=str(tiny_pipeline_folders["wan2.2-a14b"]),
                       mode="fsdp2xulysses2", offload=True)
    assert [result["output_rank"] for result in results] == [True, False]  # FSDP over the Ulysses ranks: one saver
    for result in results:
        assert result["diff"] <= 1e-5, result
        assert result["offloaded"] == {"transformer": True, "transformer_2": True}, result
        assert "enable_group_offload on a model loaded with fsdp_degree=2" in result["group_offload"], result
        for held, whole in result["held"].values():
            assert held < 0.6 * whole, result


def test_gather_buffers_are_reused_once_fsdp_drops_them():
    """FSDP2's all-gather outputs on CPU come from a pool (fsdp/apply.py: _GatherBuffers): a buffer FSDP2 still holds
    (a gather in flight) is never handed out again, one it dropped is (no fresh block-sized memory to fault in at each
    gather of each step), free buffers beyond the one taken are let go, the pool never holds more than `most`, and it
    lets go of them all after the forward."""
    from paradiff.fsdp.apply import _GatherBuffers

    pool, cpu = _GatherBuffers(), torch.device("cpu")
    first = pool.take((64,), torch.float32, cpu)
    first_ptr = first.data_ptr()
    input_view = first.narrow(0, 0, 32)  # FSDP2's all-gather input: this rank's slot of the output
    second = pool.take((48,), torch.float32, cpu)  # the prefetched next unit, while the first is in flight
    assert second.data_ptr() != first_ptr and second.shape == (48,)
    del first
    assert pool.take((64,), torch.float32, cpu).data_ptr() != first_ptr  # its input view still holds it
    del input_view
    again = pool.take((16,), torch.bfloat16, cpu)  # any dtype: the buffers are bytes
    assert again.data_ptr() == first_ptr and again.dtype == torch.bfloat16 and again.shape == (16,)
    del again, second
    assert pool.held_bytes == 64 * 4 + 48 * 4  # the other free 64-float buffer was let go: no idle block held
    bigger = pool.take((100,), torch.float32, cpu)  # no free buffer fits: the free ones go, a new one comes
    assert pool.held_bytes == 100 * 4 and bigger.shape == (100,)
    held = [pool.take((100,), torch.float32, cpu) for _ in range(4)]  # more in flight than `most`: plain memory
    assert pool.held_bytes == _GatherBuffers.most * 100 * 4 and len({t.data_ptr() for t in held + [bigger]}) == 5
    pool.release()  # after the model's forward: nothing held between steps but what is still in use
    assert pool.held_bytes == 0 and float(held[0].fill_(1.0).sum()) == 100.0  # a buffer in use lives on
