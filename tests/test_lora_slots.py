"""Adapters per sample (api/lora_slots.py): one call on a batch whose samples each run their own adapter (or none),
unmerged, every sample equal to diffusers' single-process model with only that adapter loaded; at tp2, tp2 x
ulysses2, on an int8 base, and compiled (a switch of adapters compiles no new graph)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rank_cases_lora_slots as cases
from paradiff.api.lora_slots import (enable_adapter_slots, load_slot_adapter, module_scalings,
                                     set_sample_adapters)
from paradiff.errors import AdapterError
from paradiff.tensor_parallel.lora_slots import LoraSlots, SlotIndex
from paradiff_testkit.lora import TARGETS, random_lora, save_kohya_flux_lora, save_lora
from paradiff.testing.models import build_model

RTOL = 1e-5
SAMPLES = [None, "style", "detail", "kohya"]
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def slot_loras(tmp_path_factory) -> dict[str, dict]:
    """Three FLUX.1 adapters of different ranks and formats: diffusers rank 4 (alpha 8) on every target, diffusers
    rank 16 (alpha 6) on every other one, kohya rank 8 (alpha 2) converted by diffusers."""
    root = tmp_path_factory.mktemp("slot-loras")
    model = build_model("flux")
    return {
        "style": {"path": str(save_lora(root / "style.safetensors", random_lora(model, TARGETS["flux"], 4, seed=1),
                                        rank=4, alpha=8))},
        "detail": {"path": str(save_lora(root / "detail.safetensors",
                                         random_lora(model, TARGETS["flux"][::2], 16, seed=2), rank=16, alpha=6))},
        "kohya": {"path": str(save_kohya_flux_lora(root / "kohya.safetensors", model.config, rank=8, alpha=2.0,
                                                   seed=3)), "kohya": True},
    }


def test_slot_rows_follow_their_samples_and_a_rank_above_the_slots_is_refused():
    index = SlotIndex(3)
    slots = LoraSlots(4, 2, max_loras=2, max_rank=2, index=index, dtype=torch.float32)
    a, b = torch.randn(2, 4), torch.randn(2, 2)
    slots.write(2, a, b, 0.5)
    index.set([0, 2])
    x = torch.randn(4, 3, 4)  # two copies of the two samples (CFG batched in one call)
    out = slots(x)
    assert torch.equal(out[0], torch.zeros(3, 2)) and torch.equal(out[2], torch.zeros(3, 2))
    torch.testing.assert_close(out[1], 0.5 * (x[1] @ a.T) @ b.T)
    torch.testing.assert_close(out[3], 0.5 * (x[3] @ a.T) @ b.T)
    with pytest.raises(AdapterError, match="rank 3 does not fit slots of max_lora_rank 2"):
        slots.write(1, torch.randn(3, 4), torch.randn(2, 3), 1.0)
    with pytest.raises(AdapterError, match=r"must be in 0\.\.2"):
        index.set([0, 3])
    with pytest.raises(AdapterError, match="3 batch rows for 2 sample"):
        slots(torch.randn(3, 4))


def test_eager_slots_run_only_the_ranks_their_rows_fill(monkeypatch):
    """Run eagerly, a layer multiplies only up to the widest rank its rows' slots hold, and nothing when none of them
    touches it: the same values as the full max_rank product (which a traced model always runs)."""
    index = SlotIndex(4)
    slots = LoraSlots(6, 5, max_loras=3, max_rank=8, index=index, dtype=torch.float32)
    slots.write(1, torch.randn(2, 6), torch.randn(5, 2), 0.5)
    slots.write(3, torch.randn(3, 6), torch.randn(5, 3), 2.0)
    x = torch.randn(3, 4, 6)
    base = torch.randn(3, 4, 5)
    widths = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: widths.append(a.shape[-1]) or real_bmm(a, b))
    index.set([0, 2, 0])  # slot 2 is empty: nothing to multiply, the layer's output handed back as it is
    assert slots.add_to(base, x) is base and torch.equal(slots(x), torch.zeros(3, 4, 5)) and widths == []
    for chosen, rank in (([1, 0, 1], 2), ([1, 3, 0], 3)):
        index.set(chosen)
        eager = slots(x)
        assert widths[-2:] == [6, rank], (chosen, widths)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the traced path: all 8 columns
        full = slots(x)
        monkeypatch.undo()
        monkeypatch.setattr(torch, "bmm", lambda a, b: widths.append(a.shape[-1]) or real_bmm(a, b))
        assert widths[-2:] == [6, 8], widths
        torch.testing.assert_close(eager, full, rtol=1e-6, atol=1e-6)
        assert eager[[c == 0 for c in chosen]].abs().max() == 0


def test_an_adapter_load_costs_its_own_layers_and_bytes(slot_loras, monkeypatch):
    """A load with the server's checksum takes no second one; an unload clears only the layers its adapter wrote; a
    slot reused by a narrower adapter holds only that adapter (the wider one's rows and columns zeroed)."""
    import paradiff.io.adapters as adapter_reads  # where the adapter's file is checksummed (open_adapter)

    model = build_model("flux")
    bank = enable_adapter_slots(model, max_loras=2, max_lora_rank=16)
    monkeypatch.setattr(adapter_reads, "_file_digest", lambda path: pytest.fail(f"{path} checksummed again"))
    load_slot_adapter(model, "detail", slot_loras["detail"]["path"], identity="sha256 given", use_safetensors=True)
    assert bank.adapters["detail"].identity == "sha256 given"
    monkeypatch.undo()
    written = set(bank.adapters["detail"].ranks)
    cleared = []
    monkeypatch.setattr(LoraSlots, "clear", lambda layer, slot: cleared.append(layer))
    from paradiff.api.lora_slots import unload_slot_adapter

    unload_slot_adapter(model, "detail")
    assert {id(layer) for layer in cleared} == {id(bank.layers[name]) for name in written} and \
        len(written) < len(bank.layers) / 2, (len(written), len(bank.layers))
    monkeypatch.undo()
    layer = LoraSlots(4, 2, max_loras=1, max_rank=3, index=SlotIndex(2), dtype=torch.float32)
    layer.write(1, torch.randn(3, 4), torch.randn(2, 3), 1.0)
    a, b = torch.randn(1, 4), torch.randn(2, 1)
    layer.write(1, a, b, 0.5)  # the same slot, rank 1 after rank 3
    assert torch.equal(layer.lora_a[1, 1:], torch.zeros(2, 4)) and torch.equal(layer.lora_b[1, :, 1:],
                                                                               torch.zeros(2, 2))
    layer.index.set([1])
    x = torch.randn(1, 3, 4)
    torch.testing.assert_close(layer(x)[0], 0.5 * (x[0] @ a.T) @ b.T)
    layer.clear(1)
    assert not layer.lora_a.any() and not layer.lora_b.any() and not layer.scale.any()
    # the server's path: the file read once (hashed), the slots filled from those bytes, as from the file itself
    from paradiff.api.lora_slots import slot_adapter_source

    path = slot_loras["style"]["path"]
    source, extra = slot_adapter_source(None, path, Path(path).read_bytes())
    assert isinstance(source, dict) and extra["metadata"]["transformer.lora_alpha"] == 8, extra
    load_slot_adapter(model, "from bytes", source, identity="sha256 given", **extra)
    other = build_model("flux")
    from_file = enable_adapter_slots(other, max_loras=2, max_lora_rank=16)
    load_slot_adapter(other, "from the file", path, use_safetensors=True)
    for name, layer in bank.layers.items():
        twin = from_file.layers[name]
        assert torch.equal(layer.lora_a, twin.lora_a) and torch.equal(layer.lora_b, twin.lora_b) and \
            torch.equal(layer.scale, twin.scale), name


def test_the_adapter_cache_keeps_the_recently_used_and_checks_each_file(slot_loras, tmp_path, pools):
    """The server's cache per rank: --max-loras resident, the least recently used evicted for a new one, a resident
    adapter reused without a read; a file changed since it was named is refused (409) before any slot is written;
    the ranks agree on the checksum before any writes a slot (two ranks with different checksums, or one rank's copy
    changed: both refuse, none wrote, none hangs); a round's images go in calls of at most --max-loras distinct
    adapters."""
    import shutil

    from paradiff.serve.adapters import AdapterCache, adapter_chunks, file_sha256
    from paradiff.serve.protocol import RequestError

    model = build_model("flux")
    cache = AdapterCache(model, max_loras=2, max_rank=16)
    adapters = {}
    for name in ("style", "detail"):
        path = tmp_path / f"{name}.safetensors"
        shutil.copy(slot_loras[name]["path"], path)
        adapters[name] = {"name": name, "path": str(path), "sha256": file_sha256(path)}
    adapters["third"] = dict(adapters["style"], name="third")
    cache.prepare([adapters["style"], None], None)
    cache.prepare([adapters["detail"]], None)
    cache.prepare([adapters["style"]], None)  # resident: no load; now the most recently used
    assert cache.loads == 2 and list(cache.resident) == ["detail", "style"]
    cache.prepare([adapters["third"], adapters["style"]], None)  # detail, least recently used, out
    assert cache.loads == 3 and list(cache.resident) == ["third", "style"]
    assert bank_slots(model) == {"style": 1, "third": 2} and model_state_index(model) == [2, 1]
    Path(adapters["detail"]["path"]).write_bytes(Path(slot_loras["style"]["path"]).read_bytes())
    with pytest.raises(RequestError, match="detail.*changed since it was loaded") as changed:
        cache.prepare([adapters["detail"]], None)
    assert changed.value.status == 409 and list(cache.resident) == ["third", "style"]
    images = [({"adapter": {"name": name}}, 0) for name in ("a", None, "b", "a", "c", None)]
    assert [[image[0]["adapter"]["name"] for image in chunk] for chunk in adapter_chunks(images, 8, 2)] == \
        [["a", None, "b", "a"], ["c", None]]
    results = pools.get(2).run(cases.slot_checksums_disagree, path=slot_loras["style"]["path"])
    for result in results:
        assert "disagree" in result["error"] and "adapter content" in result["error"], result
        assert not result["written"] and result["loaded"] == [], result
        assert result["cache loads"] == 0 and "changed since it was loaded" in result["cache error"], result
    assert [r["cache error"].split(":")[0] for r in results] == ["DistributedError", "RequestError"], results


def bank_slots(model) -> dict[str, int]:
    from paradiff.api.lora_slots import adapter_bank

    return {name: adapter.slot for name, adapter in adapter_bank(model).adapters.items()}


def model_state_index(model) -> list[int]:
    from paradiff.api.lora_slots import adapter_bank

    return adapter_bank(model).index.samples.tolist()


def test_a_text_encoder_lora_is_refused_by_name_with_its_keys(tmp_path):
    """Adapters per sample / per request adapt the transformer only: a file with text-encoder tensors (diffusers'
    or kohya's names) is refused naming the adapter, its file and the tensors, by the library, the server's
    /v1/load_lora_adapter and the CLI's adapter column (before any worker starts)."""
    from safetensors.torch import save_file

    from paradiff.api.lora_slots import slot_adapter_source
    from paradiff.cli.args import CliError, build_parser, check_args
    from paradiff.serve.adapters import AdapterRegistry
    from paradiff.serve.protocol import RequestError

    factors = {"transformer.proj_out.lora_A.weight": torch.zeros(2, 8), "transformer.proj_out.lora_B.weight":
               torch.zeros(8, 2), "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(2, 8),
               "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.zeros(8, 2)}
    for layer in range(3):
        factors[f"text_encoder.text_model.encoder.layers.{layer}.self_attn.q_proj.lora_A.weight"] = torch.zeros(2, 8)
    path = tmp_path / "both.safetensors"
    save_file(factors, str(path))
    fragments = ["'both'", str(path), "adapts a text encoder: 5 tensor(s)",
                 "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight",
                 "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight", "and 2 more",
                 "transformer only"]
    with pytest.raises(AdapterError) as library:
        slot_adapter_source(None, str(path), name="both")
    registry = AdapterRegistry("base", [], str(tmp_path), True, max_rank=8)
    with pytest.raises(RequestError) as served:
        registry.add("both", "both.safetensors")
    assert served.value.status == 400 and registry.names() == []
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("both\ta fox\n")
    args = build_parser().parse_args(["generate", "--prompts-file", str(prompts), "--lora", str(path),
                                      "--out", str(tmp_path / "out")])
    with pytest.raises(CliError) as cli:
        check_args(args)
    for message in (str(library.value), str(served.value), str(cli.value)):
        for fragment in fragments:
            assert fragment in message.replace("'lora0'", "'both'"), (fragment, message)


def test_scalings_are_diffusers_lora_config():
    shapes = {"a.lora_A.weight": (4, 8), "a.lora_B.weight": (8, 4), "b.lora_A.weight": (16, 8),
              "b.lora_B.weight": (8, 16)}
    assert module_scalings(shapes, None, None, "x") == {"a": 1.0, "b": 1.0}  # no alphas: alpha = rank
    assert module_scalings(shapes, {"a.alpha": 2.0, "b.alpha": 2.0}, None, "x") == {"a": 0.5, "b": 0.125}
    assert module_scalings(shapes, None, {"r": 4, "lora_alpha": 8, "rank_pattern": {"b": 16}}, "x") == \
        {"a": 2.0, "b": 0.5}


def test_mixed_batch_on_a_plain_model_and_bad_names(slot_loras, checkpoints):
    """Single process, on diffusers' own model: base + 3 adapters in one call; unknown names and full slots refused."""
    result = cases.mixed_batch("flux", str(checkpoints[("flux", "single")]), "single", slot_loras, SAMPLES)
    assert max(result["diffs"].values()) <= RTOL, result
    model = build_model("flux")
    enable_adapter_slots(model, max_loras=1, max_lora_rank=4)
    load_slot_adapter(model, "style", slot_loras["style"]["path"], use_safetensors=True)
    with pytest.raises(AdapterError, match="No adapter named 'turbo'"):
        set_sample_adapters(model, ["style", "turbo"])
    with pytest.raises(AdapterError, match="All 1 adapter slots are in use"):
        load_slot_adapter(model, "other", slot_loras["style"]["path"], use_safetensors=True)
    with pytest.raises(AdapterError, match="rank 16 on .* above max_lora_rank 4"):
        from paradiff.api.lora_slots import disable_adapter_slots

        disable_adapter_slots(model)
        enable_adapter_slots(model, max_loras=2, max_lora_rank=4)
        load_slot_adapter(model, "detail", slot_loras["detail"]["path"], use_safetensors=True)


@pytest.fixture(scope="module")
def sd3_loras(tiny_pipeline_folders, tmp_path_factory) -> dict[str, str]:
    from paradiff_testkit.lora import save_pipeline_loras

    files = save_pipeline_loras("sd3", tiny_pipeline_folders["sd3"], tmp_path_factory.mktemp("sd3-loras"))
    return {name: str(files[name]) for name in ("style", "detail")}


def test_mixed_batch_matches_diffusers_per_sample_in_every_mode(pools, checkpoints, slot_loras, tiny_pipeline_folders,
                                                               sd3_loras):
    """tp2 compiled (the first call, then a switch and an unload compile no new graph), tp2 on an int8 base, SD3's
    pipeline at cfg2 (one transformer call on the batched branches, each rank one branch: every row's adapter follows
    its sample); then tp2 x ulysses2."""
    folder = str(checkpoints[("flux", "single")])
    base = dict(family="flux", folder=folder, loras=slot_loras, samples=SAMPLES)
    two = [dict(base, mode="tp2", compiled=True), dict(base, mode="tp2", scheme="int8"),
           dict(family="sd3", folder=str(tiny_pipeline_folders["sd3"]), mode="cfg2", loras=sd3_loras,
                samples=["detail", None, "style"], pipeline=True)]
    results = pools.get(2).run(cases.mixed_batch_cases, timeout_s=900, cases=two)
    results += pools.get(4).run(cases.mixed_batch_cases, timeout_s=900, cases=[dict(base, mode="tp2xulysses2")])
    for rank_results in results:
        for result in rank_results:
            where = (result["case"]["mode"], result["case"].get("scheme"), result["rank"])
            assert max(result["diffs"].values()) <= RTOL, (where, result["diffs"])
            if result["case"].get("compiled"):
                assert max(result["switched"].values()) <= RTOL, (where, result["switched"])
                assert max(result["unloaded"].values()) <= RTOL, (where, result["unloaded"])
                assert result["graphs"]["first"] > 0
                assert result["graphs"]["after switch and unload"] == result["graphs"]["first"], where


@pytest.fixture(scope="module")
def quantized_slot_base(tmp_path_factory) -> dict:
    """A tiny FLUX.2 whose planned slices at tp2 are whole nf4 blocks (64) and whole Q8_0 blocks (32): 64-wide heads
    and inputs, as a folder (fp8, nf4) and as an original-format GGUF file (Q8_0 where a row is whole blocks, F32
    elsewhere); two adapters, diffusers rank 4 (alpha 8) and rank 8 (alpha 4) on every other target."""
    from paradiff_testkit.gguf import save_flux2_gguf
    from paradiff.testing.models import model_class, save_model, tiny_config

    root = tmp_path_factory.mktemp("quantized-slot-base")
    torch.manual_seed(3)
    model = model_class("flux2")(**{**tiny_config("flux2", head_dim=64), "joint_attention_dim": 128,
                                    "timestep_guidance_channels": 128}).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_config(root / "config")
    save_flux2_gguf(model, root / "base.gguf", lambda name, tensor: "Q8_0" if tensor.dim() == 2 and
                    tensor.shape[1] % 32 == 0 else "F32")
    targets = TARGETS["flux2"]
    return {"folder": str(save_model(model, root / "base")), "gguf": str(root / "base.gguf"),
            "config": str(root / "config"), "loras": {
                "style": {"path": str(save_lora(root / "style.safetensors", random_lora(model, targets, 4, seed=1),
                                                rank=4, alpha=8))},
                "detail": {"path": str(save_lora(root / "detail.safetensors",
                                                 random_lora(model, targets[::2], 8, seed=2), rank=8, alpha=4))}}}


def test_mixed_batch_on_fp8_nf4_and_gguf_bases_at_tp2(pools, quantized_slot_base):
    """fp8 (torchao weight-only), NF4 (bitsandbytes) and GGUF (Q8_0) bases at tp2, one pool run: every sample of a
    mixed batch (base, two adapters) equals the single-process model quantized alike with only that adapter (peft's
    own load): diffusers' TorchAoConfig and from_single_file models; for NF4, bitsandbytes' weights in one process
    (diffusers refuses bitsandbytes without a GPU)."""
    base = quantized_slot_base
    runs = [dict(family="flux2", folder=base["gguf"] if scheme == "gguf" else base["folder"], mode="tp2",
                 scheme=scheme, loras=base["loras"], samples=["detail", None, "style"], max_lora_rank=8,
                 gguf_config=base["config"] if scheme == "gguf" else None) for scheme in ("fp8", "nf4", "gguf")]
    for rank_results in pools.get(2).run(cases.mixed_batch_cases, timeout_s=900, cases=runs):
        assert [result["case"]["scheme"] for result in rank_results] == ["fp8", "nf4", "gguf"]
        for result in rank_results:
            where = (result["case"]["scheme"], result["rank"])
            assert result["quantized"] >= 10, where
            assert min(result["adapted"].values()) > 0.01, (where, result["adapted"])  # each adapter matters
            assert max(result["diffs"].values()) <= RTOL, (where, result["diffs"])


def test_generate_with_an_adapter_column_draws_mixed_batches(tmp_path):
    """`paradiff generate --lora A --lora B --prompts-file` with an adapter column: the three prompts in one call, each
    image as diffusers draws it with only its adapter (within one level of 255: batched sums round differently)."""
    import json

    import numpy as np
    from diffusers import DiffusionPipeline

    from paradiff.cli.embedded import embedded_call_kwargs, embedded_default
    from paradiff.io.outputs import png_bytes
    from paradiff.demo import LORA_FILE
    from paradiff_testkit import command
    from test_serve import assert_same_picture

    prompt = "a red circle on a blue background, top left"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"lora0\t{prompt}\n-\t{prompt}\nlora1\t{prompt}\n")
    out = tmp_path / "out"
    done = command.run(["-m", "paradiff.cli", "generate", "--steps", "2", "--prompts-file", str(prompts), "--lora",
                        str(LORA_FILE), "--lora", f"{LORA_FILE}:0.5", "--batch", "3", "--out", str(out)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert [report["outputs"][str(i)].get("adapter") for i in range(3)] == ["lora0", None, "lora1"], report["outputs"]
    pipeline = DiffusionPipeline.from_pretrained(str(embedded_default()))
    pipeline.set_progress_bar_config(disable=True)
    pipeline.load_lora_weights(str(LORA_FILE), adapter_name="swap")
    for index, scale in enumerate([1.0, 0.0, 0.5]):
        pipeline.set_adapters(["swap"], [scale])
        image = pipeline(prompt=prompt, generator=torch.Generator("cpu").manual_seed(index), height=64, width=64,
                         num_inference_steps=2, output_type="np", **embedded_call_kwargs()).images[0]
        assert_same_picture((out / f"{index:04d}.png").read_bytes(), png_bytes(image))
    assert np.any(np.asarray(image) != 0)


def test_an_adapter_column_names_only_lora_adapters(tmp_path):
    from paradiff.cli.args import CliError, build_parser, check_args, prompt_adapters
    from paradiff.demo import LORA_FILE

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("colour_swap\ta fox\n-\ta cat\nlora0\ta dog\n")
    args = build_parser().parse_args(["generate", "--prompt", "first", "--prompts-file", str(prompts),
                                      "--lora", str(LORA_FILE)])
    check_args(args)
    assert prompt_adapters(args) == [None, "lora0", None, "lora0"]
    prompts.write_text("turbo\ta fox\n")
    with pytest.raises(CliError, match=r"line 1: adapter 'turbo' is not a --lora adapter; valid: \['colour_swap', "
                                       r"'lora0', '-'\]"):
        check_args(args)
    args = build_parser().parse_args(["generate", "--prompts-file", str(prompts)])
    with pytest.raises(CliError, match="adapter column: give the adapters with --lora"):
        check_args(args)
