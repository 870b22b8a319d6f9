"""A pipeline's quantization request is never silently ignored: a component paradiff loads itself is refused by
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


@pytest.mark.parametrize("components, named", [
    (["transformer"], "'transformer' (Flux2Transformer2DModel)"),
    (None, "'transformer' (Flux2Transformer2DModel)"),  # no list: diffusers quantizes every component
])
def test_request_for_a_component_paradiff_loads_is_refused_by_name(tiny_pipeline_folders, no_weight_read,
                                                                   components, named):
    config = PipelineQuantizationConfig(quant_backend="bitsandbytes_4bit", quant_kwargs={"load_in_4bit": True},
                                        components_to_quantize=components)
    with pytest.raises(ParallelConfigError, match=r"ask.* to quantize .*" + named.replace("(", r"\(").replace(")", r"\)")) as caught:
        paradiff.load_pipeline(tiny_pipeline_folders["flux2"], quantization_config=config)
    assert "bitsandbytes_4bit" in str(caught.value) and "full precision" in str(caught.value)


def test_granular_request_names_its_config_class(tiny_pipeline_folders, no_weight_read):
    # PipelineQuantizationConfig validates a granular mapping against the installed backends; the rule under test
    # reads only the mapping, so the object is built without that validation.
    config = object.__new__(PipelineQuantizationConfig)
    config.quant_backend, config.components_to_quantize = None, None
    config.quant_mapping = {"transformer": SimpleNamespace()}
    with pytest.raises(ParallelConfigError, match=r"'transformer' \(Flux2Transformer2DModel\) \(transformer: SimpleNamespace\)"):
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
