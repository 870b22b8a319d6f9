"""The typed LoadSpec `generate` and `serve` both load (api/load_spec.py): checked when built, and built from the
command's flags in one place (cli/worker.py: load_spec_of). In process: nothing is loaded."""

from __future__ import annotations

import dataclasses

import pytest

from paradiff import ParallelConfig
from paradiff.api.load_spec import LoadSpec, LoraSpec
from paradiff.errors import LoadSpecError


@pytest.mark.parametrize("fields, field, named", [
    ({"model": ""}, "model", "''"),
    ({"dtype": "int4"}, "dtype", "'int4'"),
    ({"parallel": {"tp": 2}}, "parallel", "{'tp': 2}"),
    ({"plan": "no/such/plan.py"}, "plan", "no/such/plan.py"),
    ({"quantize": "int3"}, "quantize", "int3"),
    ({"quantize_skip": ("context_embedder",)}, "quantize_skip", "context_embedder"),
    ({"gguf": (("transformer", "model.safetensors"),)}, "gguf", "transformer=model.safetensors"),
    ({"gguf": (("transformer", "a.gguf"),), "quantize": "int8"}, "quantize", "int8"),
    ({"loras": (LoraSpec("a.safetensors"), LoraSpec("b.safetensors"))}, "loras", "lora0"),
    ({"lora_weight_name": "style.safetensors"}, "lora_weight_name", "style.safetensors"),
    ({"compile_backend": "eager"}, "compile_backend", "eager"),
    ({"cache": "fbc:-1"}, "cache", "fbc:-1"),
    ({"parallel": ParallelConfig.from_degrees(fsdp=2), "stages": True}, "parallel", "stages"),
])
def test_a_bad_value_is_refused_when_the_spec_is_built_naming_it(fields, field, named):
    with pytest.raises(LoadSpecError) as caught:
        LoadSpec(**{"model": "some/model", **fields})
    assert caught.value.field == field
    assert named in str(caught.value)


def test_the_command_builds_its_spec_from_its_flags_and_the_server_loads_one_replica(tmp_path):
    from paradiff.cli.args import build_parser
    from paradiff.cli.common import CliError
    from paradiff.cli.worker import load_spec_of

    plan = tmp_path / "plan.py"
    plan.write_text("PLAN = {}\n")
    argv = ["serve", "org/model", "--tp", "2", "--dp", "3", "--dtype", "bfloat16", "--quantize", "int8",
            "--quantize-skip", "context_embedder, x_embedder", "--lora", "style.safetensors:0.5", "--lora",
            "org/lora", "--compile", "--plan", str(plan), "--no-parallel-vae", "--whole-text-encoders"]
    spec = load_spec_of(build_parser().parse_args(argv))
    assert spec == LoadSpec(
        "org/model", dtype="bfloat16", parallel=ParallelConfig.from_degrees(tp=2, data=3),
        plan=str(plan), parallel_vae=False, shard_text_encoders=False,
        quantize="int8", quantize_skip=("context_embedder", "x_embedder"),
        loras=(LoraSpec("style.safetensors", 0.5, "lora0"), LoraSpec("org/lora", 1.0, "lora1")), compile=True)
    replica = spec.one_replica()
    assert replica.parallel.data_degree == 1 and replica.parallel.tp_degree == 2
    assert dataclasses.replace(replica, parallel=spec.parallel) == spec
    with pytest.raises(CliError, match=r"^--compile-backend eager: nothing is compiled"):
        load_spec_of(build_parser().parse_args(["generate", "--compile-backend", "eager"]))
