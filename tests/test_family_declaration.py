"""Every plan module declares one typed `Family`, and discovery finds exactly those."""

import importlib
import pkgutil

import diffusers
import pytest
import transformers

from paradiff import plans
from paradiff.plans import families, family_of, text_encoder_families
from paradiff.plans import text_encoders
from paradiff.plans.family import Family

# helpers, per-pipeline rules, configs, example-input records
HELPERS = {"auto", "common", "family", "inputs", "pipelines", "previews", "reference_configs", "vae"}


def plan_modules(package):
    return [importlib.import_module(f"{package.__name__}.{info.name}")
            for info in pkgutil.iter_modules(package.__path__)
            if not info.ispkg and not info.name.startswith("_") and info.name not in HELPERS]


def test_every_plan_module_declares_a_family_named_after_it():
    for module in plan_modules(plans) + plan_modules(text_encoders):
        family = getattr(module, "FAMILY", None)
        assert isinstance(family, Family), module.__name__
        assert family.name == module.__name__.rpartition(".")[2]
        assert family.model_classes and family.tensor_parallel_plan is not None


def test_discovery_finds_every_declared_family_once():
    found = [family.name for family in families()]
    assert found == sorted(module.__name__.rpartition(".")[2] for module in plan_modules(plans))
    assert len(found) >= 70
    assert [family.name for family in text_encoder_families()] == [
        "bert", "clip", "gemma", "gemma4", "glm", "llama", "mistral", "qwen", "siglip", "smollm3", "t5", "t5gemma"]


@pytest.mark.parametrize("family", families() + text_encoder_families(), ids=lambda family: family.name)
def test_model_classes_are_real_library_classes(family):
    import diffusers.pipelines.prx as prx  # PRX's T5GemmaEncoder wrapper, which diffusers also puts on transformers

    library = transformers if family in text_encoder_families() else diffusers
    for class_name in family.model_classes:
        # the wrapper reaches transformers only if the first import of diffusers' PRX module saw transformers
        # without it, which depends on what ran earlier in the process: the PRX module itself always has it
        cls = getattr(library, class_name, None) or (getattr(prx, class_name, None) if library is transformers else None)
        assert isinstance(cls, type), f"{family.name}: {library.__name__} has no class {class_name}"
        assert family_of(cls) is family


@pytest.mark.parametrize("family", families(), ids=lambda family: family.name)
def test_examples_name_the_family_classes_and_come_with_inputs(family):
    for example, (class_name, config) in family.examples.items():
        assert class_name in family.model_classes or isinstance(getattr(diffusers, class_name, None), type)
        assert isinstance(config, dict)
    assert (family.example_inputs is None) == (not family.examples)
    assert set(family.extra_modes) <= set(family.examples)
