"""Functions run on every rank of a pool by tests/test_vae.py (gloo, CPU)."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

import paradiff
from paradiff.distributed.comm import CommStats
from paradiff_testkit.memory import PeakTensorMemory
from paradiff_testkit.vaes import build_vae, run_vae, sample_input
from paradiff.vae import get_vae_runtime
from paradiff.vae.runtime import VAE_ATTR


def split_vae_outputs(cases: list[dict], output_rank: int | None = None) -> dict:
    """Each case {name, kind, height, width, frames}: this rank's output of the split VAE, the rows it held and
    the collectives it issued."""
    torch.set_num_threads(1)
    vaes, results = {}, {}
    for case in cases:
        name, kind = case["name"], case["kind"]
        if name not in vaes:
            vaes[name] = paradiff.parallelize_vae(build_vae(name), output_rank=output_rank)
        runtime = get_vae_runtime(vaes[name])
        runtime.stats = CommStats()
        runtime.last_split.clear()
        sample = sample_input(name, vaes[name], kind, case["height"], case["width"], case.get("frames", 1))
        output = run_vae(vaes[name], kind, sample)
        results[case_id(case)] = {"output": output, "rows": runtime.last_split.get("decoder" if kind == "decode"
                                                                                  else "encoder"),
                                  "calls": dict(runtime.stats.calls)}
    return {"rank": dist.get_rank(), "results": results}


def case_id(case: dict) -> str:
    return f"{case['name']}-{case['kind']}-{case['height']}x{case['width']}x{case.get('frames', 1)}"


def decode_peak_memory(cases: list[dict]) -> dict:
    """Per case {name, height, width, frames}: peak bytes of the tensors one split decode creates on this rank (its
    gathered output included)."""
    torch.set_num_threads(1)
    peaks = {}
    for case in cases:
        vae = paradiff.parallelize_vae(build_vae(case["name"]))
        sample = sample_input(case["name"], vae, "decode", case["height"], case["width"], case["frames"])
        run_vae(vae, "decode", sample)  # the first call also learns the halo plans
        gc.collect()
        with PeakTensorMemory() as memory:
            run_vae(vae, "decode", sample)
        peaks[case["name"]] = memory.peak
    return {"rank": dist.get_rank(), "peaks": peaks}


def frame_pieces_outputs(name: str, height: int, width: int, frames: int, pieces: int) -> dict:
    """CogVideoX's frame-piece convolutions forced to `pieces` pieces wherever each piece keeps at least 3 frames
    (its causal kernel's, as the 2 GiB rule does for real inputs): the output, how many calls were cut, and the input
    heights the piece count was asked for (every rank must ask for the whole input's, never its own band's)."""
    import dataclasses

    from paradiff.plans.vae import COGVIDEOX
    from paradiff.vae import split_vae
    from paradiff.vae.plan import FramePieces

    torch.set_num_threads(1)
    asked = []

    def count(conv, shape):
        asked.append((shape[-2], pieces if shape[2] >= 3 * pieces else 1))
        return asked[-1][1]

    plan = dataclasses.replace(COGVIDEOX, frame_pieces={"CogVideoXSafeConv3d": FramePieces(
        count=count, overlap=COGVIDEOX.frame_pieces["CogVideoXSafeConv3d"].overlap)})
    vae = split_vae(build_vae(name), plan)
    output = run_vae(vae, "decode", sample_input(name, vae, "decode", height, width, frames))
    return {"rank": dist.get_rank(), "output": output, "asked_heights": sorted({height for height, _ in asked}),
            "cut": sum(1 for _, count in asked if count > 1), "rows": get_vae_runtime(vae).last_split["decoder"]}


def replica_outputs(data: int) -> dict:
    """Data parallelism: each replica of a (data x tp) mesh decodes its own latent over its own ranks."""
    from paradiff.distributed.mesh import build_mesh

    torch.set_num_threads(1)
    mesh = build_mesh(paradiff.ParallelConfig(
        data_degree=data, tensor_parallel_config=paradiff.TensorParallelConfig(dist.get_world_size() // data)))
    vae = paradiff.parallelize_vae(build_vae("kl"), mesh)
    replica = mesh.local_rank("data")
    sample = sample_input("kl", vae, "decode", 5, 6, seed=10 + replica)
    runtime = get_vae_runtime(vae)
    runtime.stats = CommStats()
    output = run_vae(vae, "decode", sample)
    return {"rank": dist.get_rank(), "replica": replica, "output": output,
            "group_size": dist.get_world_size(runtime.group), "rows": runtime.last_split["decoder"]}


def vae_errors(index_folder: str) -> dict:
    """Bad uses on a live world; each returns the error message (raised on every rank, before a collective where
    the checks allow)."""
    from diffusers import AutoencoderTiny
    from diffusers.models.attention_processor import AttnProcessor

    torch.set_num_threads(1)
    rank = dist.get_rank()
    messages = {}

    def attempt(label, call):
        try:
            call()
            messages[label] = "no error"
        except Exception as exc:  # noqa: BLE001
            messages[label] = f"{type(exc).__name__}: {exc}"

    def classic_processor():
        vae = build_vae("kl")
        vae.set_attn_processor(AttnProcessor())
        paradiff.parallelize_vae(vae)

    def twice():
        paradiff.parallelize_vae(paradiff.parallelize_vae(build_vae("kl")))

    def mismatched_shapes():
        vae = paradiff.parallelize_vae(build_vae("kl"))
        run_vae(vae, "decode", sample_input("kl", vae, "decode", 5 + rank, 6))

    def requires_grad():
        vae = paradiff.parallelize_vae(build_vae("kl"))
        vae.decode(sample_input("kl", vae, "decode", 5, 6).requires_grad_())

    attempt("unsupported", lambda: paradiff.parallelize_vae(AutoencoderTiny(
        encoder_block_out_channels=(8,), decoder_block_out_channels=(8,), num_encoder_blocks=(1,),
        num_decoder_blocks=(1,), latent_channels=4)))
    attempt("unchecked_block", lambda: paradiff.parallelize_vae(build_vae(
        "kl", config=dict(up_block_types=("UpDecoderBlock2D", "AttnUpDecoderBlock2D", "UpDecoderBlock2D")))))
    attempt("classic_processor", classic_processor)
    attempt("output_rank", lambda: paradiff.parallelize_vae(build_vae("kl"), output_rank=dist.get_world_size()))
    attempt("bad_group", lambda: paradiff.parallelize_vae(build_vae("kl"), "world"))
    attempt("twice", twice)
    def batch_norm_training():
        vae = paradiff.parallelize_vae(build_vae("dc"))
        vae.train()
        run_vae(vae, "decode", sample_input("dc", vae, "decode", 5, 6))

    attempt("mismatched_shapes", mismatched_shapes)
    attempt("requires_grad", requires_grad)
    attempt("batch_norm_training", batch_norm_training)
    attempt("pipeline_uncovered_vae", lambda: paradiff.load_pipeline(
        index_folder, parallel_config=paradiff.TensorParallelConfig(dist.get_world_size()), parallel_vae=True))
    return messages


def pipelines_with_and_without_split_vae(folders: dict[str, str]) -> dict:
    """Each tiny pipeline on a ulysses mesh of every rank, its VAE split (the default) and whole: same images.

    One load per family: the pipeline runs with the VAE `load_pipeline` split, then again with the split's patches
    undone (the whole VAE, as `parallel_vae=False` leaves it; that flag is run by test_cli's --no-parallel-vae).
    Loading every pipeline twice cost more than both calls."""
    import numpy as np

    from paradiff.runtime.patches import remove_patches_by
    from paradiff_testkit.pipelines import default_call_kwargs

    torch.set_num_threads(1)
    config = paradiff.ContextParallelConfig(ulysses_degree=dist.get_world_size())
    results = {}
    for family, folder in folders.items():
        images = {}
        pipeline = paradiff.load_pipeline(folder, parallel_config=config)
        pipeline.set_progress_bar_config(disable=True)
        runtime = get_vae_runtime(pipeline.vae)
        for split in (True, False):
            if not split:
                for module in pipeline.vae.modules():
                    remove_patches_by(module, "vae")
                object.__delattr__(pipeline.vae, VAE_ATTR)
                assert get_vae_runtime(pipeline.vae) is None
            output = pipeline(**default_call_kwargs(family), seed=3)
            images[split] = np.asarray(output.frames if hasattr(output, "frames") else output.images)
            if split:
                rows = None if runtime is None else runtime.last_split.get("decoder")
        results[family] = {"diff": float(np.abs(images[True] - images[False]).max()), "rows": rows,
                           "shape": images[True].shape}
    return results
