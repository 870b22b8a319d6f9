"""A pipeline's quantization request is never silently ignored: the transformer paradiff loads is quantized on
read; what paradiff cannot honour (another component it loads, stages=True, a scheme it cannot slice) is refused by
name, before any weight is read (issue: the transformer used to stay in full precision without a word)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import PipelineQuantizationConfig

import paradiff
from paradiff.api.quantization import requested_components
from paradiff.errors import ParallelConfigError
from paradiff.io.checkpoint import Checkpoint


def test_diffusers_rule_for_which_components_a_config_names():
    names = ["text_encoder", "transformer", "vae"]
    assert requested_components(SimpleNamespace(quant_mapping=None, components_to_quantize=None), names) == names
    assert requested_components(SimpleNamespace(quant_mapping=None, components_to_quantize="vae"), names) == ["vae"]
    assert requested_components(
        SimpleNamespace(quant_mapping=None, components_to_quantize=["transformer", "vae"]), names
    ) == ["transformer", "vae"]
    assert requested_components(
        SimpleNamespace(quant_mapping={"text_encoder": object()}, components_to_quantize=None), names
    ) == ["text_encoder"]


@pytest.fixture
def no_weight_read(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("a weight was read before the quantization request was checked")

    monkeypatch.setattr(Checkpoint, "read", refuse)


NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}


def _quantized_linears(model) -> int:
    return sum(hasattr(m.weight, "qdata") or getattr(m.weight, "quant_state", None) is not None
               for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_transformer_paradiff_loads_is_quantized_on_read(tiny_pipeline_folders):
    config = PipelineQuantizationConfig(quant_backend="bitsandbytes_4bit", quant_kwargs=NF4,
                                        components_to_quantize=["transformer"])
    pipe = paradiff.load_pipeline(tiny_pipeline_folders["flux2"], quantization_config=config)
    assert _quantized_linears(pipe.transformer) == sum(isinstance(m, torch.nn.Linear) for m in pipe.transformer.modules())
    assert _quantized_linears(pipe.transformer) > 10
    assert _quantized_linears(pipe.vae) == 0


def test_granular_torchao_request_equals_the_model_level_load(tiny_pipeline_folders):
    from diffusers import TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    folder = tiny_pipeline_folders["flux2"]
    config = PipelineQuantizationConfig(quant_mapping={"transformer": TorchAoConfig(Int8WeightOnlyConfig())})
    pipe = paradiff.load_pipeline(folder, quantization_config=config)
    alone = paradiff.from_pretrained(type(pipe.transformer), f"{folder}/transformer", device="cpu",
                                     quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    held = {n: m.weight for n, m in pipe.transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    assert held and all(torch.equal(w.qdata, alone.get_submodule(n).weight.qdata) for n, w in held.items())


def test_request_paradiff_cannot_honour_is_refused_by_name(tiny_pipeline_folders, no_weight_read):
    config = PipelineQuantizationConfig(quant_backend="bitsandbytes_4bit", quant_kwargs={"load_in_4bit": True},
                                        components_to_quantize=["transformer"])
    with pytest.raises(ParallelConfigError) as caught:
        paradiff.load_pipeline(tiny_pipeline_folders["flux2"], quantization_config=config)
    fragments = ["'transformer' (Flux2Transformer2DModel)", "bnb_4bit_quant_type='fp4'", "'nf4'"]
    assert all(fragment in str(caught.value) for fragment in fragments), str(caught.value)


def _transformers_int8(**kwargs):
    import transformers
    from torchao.quantization import Int8WeightOnlyConfig

    return transformers.TorchAoConfig(Int8WeightOnlyConfig(), **kwargs)


@pytest.mark.parametrize("make_encoder_config, fragments", [
    (lambda: __import__("transformers").BitsAndBytesConfig(load_in_8bit=True),
     ["'text_encoder' (Mistral3ForConditionalGeneration)", "load_in_8bit=True", "not supported"]),
    (lambda: _transformers_int8(include_input_output_embeddings=True),
     ["'text_encoder' (Mistral3ForConditionalGeneration)", "include_input_output_embeddings=True"]),
    (lambda: SimpleNamespace(), ["'text_encoder' (Mistral3ForConditionalGeneration)", "SimpleNamespace",
                                 "not supported"]),
], ids=["bnb-8bit", "torchao-embeddings", "unknown"])
def test_mapping_with_one_unsupported_scheme_is_refused_by_component(tiny_pipeline_folders, no_weight_read,
                                                                      make_encoder_config, fragments):
    """A mapping that combines a supported scheme (the transformer) with one paradiff cannot slice (the text
    encoder): one error naming the component, before any weight is read."""
    from diffusers import TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    config = object.__new__(PipelineQuantizationConfig)  # without diffusers' check of the mapping's classes
    config.quant_backend, config.components_to_quantize, config.config_mapping = None, None, {}
    config.quant_mapping = {"transformer": TorchAoConfig(Int8WeightOnlyConfig()), "text_encoder": make_encoder_config()}
    config.is_granular = True
    with pytest.raises(ParallelConfigError) as caught:
        paradiff.load_pipeline(tiny_pipeline_folders["flux2"], quantization_config=config)
    assert all(fragment in str(caught.value) for fragment in fragments), str(caught.value)


def test_text_encoder_is_quantized_on_read_by_transformers_rule(tiny_pipeline_folders):
    """A text encoder paradiff reads is quantized as transformers' own quantized load holds it (its rule: the LM
    head stays in full precision), the transformer as diffusers' would, in one request."""
    from diffusers import TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import Mistral3ForConditionalGeneration

    folder = tiny_pipeline_folders["flux2"]
    config = PipelineQuantizationConfig(quant_mapping={"transformer": TorchAoConfig(Int8WeightOnlyConfig()),
                                                       "text_encoder": _transformers_int8()})
    pipe = paradiff.load_pipeline(folder, quantization_config=config)
    reference = Mistral3ForConditionalGeneration.from_pretrained(
        f"{folder}/text_encoder", quantization_config=_transformers_int8(), dtype=torch.float32)
    expected = {n: m.weight for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}
    held = {n: m.weight for n, m in pipe.text_encoder.named_modules() if isinstance(m, torch.nn.Linear)}
    assert held.keys() == expected.keys()
    quantized = [n for n, w in expected.items() if hasattr(w, "qdata")]
    assert len(quantized) == len(expected) - 1 and not hasattr(held["lm_head"], "qdata")
    for name in quantized:
        assert torch.equal(held[name].qdata, expected[name].qdata) and torch.equal(held[name].scale,
                                                                                 expected[name].scale), name
    assert _quantized_linears(pipe.transformer) == sum(isinstance(m, torch.nn.Linear)
                                                       for m in pipe.transformer.modules())


def test_granular_request_names_its_config_class(tiny_pipeline_folders, no_weight_read):
    # PipelineQuantizationConfig validates a granular mapping against the installed backends; the rule under test
    # reads only the mapping, so the object is built without that validation.
    config = object.__new__(PipelineQuantizationConfig)
    config.quant_backend, config.components_to_quantize, config.config_mapping = None, None, {}
    config.quant_mapping = {"transformer": SimpleNamespace()}
    config.is_granular = True
    with pytest.raises(ParallelConfigError, match=r"'transformer' \(Flux2Transformer2DModel\).*SimpleNamespace"):
        paradiff.load_pipeline(tiny_pipeline_folders["flux2"], quantization_config=config)


def test_model_level_config_on_a_pipeline_is_refused(tiny_pipeline_folders, no_weight_read):
    with pytest.raises(ParallelConfigError, match="takes a diffusers.PipelineQuantizationConfig"):
        paradiff.load_pipeline(tiny_pipeline_folders["flux2"], quantization_config=SimpleNamespace())


def test_request_only_for_components_diffusers_loads_passes_through(tiny_pipeline_folders, monkeypatch):
    """The VAE is loaded by diffusers (no stages): the request reaches diffusers' own loader untouched."""
    from diffusers import DiffusionPipeline

    seen = {}
    original = DiffusionPipeline.from_pretrained.__func__

    def record(cls, *args, **kwargs):
        seen["quantization_config"] = kwargs.get("quantization_config")
        kwargs.pop("quantization_config")  # no quantization backend is installed here; the hand-over is the check
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(DiffusionPipeline, "from_pretrained", classmethod(record))
    config = PipelineQuantizationConfig(quant_backend="bitsandbytes_4bit", quant_kwargs={"load_in_4bit": True},
                                        components_to_quantize=["vae"])
    pipe = paradiff.load_pipeline(tiny_pipeline_folders["flux2"], quantization_config=config)
    assert seen["quantization_config"] is config
    assert pipe.transformer.dtype == torch.float32
