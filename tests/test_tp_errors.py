"""Every bad input to from_pretrained / enable_parallelism fails with a clear error, on every rank alike, before any
weight is read or any collective is issued, and no rank is left hanging.

Cases where torch.distributed matters run on the shared gloo pools (tests/rank_cases_errors.py); argument checks
that come before it run here in one process. Both use the same `watch()`: inside it every weight read and every
collective is recorded and refused, so an empty record proves the error came first.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist

import paradiff
import rank_cases_errors as cases
from paradiff.testing.models import UnplannedTransformer, build_model, model_class, save_model

CASE_TIMEOUT_S = 60  # a hang fails the test in a minute instead of stalling the suite

# scenario -> (world size, exception type, fragments the message must contain: the bad value and what is valid)
EXPECTED: dict[str, tuple[int, str, list[str]]] = {
    # degrees against the world
    "fp_tp_larger_than_world": (4, "ParallelConfigError", ["tp_degree=8", "world size is 4", "--nproc-per-node 8"]),
    "fp_tp_not_dividing_world": (
        4, "ParallelConfigError", ["tp_degree=3", "must divide the world size 4", "[1, 2, 4]"],
    ),
    "fp_parallel_config_product": (4, "ParallelConfigError", ["multiply to 3", "tp=3", "world size is 4"]),
    "fp_tp_beyond_heads": (
        4, "PlanError", ["tp_degree=4", "num_attention_heads=3", "valid tp degrees: 1 to 3"],
    ),
    "fp_device_unavailable": (
        2, "ParallelConfigError",
        ["'cuda:99'", "valid indices" if torch.cuda.is_available() else "device='cpu'", "omit device"],
    ),
    # the checkpoint
    "fp_bin_only": (
        2, "CheckpointError", ["['diffusion_pytorch_model.bin']", "only safetensors", "safe_serialization=True"],
    ),
    "fp_config_disagrees_with_weights": (
        2, "PlanError", ["'transformer_blocks.1.attn.to_q.weight'", "not in the checkpoint"],
    ),
    # the plan
    "fp_no_builtin_plan": (
        2, "PlanError",
        ["UnplannedTransformer", "Flux2Transformer2DModel", "Pass plan={...}", "'colwise'", "'rowwise'",
         "PackedColwise(blocks)", "plan='auto'", "Writing a plan"],
    ),
    "fp_plan_not_a_dict": (2, "PlanError", ["got list", "dict of module glob -> style", "TensorParallelPlan"]),
    "fp_plan_missing_module": (
        2, "PlanError", ["'transformer_blocks.0.attn.to_qq'", "'transformer_blocks.0.attn' has children", "'to_q'"],
    ),
    "fp_plan_missing_top_module": (
        2, "PlanError", ["'context_embedderr'", "Flux2Transformer2DModel has children", "'context_embedder'"],
    ),
    "fp_plan_unknown_style": (
        2, "PlanError", ["'colwize'", "'transformer_blocks.*.attn.to_q'", "'colwise'", "'rowwise_split_input'"],
    ),
    "fp_plan_two_stars": (
        2, "PlanError", ["'transformer_blocks.*.attn.*'", "'transformer_blocks.0.attn'", "must be an nn.ModuleList",
                         "Flux2Attention"],
    ),
    "fp_plan_partial_star": (
        2, "PlanError", ["'transformer_blocks.0.attn.to_*'", "whole path component", "'blocks.*.attn.to_q'"],
    ),
    "fp_plan_star_glued_to_name": (
        2, "PlanError", ["'transformer_blocks*.attn.to_q'", "whole path component", "'blocks.*.attn.to_q'"],
    ),
    "fp_plan_star_not_over_module_list": (
        2, "PlanError",
        ["'norm_out'", "must be an nn.ModuleList", "AdaLayerNormContinuous", "'transformer_blocks'",
         "'single_transformer_blocks'"],
    ),
    "fp_plan_star_over_missing_list": (
        2, "PlanError", ["'blocks'", "not a submodule", "'transformer_blocks'", "'single_transformer_blocks'"],
    ),
    "fp_plan_not_a_linear": (
        2, "PlanError", ["'transformer_blocks.0.attn'", "must be an nn.Linear", "Flux2Attention", "'to_q'"],
    ),
    "fp_plan_module_matched_twice": (
        2, "PlanError",
        ["'transformer_blocks.0.attn.to_q'", "'transformer_blocks.*.attn.to_q'", "two plan keys", "one style"],
    ),
    "fp_packed_proportions_not_dividing": (
        2, "PlanError", ["transformer_blocks.0.attn.to_q", "[1, 1, 1]", "divide the packed dim 64"],
    ),
    "fp_packed_block_smaller_than_tp": (
        2, "PlanError", ["transformer_blocks.0.attn.to_q.weight", "a block of size 1", "tp_degree=2", "at most 1"],
    ),
    "fp_packed_sizes_wrong_sum": (2, "PlanError", ["[32, 16]", "sum to 48", "size 64"]),
    "fp_packed_without_blocks": (2, "PlanError", ["PackedColwise", "blocks=[...]"]),
    # enable_parallelism: model states that cannot be split
    "en_not_a_module": (2, "UnsupportedModelError", ["needs an nn.Module", "got str"]),
    "en_quantized": (2, "UnsupportedModelError", ["Flux2Transformer2DModel is quantized", "is_quantized=True",
                                                  "without quantization_config", "bfloat16"]),
    "en_hf_quantizer": (2, "UnsupportedModelError", ["quantized by BitsAndBytesQuantizer", "unquantized"]),
    "en_accelerate_device_map": (
        2, "UnsupportedModelError", ["hf_device_map={'': 'cpu'}", "without device_map"],
    ),
    "en_accelerate_offload_hook": (
        2, "UnsupportedModelError", ["transformer_blocks.0.attn", "AlignDevicesHook", "remove_hook_from_module"],
    ),
    "en_diffusers_group_offload": (
        2, "UnsupportedModelError", ["single_transformer_blocks.0", "'group_offloading'", "remove_hook("],
    ),
    "en_lora_child": (
        2, "UnsupportedModelError",
        ["transformer_blocks.0.attn.to_q", "'lora_A'", "fuse_lora()", "unload_lora_weights"],
    ),
    "en_peft_config": (2, "UnsupportedModelError", ["model carries LoRA", "['default']", "fuse_lora()"]),
    "en_called_twice": (2, "UnsupportedModelError", ["already parallelised", "once per model"]),
    "en_no_builtin_plan": (2, "PlanError", ["UnplannedTransformer", "Pass plan={...}", "'colwise'"]),
    "en_plan_unknown_style": (2, "PlanError", ["'row'", "'transformer_blocks.*.ff.linear_out'", "'rowwise'"]),
    "en_tp_larger_than_world": (2, "ParallelConfigError", ["tp_degree=8", "world size is 2"]),
    "en_tp_not_dividing_world": (4, "ParallelConfigError", ["tp_degree=3", "world size 4", "[1, 2, 4]"]),
    "en_tp_beyond_heads": (4, "PlanError", ["tp_degree=4", "num_attention_heads=3", "valid tp degrees: 1 to 3"]),
}


def test_every_scenario_has_an_expectation():
    assert set(EXPECTED) == set(cases.SCENARIOS)


@pytest.fixture(scope="module")
def folders(checkpoints, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad-checkpoints")
    model = build_model("flux2")
    model.save_pretrained(root / "bin-only", safe_serialization=False)
    assert not list((root / "bin-only").glob("*.safetensors"))
    mismatch = root / "mismatch"
    shutil.copytree(checkpoints[("flux2", "single")], mismatch)
    config = json.loads((mismatch / "config.json").read_text())
    config["num_layers"] = 2  # the weights hold one double-stream block
    (mismatch / "config.json").write_text(json.dumps(config))
    return {
        "flux2": str(checkpoints[("flux2", "single")]),
        "wan": str(checkpoints[("wan", "single")]),
        "unplanned": str(save_model(UnplannedTransformer(), root / "unplanned")),
        "heads3": str(save_model(build_model("flux2", heads=3), root / "heads3")),
        "bin_only": str(root / "bin-only"),
        "mismatch": str(mismatch),
    }


def check_error(error: str, kind: str, fragments: list[str]) -> None:
    assert error.startswith(f"{kind}: "), error
    missing = [fragment for fragment in fragments if fragment not in error]
    assert not missing, f"{missing} not in: {error}"


@pytest.mark.parametrize("name", list(EXPECTED))
def test_bad_input_fails_first_on_every_rank(pools, folders, name):
    world, kind, fragments = EXPECTED[name]
    results = pools.get(world).run(cases.error_case, timeout_s=CASE_TIMEOUT_S, name=name, folders=folders)
    for result in results:
        assert result["calls"] == [], f"rank {result['rank']} read weights or communicated first: {result}"
        assert result["in_step"] == world, result  # the closing all-reduce met every rank: none is stuck
        check_error(result["error"], kind, fragments)
    assert len({result["error"] for result in results}) == 1, [r["error"] for r in results]


@pytest.mark.parametrize("family", ["flux2", "wan"])
@pytest.mark.parametrize("via", ["from_pretrained", "enable"])
def test_user_plan_matches_single_process(pools, checkpoints, family, via):
    """A hand-written plan= works, including for Wan, which has no built-in tensor-parallel plan."""
    plan = {"flux2": cases.FLUX2_FFN_PLAN, "wan": cases.WAN_PLAN}[family]
    results = pools.get(2).run(
        cases.user_plan, family=family, folder=str(checkpoints[(family, "single")]), via=via
    )
    for result in results:
        assert result["shape_ok"], result
        assert result["diff"] < 1e-5, result
        assert result["sharded"] == result["planned"], result
        assert len(result["planned"]) >= len(plan)  # every '*' key expanded over its list
        assert result["local_bytes"] < result["full_bytes"], result


def test_watch_catches_reads_and_collectives(checkpoints):
    """The spy itself: a read or a collective inside `watch()` is recorded and refused."""
    from paradiff.io.checkpoint import Checkpoint

    folder = checkpoints[("flux2", "single")]
    with Checkpoint(folder) as checkpoint:
        name = next(iter(checkpoint.tensors))
        error, calls = cases.describe(lambda: checkpoint.read(name))
    assert calls == ["Checkpoint.read"] and error.startswith("ForbiddenCall"), (error, calls)
    error, calls = cases.describe(lambda: dist.all_reduce(torch.ones(1)))
    assert calls == ["dist.all_reduce"], (error, calls)
    error, calls = cases.describe(lambda: model_class("flux2").from_pretrained(folder))
    # diffusers' own loader is caught too; it wraps the spy's exception, which is why the record is what is checked
    assert calls == ["safetensors.torch.load_file"], (error, calls)


# ---------------------------------------------------------------------------------------------------------------
# One process: argument checks that do not depend on torch.distributed.

FLUX2 = model_class("flux2")


def single_process_error(call) -> str:
    error, calls = cases.describe(call)
    assert calls == [], f"read weights or communicated before raising: {calls} ({error})"
    return error


@pytest.mark.parametrize(
    "kwargs,kind,fragments",
    [
        (dict(device_map="auto"), "ParallelConfigError", ["device_map='auto'", "Drop device_map"]),
        (dict(device_map={"": 0}), "ParallelConfigError", ["device_map={'': 0}", "Drop device_map"]),
        (dict(quantization_config={"load_in_8bit": True}), "ParallelConfigError",
         ["quantization_config=dict(...)", "not supported", "TorchAoConfig(Int8WeightOnlyConfig())",
          "BitsAndBytesConfig(load_in_4bit=True"]),
        (dict(low_cpu_mem_usage=False), "ParallelConfigError", ["low_cpu_mem_usage=False", "Remove the argument"]),
        (dict(use_safetensors=False), "CheckpointError", ["use_safetensors=False", "only safetensors"]),
        (dict(variant="fp16"), "CheckpointError", ["variant='fp16'", "without variants"]),
        (dict(use_flashpack=True), "ParallelConfigError", ["use_flashpack=True", "safetensors"]),
        (dict(revison="main"), "TypeError", ["['revison']", "'revision'"]),
        (dict(torch_dtype=torch.int8), "ParallelConfigError", ["torch.int8", "torch.bfloat16", "torch.float32"]),
        (dict(torch_dtype="float8"), "ParallelConfigError", ["'float8'", "torch.float16"]),
        (dict(device="gpu"), "ParallelConfigError", ["device='gpu'", "'cpu'", "'cuda:0'"]),
        (dict(device="meta"), "ParallelConfigError", ["device='meta'", "'cpu'"]),
    ],
    ids=["device_map-auto", "device_map-dict", "quantization_config", "low_cpu_mem_usage", "use_safetensors",
         "variant", "use_flashpack", "unknown-kwarg", "dtype-int8", "dtype-str", "device-gpu", "device-meta"],
)
def test_loading_argument_errors(checkpoints, kwargs, kind, fragments):
    folder = checkpoints[("flux2", "single")]
    error = single_process_error(
        lambda: paradiff.from_pretrained(FLUX2, folder, parallel_config=paradiff.TensorParallelConfig(2), **kwargs)
    )
    check_error(error, kind, fragments)


def test_distributed_not_initialised(checkpoints):
    assert not dist.is_initialized()
    folder = checkpoints[("flux2", "single")]
    expected = ["not initialised", "init_process_group", '"gloo" on CPU', "torchrun"]
    error = single_process_error(
        lambda: paradiff.from_pretrained(FLUX2, folder, parallel_config=paradiff.TensorParallelConfig(2))
    )
    check_error(error, "DistributedError", expected)
    model = build_model("flux2")
    error = single_process_error(lambda: paradiff.enable_parallelism(model, paradiff.TensorParallelConfig(2)))
    check_error(error, "DistributedError", expected)
    assert not dist.is_initialized()


def test_process_group_from_torchrun_environment(checkpoints, monkeypatch):
    """Started by torchrun (its RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) without init_process_group, as
    README's snippets are: paradiff initialises the group itself (gloo on CPU); with part of that environment, the
    error names what is missing instead of telling a torchrun user to use torchrun."""
    from paradiff.distributed.spawn import free_port

    folder = checkpoints[("flux2", "single")]
    monkeypatch.setenv("RANK", "0")
    error = single_process_error(
        lambda: paradiff.from_pretrained(FLUX2, folder, parallel_config=paradiff.TensorParallelConfig(1))
    )
    check_error(error, "DistributedError", ["not started by torchrun", "lacks WORLD_SIZE, MASTER_ADDR, MASTER_PORT"])
    for name, value in (("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(name, value)
    assert not dist.is_initialized()
    try:
        model = paradiff.from_pretrained(FLUX2, folder, parallel_config=paradiff.TensorParallelConfig(1))
        assert dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() == 1
        assert paradiff.runtime.state.get_state(model) is not None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_without_parallel_config_no_distributed_needed(checkpoints):
    """A plain load (no parallel_config) works in one process without init_process_group, like diffusers."""
    folder = checkpoints[("flux2", "single")]
    model = paradiff.from_pretrained(FLUX2, folder, device="cpu")
    reference = cases.plain_model(FLUX2, str(folder))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in reference.state_dict().items())


@pytest.mark.parametrize(
    "path,subfolder,fragments",
    [
        ("/no/such/folder/anywhere", None, ["'/no/such/folder/anywhere'", "neither a local folder", "'owner/name'"]),
        (None, "transformer", ["transformer", "is not a folder", "subfolder='transformer'"]),
    ],
    ids=["missing-path", "missing-subfolder"],
)
def test_missing_folder(checkpoints, path, subfolder, fragments):
    path = path or str(checkpoints[("flux2", "single")])
    error = single_process_error(lambda: paradiff.from_pretrained(FLUX2, path, subfolder=subfolder))
    check_error(error, "CheckpointError", fragments)


def test_bin_only_single_process(folders):
    error = single_process_error(lambda: paradiff.from_pretrained(FLUX2, folders["bin_only"]))
    check_error(error, "CheckpointError", ["['diffusion_pytorch_model.bin']", "safe_serialization=True"])


@pytest.mark.parametrize(
    "build,kind,fragments",
    [
        (lambda: paradiff.TensorParallelConfig(tp_degree=0), "ParallelConfigError", ["tp_degree", ">= 1", "got 0"]),
        (lambda: paradiff.TensorParallelConfig(tp_degree="2"), "ParallelConfigError", ["int >= 1", "'2'", "str"]),
        (lambda: paradiff.TensorParallelConfig(tp_degree=True), "ParallelConfigError", ["True", "bool"]),
        (lambda: paradiff.ContextParallelConfig(), "ParallelConfigError", ["ring_degree=1, ulysses_degree=1"]),
        (lambda: paradiff.ParallelConfig(cfg_degree=0), "ParallelConfigError", ["cfg_degree", ">= 1", "got 0"]),
        (lambda: paradiff.ParallelConfig(tensor_parallel_config=2), "ParallelConfigError",
         ["TensorParallelConfig", "got int"]),
        (lambda: paradiff.config.as_parallel_config({"tp_degree": 2}, 2), "ParallelConfigError",
         ["TensorParallelConfig, ContextParallelConfig or ParallelConfig", "got dict"]),
    ],
    ids=["tp0", "tp-str", "tp-bool", "cp-1x1", "cfg0", "tp-config-int", "config-dict"],
)
def test_config_errors(build, kind, fragments):
    check_error(single_process_error(build), kind, fragments)
