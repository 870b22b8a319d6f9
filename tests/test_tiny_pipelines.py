"""Tiny local pipelines: saved as real folders, loaded back by diffusers and by paradiff, and run end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import paradiff
from paradiff_testkit.pipelines import (
    PIPELINE_FAMILIES,
    VIDEO_FAMILIES,
    build_pipeline,
    default_call_kwargs,
    save_pipeline,
    transformer_class,
    transformer_config,
)

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

EXPECTED_TRANSFORMERS = {
    "flux": "FluxTransformer2DModel",
    "flux2": "Flux2Transformer2DModel",
    "qwenimage": "QwenImageTransformer2DModel",
    "wan": "WanTransformer3DModel",
    "wan2.2": "WanTransformer3DModel",
    "wan2.2-a14b": "WanTransformer3DModel",
    "hunyuanvideo": "HunyuanVideoTransformer3DModel",
    "ltx": "LTXVideoTransformer3DModel",
    "flux2_klein": "Flux2Transformer2DModel",
    "lumina2": "Lumina2Transformer2DModel",
    "sd3": "SD3Transformer2DModel",
    "pixart_sigma": "PixArtTransformer2DModel",
    "sana": "SanaTransformer2DModel",
    "auraflow": "AuraFlowTransformer2DModel",
    "chroma": "ChromaTransformer2DModel",
    "cogview3plus": "CogView3PlusTransformer2DModel",
    "cogvideox": "CogVideoXTransformer3DModel",
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models are tiny: a second intra-op thread gains nothing, and on a busy machine its spin-waits turn
    microsecond matmuls into tens of milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folders(tiny_pipeline_folders):
    return tiny_pipeline_folders


def _generate(pipe, family: str, seed: int) -> np.ndarray:
    out = pipe(**default_call_kwargs(family), generator=torch.Generator().manual_seed(seed))
    return out.frames if family in VIDEO_FAMILIES else out.images


def _state_dicts_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("family", PIPELINE_FAMILIES)
def test_saved_pipeline_loads_and_generates(folders, family):
    folder = folders[family]
    assert (folder / "model_index.json").is_file()
    assert list((folder / "transformer").glob("*.safetensors"))

    pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe).__name__ == diffusers.DiffusionPipeline.load_config(folder)["_class_name"]
    assert type(pipe.transformer).__name__ == EXPECTED_TRANSFORMERS[family]
    assert type(pipe.transformer) is transformer_class(family)

    kwargs = default_call_kwargs(family)
    first = _generate(pipe, family, seed=0)
    again = _generate(pipe, family, seed=0)
    other = _generate(pipe, family, seed=1)

    if family in VIDEO_FAMILIES:
        assert first.shape == (1, kwargs["num_frames"], kwargs["height"], kwargs["width"], 3)
    else:
        assert first.shape == (1, kwargs["height"], kwargs["width"], 3)
    assert np.isfinite(first).all()
    assert first.min() >= 0.0 and first.max() <= 1.0
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


@pytest.mark.parametrize("family", PIPELINE_FAMILIES)
def test_saved_folder_matches_built_pipeline(folders, family):
    """Every weight and every tokenization survives the round trip through the folder."""
    loaded = diffusers.DiffusionPipeline.from_pretrained(folders[family])
    built = build_pipeline(family, seed=0)
    prompt = default_call_kwargs(family)["prompt"]
    for name, component in built.components.items():
        restored = loaded.components[name]
        if isinstance(component, torch.nn.Module):
            assert _state_dicts_equal(component, restored), name
        elif hasattr(component, "convert_ids_to_tokens"):
            assert component(prompt).input_ids == restored(prompt).input_ids, name
        elif component is not None:
            assert type(restored) is type(component), name


@pytest.mark.parametrize("family", PIPELINE_FAMILIES)
def test_paradiff_loads_saved_transformer(folders, family):
    folder = folders[family]
    cls = transformer_class(family)
    model = paradiff.from_pretrained(cls, folder, subfolder="transformer")
    reference = cls.from_pretrained(folder, subfolder="transformer")
    assert type(model) is cls
    assert _state_dicts_equal(model, reference)


def test_build_is_deterministic_per_seed():
    a = build_pipeline("qwenimage", seed=3)
    b = build_pipeline("qwenimage", seed=3)
    c = build_pipeline("qwenimage", seed=4)
    for name in ("transformer", "text_encoder", "vae"):
        assert _state_dicts_equal(getattr(a, name), getattr(b, name)), name
        assert not _state_dicts_equal(getattr(a, name), getattr(c, name)), name


def test_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_pipeline("wan", seed=0)
    assert torch.equal(torch.rand(4), expected)


def test_transformer_overrides():
    pipe = build_pipeline("flux", transformer_overrides={"num_layers": 2, "attention_head_dim": 8})
    assert pipe.transformer.config.num_layers == 2
    assert pipe.transformer.config.attention_head_dim == 8
    assert sum(pipe.transformer.config.axes_dims_rope) == 8
    out = _generate(pipe, "flux", seed=0)
    assert np.isfinite(out).all()
    # The rest of the pipeline is unchanged by an override.
    assert _state_dicts_equal(pipe.vae, build_pipeline("flux").vae)

    with pytest.raises(ValueError, match="in_channels"):
        transformer_config("wan", {"in_channels": 8})
    with pytest.raises(ValueError, match="unknown pipeline family"):
        build_pipeline("sdxl")


def test_save_is_idempotent(tmp_path):
    folder = save_pipeline("qwenimage", tmp_path / "qwen")
    index = folder / "model_index.json"
    before = index.stat().st_mtime_ns
    assert save_pipeline("qwenimage", folder) == folder
    assert index.stat().st_mtime_ns == before


def test_a_learnt_vocabulary_is_kept_for_the_session(tmp_path, monkeypatch):
    """A tokenizer's BPE vocabulary is learnt once: kept in this process and in the session's folder
    (PARADIFF_TESTKIT_CACHE), where a process that has not learnt it (a rank, a forked command) reads it back."""
    from paradiff_testkit import pipelines

    monkeypatch.setenv(pipelines.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(pipelines, "_LEARNT", {})
    learnt = pipelines._qwen2_tokenizer()
    (stored,) = tmp_path.glob("bpe-*.json")
    monkeypatch.setattr(pipelines, "_LEARNT", {})  # as a new process: only the folder remembers it

    def unexpected(*_args, **_kwargs):
        raise AssertionError("learnt again")

    monkeypatch.setattr(pipelines, "_learn_bpe_now", unexpected)
    again = pipelines._qwen2_tokenizer()
    assert again.get_vocab() == learnt.get_vocab() and len(pipelines._LEARNT) == 1, stored
    prompt = default_call_kwargs("qwenimage")["prompt"]
    assert again(prompt).input_ids == learnt(prompt).input_ids


def test_tiny_pipeline_folders_are_built_when_asked_for(tiny_pipeline_folders):
    """The session fixture is a mapping of every family that builds none until one is asked for."""
    assert list(tiny_pipeline_folders) == list(PIPELINE_FAMILIES)
    assert len(tiny_pipeline_folders) == len(PIPELINE_FAMILIES)
    with pytest.raises(KeyError):
        tiny_pipeline_folders["no-such-family"]
    folder = tiny_pipeline_folders["flux2"]
    assert (folder / "model_index.json").exists() and folder.parent == tiny_pipeline_folders.root
