"""Errors the model folder's configs already decide are one line, exit 2, and no worker is started."""

from __future__ import annotations

import json

import pytest

import paradiff.cli
from paradiff.cli import main


@pytest.fixture
def no_worker(monkeypatch):
    started = []
    monkeypatch.setattr(paradiff.cli, "launch", lambda *args, **kwargs: started.append(args) or 0)
    return started


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_missing_folder_that_is_no_hub_id(tmp_path, capsys, no_worker, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run(capsys, "generate", "no-such-model", "--out", str(tmp_path / "out"))
    assert (code, no_worker) == (2, [])
    assert err.strip() == ("paradiff: error: model folder no-such-model does not exist (and is not a Hub id of the "
                           "form 'owner/name')")


@pytest.mark.parametrize("family,reason", [
    ("flux2", "Flux2Pipeline never runs classifier-free guidance (guidance-distilled"),
    (None, "EasyAnimateControlPipeline is not classified for CFG parallelism yet ("),
], ids=["never-guides", "not-classified"])
def test_cfg_on_a_pipeline_paradiff_cannot_split_by_cfg(tiny_pipeline_folders, tmp_path, capsys, no_worker, family,
                                                         reason):
    if family is None:
        (tmp_path / "unclassified" / "transformer").mkdir(parents=True)  # its folder there, as the index says
        (tmp_path / "unclassified" / "model_index.json").write_text(json.dumps({
            "_class_name": "EasyAnimateControlPipeline",
            "transformer": ["diffusers", "EasyAnimateTransformer3DModel"]}))
    folder = str(tiny_pipeline_folders[family]) if family else str(tmp_path / "unclassified")
    code, err = run(capsys, "generate", folder, "--cfg", "2", "--out", str(tmp_path))
    assert (code, no_worker) == (2, [])
    assert err.startswith(f"paradiff: error: --cfg 2: {folder}: {reason}") and err.strip().endswith(". Use --cfg 1")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("family,options,need", [
    ("qwenimage", [], "--true-cfg-scale above 1 and --negative-prompt"),
    ("sd3", ["--guidance-scale", "1"], "--guidance-scale above 1"),
], ids=["two-calls-without-negative-prompt", "batch-at-scale-1"])
def test_cfg_on_a_call_that_does_not_guide(tiny_pipeline_folders, tmp_path, capsys, no_worker, family, options,
                                           need):
    code, err = run(capsys, "generate", str(tiny_pipeline_folders[family]), "--cfg", "2", *options,
                    "--out", str(tmp_path))
    assert (code, no_worker) == (2, [])
    assert f"runs no classifier-free guidance with these options (it needs {need};" in err, err
    assert len(err.strip().splitlines()) == 1


def test_cfg_on_a_guiding_call_passes_preflight(tiny_pipeline_folders, tmp_path, capsys, no_worker):
    code, err = run(capsys, "generate", str(tiny_pipeline_folders["sana"]), "--cfg", "2", "--out", str(tmp_path))
    assert (code, err) == (0, "") and len(no_worker) == 1


def test_tp_beyond_the_head_count(tiny_pipeline_folders, tmp_path, capsys, no_worker):
    code, err = run(capsys, "generate", str(tiny_pipeline_folders["flux2"]), "--tp", "8", "--out", str(tmp_path))
    assert (code, no_worker) == (2, [])
    assert err.startswith("paradiff: error: --tp 8: transformer (Flux2Transformer2DModel): ")
    assert "head" in err and len(err.strip().splitlines()) == 1


def test_a_valid_request_reaches_the_launcher(tiny_pipeline_folders, tmp_path, capsys, no_worker):
    code, _ = run(capsys, "generate", str(tiny_pipeline_folders["flux2"]), "--tp", "2", "--out", str(tmp_path))
    assert code == 0 and len(no_worker) == 1


def one_error_line(err: str) -> str:
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("paradiff: error: "), err
    return err.strip().removeprefix("paradiff: error: ")


@pytest.mark.parametrize("argv,message", [
    # the embedded default (no model given) takes the folder checks too
    (["--tp", "8"], "--tp 8: transformer (Flux2Transformer2DModel): tp_degree=8 is larger than the attention head"),
    # the pipeline's __call__ takes no such keyword (FLUX.2 is guidance-distilled)
    (["--negative-prompt", "blurry"], "--negative-prompt: Flux2Pipeline's __call__ takes no negative_prompt"),
    (["--true-cfg-scale", "4"], "--true-cfg-scale: Flux2Pipeline's __call__ takes no true_cfg_scale"),
    # nf4's 64-element blocks: named with the flag that leaves the layer unquantized
    (["--quantize", "nf4", "--tp", "2"], "--quantize nf4 --tp 2: the embedded demo pipeline's transformer: "
                                         "context_embedder would be split across a 64-element nf4 block"),
    # accepted without a word before
    (["--prompt", ""], "--prompt '': expected a non-empty prompt"),
    (["--seed", "-1"], "--seed -1: expected an integer from 0 to 2**63 - 1"),
    (["--compile-backend", "eager"], "--compile-backend eager without --compile"),
    (["--lora-weight-name", "style.safetensors"], "--lora-weight-name style.safetensors picks a file of a --lora"),
    (["--quantize-skip", "context_embedder"], "--quantize-skip context_embedder names modules --quantize leaves"),
    (["--quantize", "int8", "--quantize-skip", "context_embeder"], "--quantize-skip context_embeder: the embedded "
                                                                   "demo pipeline's transformer (Flux2Transformer2DModel) "
                                                                   "has no module of that name"),
], ids=["embedded-tp8", "negative-prompt", "true-cfg-scale", "nf4-block-cut", "empty-prompt", "negative-seed",
        "compile-backend-alone", "lora-weight-name-alone", "quantize-skip-alone", "quantize-skip-unknown"])
def test_embedded_default_refused_up_front(tmp_path, capsys, no_worker, argv, message):
    code, err = run(capsys, "generate", "--prompt", "x", *argv, "--out", str(tmp_path))
    assert (code, no_worker) == (2, [])
    assert one_error_line(err).startswith(message), err
    if argv[:2] == ["--quantize", "nf4"]:
        assert "--quantize-skip context_embedder" in err


def test_nf4_with_the_cut_layer_skipped_and_dp_warning_reach_the_launcher(tmp_path, capsys, no_worker):
    code, err = run(capsys, "generate", "--prompt", "x", "--quantize", "nf4", "--tp", "2", "--quantize-skip",
                    "context_embedder", "--out", str(tmp_path))
    assert (code, err, len(no_worker)) == (0, "", 1)
    code, err = run(capsys, "generate", "--prompt", "x", "--dp", "2", "--out", str(tmp_path))
    assert code == 0 and len(no_worker) == 2
    assert err.strip() == ("paradiff: warning: --dp 2 with 1 prompt(s): 1 replica(s) will load the pipeline and draw "
                           "nothing; give at least 2 prompts (--prompt repeated, --prompts-file) or a smaller --dp")


@pytest.mark.parametrize("value", ["-1", "0", "inf"])
def test_timeout_out_of_range_is_refused_by_the_parser(capsys, value):
    from paradiff.cli.args import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["generate", "--timeout", value])
    assert exit_info.value.code == 2
    assert "--timeout: expected a number of seconds above 0" in capsys.readouterr().err


def test_lora_files_checked_before_loading(tiny_pipeline_folders, tmp_path, capsys, no_worker):
    """A truncated or corrupt --lora file is named with what is wrong; the demo's FLUX.2 LoRA on a FLUX.1 folder is
    refused by the module it targets, from the transformer's config on the meta device: all before any worker."""
    from paradiff.demo import LORA_FILE

    data = LORA_FILE.read_bytes()
    truncated, corrupt = tmp_path / "truncated.safetensors", tmp_path / "corrupt.safetensors"
    truncated.write_bytes(data[:len(data) // 2])
    corrupt.write_bytes((16).to_bytes(8, "little") + b"not a json head!")
    cases = [(["--lora", str(truncated)], f"--lora {truncated}: not a readable safetensors file: {truncated}: tensor "),
             (["--lora", str(corrupt)], f"--lora {corrupt}: not a readable safetensors file: {corrupt}: header is "
                                        "not valid JSON"),
             ([str(tiny_pipeline_folders["flux"]), "--lora", str(LORA_FILE)],
              f"--lora {LORA_FILE}: {tiny_pipeline_folders['flux']}'s transformer (FluxTransformer2DModel): LoRA "
              "tensor single_transformer_blocks.0.attn.")]
    for argv, message in cases:
        code, err = run(capsys, "generate", *argv, "--out", str(tmp_path / "out"))
        assert (code, no_worker) == (2, []), err
        assert one_error_line(err).startswith(message), err
    assert "(truncated)" in run(capsys, "generate", "--lora", str(truncated), "--out", str(tmp_path / "out"))[1]
    code, err = run(capsys, "generate", "--lora", str(LORA_FILE), "--out", str(tmp_path / "out"))
    assert (code, err, len(no_worker)) == (0, "", 1)  # on its own pipeline the demo LoRA passes


def test_frames_the_vae_cannot_make(tiny_pipeline_folders, tmp_path, capsys, no_worker):
    """The tiny Wan's VAE packs 2 frames into one latent frame (scale_factor_temporal 2): 2k + 1 frames."""
    folder = str(tiny_pipeline_folders["wan"])
    code, err = run(capsys, "generate", folder, "--frames", "4", "--out", str(tmp_path))
    assert (code, no_worker) == (2, [])
    assert one_error_line(err) == ("--frames 4: WanPipeline's VAE packs 2 frames into one latent frame, so it makes "
                                   "2k + 1 frames and would not make 4; use one of 1, 3, 5, 7 ...")
    code, err = run(capsys, "generate", folder, "--frames", "5", "--out", str(tmp_path))
    assert (code, err, len(no_worker)) == (0, "", 1)


def test_hub_id_not_to_be_had_is_one_line_naming_the_repo(tmp_path, capsys, no_worker, monkeypatch):
    """Offline, with an empty Hub cache: the launcher (not every rank) finds the repository missing, and says how to
    get it."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    code, err = run(capsys, "generate", "someone/tiny-pipeline", "--tp", "2", "--out", str(tmp_path / "out"))
    assert (code, no_worker) == (2, [])
    assert one_error_line(err) == (
        "someone/tiny-pipeline: not in the local Hub cache and HF_HUB_OFFLINE is set; download it where the Hub is "
        "reachable (huggingface-cli download someone/tiny-pipeline) and run with the local copy (its folder, or the "
        "id with HF_HUB_OFFLINE=1)")


def test_quantize_with_compare_equals_diffusers_quantized_load(pools, tmp_path):
    """`paradiff generate --tp 2 --quantize int8 --compare` on the demo (its workers in the 2-rank pool): the
    reference is diffusers' own single-process int8 load, which the split int8 shards equal (docs/quantization.md)."""
    import rank_cases_cli as cli_cases

    argv = ["generate", "--tp", "2", "--quantize", "int8", "--quantize-skip", "proj_out", "--compare", "--prompt",
            "a red circle on a blue background", "--height", "32", "--width", "32", "--steps", "2", "--out",
            str(tmp_path)]
    import torch
    from diffusers import Flux2Transformer2DModel

    from paradiff.demo import pipeline_path
    from paradiff.quant.apply import quantization_summary
    from paradiff.quant.schemes import model_config_for
    from paradiff_testkit.beside import beside

    # diffusers' single-process int8 load is summarised here while the ranks generate
    per_rank, whole = beside(
        lambda: quantization_summary(Flux2Transformer2DModel.from_pretrained(
            pipeline_path() / "transformer", quantization_config=model_config_for("int8", torch.float32, ("proj_out",)),
            torch_dtype=torch.float32)),
        lambda: pools.get(2).run(cli_cases.generate_each, timeout_s=600, runs=[argv]))
    report = per_rank[0][0]["report"]
    assert report["config"]["quantize"] == "int8" and report["compared_outputs"] == 1
    assert report["config"]["quantize_skip"] == ["proj_out"]
    held = {rank["quantization"]["transformer"]["quantized_linears"] for rank in report["ranks"]}
    assert held == {whole["quantized_linears"]}, (held, whole)
    assert report["max_abs_diff_vs_single_process"] <= 1e-5, report["max_abs_diff_vs_single_process"]


def test_hub_id_under_torchrun_is_fetched_by_one_rank_per_node(pools, tmp_path):
    """Under torchrun (no launcher): local rank 0 tries the fetch, the other rank waits and tries nothing; offline
    with an empty cache, rank 0 names the repository and how to get it, and both stop before loading."""
    import rank_cases_cli as cli_cases

    results = pools.get(2).run(cli_cases.fetch_offline, repo="someone/tiny-pipeline", cache=str(tmp_path / "hub"))
    by_rank = {result["rank"]: result for result in results}
    assert by_rank[0]["tried"] == ["someone/tiny-pipeline"] and by_rank[1]["tried"] == []
    assert by_rank[0]["error"].startswith("someone/tiny-pipeline: not in the local Hub cache and HF_HUB_OFFLINE is "
                                          "set; download it where the Hub is reachable (huggingface-cli download ")
    assert by_rank[1]["error"].startswith("someone/tiny-pipeline: not fetched; the first rank of a node could not")


def test_what_exploratory_runs_found_is_refused_up_front(tiny_pipeline_folders, tmp_path, capsys, no_worker):
    """Non-finite numbers, prompts files that hold no prompt or no UTF-8, a --lora that is no adapter, a folder whose
    index or component files are corrupt (at one rank as at tp2), flags that need another: one line, exit 2, no
    worker; --dry-run takes the same checks as a run."""
    import shutil

    from paradiff.demo import LORA_FILE

    empty, binary = tmp_path / "empty.txt", tmp_path / "latin1.txt"
    empty.write_text("\n  \n")
    binary.write_bytes("caf\xe9\n".encode("latin-1"))
    readme = tmp_path / "readme.txt"
    readme.write_text("not an adapter")
    flux = tiny_pipeline_folders["flux"]
    broken = tmp_path / "broken"
    shutil.copytree(flux, broken)
    weights = sorted((broken / "transformer").glob("*.safetensors"))[0]
    weights.write_bytes(weights.read_bytes()[:-100])
    no_vae = tmp_path / "no-vae"
    shutil.copytree(flux, no_vae)
    shutil.rmtree(no_vae / "vae")
    bad_index = tmp_path / "bad-index"
    shutil.copytree(flux, bad_index)
    (bad_index / "model_index.json").write_text("{'not': json")
    bad_config = tmp_path / "bad-config"
    shutil.copytree(flux, bad_config)
    (bad_config / "transformer" / "config.json").write_text("{")
    vae_weights = sorted((flux / "vae").glob("*.safetensors"))[0]
    cases = [(["--guidance-scale", "nan"], "generate: error: --guidance-scale: expected a finite number, got nan"),
             (["--lora", f"{LORA_FILE}:nan"], "paradiff: error: --lora"),
             (["--prompts-file", str(empty)], f"paradiff: error: --prompts-file {empty} holds no prompt"),
             (["--prompts-file", str(binary)], f"paradiff: error: --prompts-file {binary}: not UTF-8 text"),
             (["--lora", str(readme)], f"paradiff: error: --lora {readme}: not an adapter file (a .txt file)"),
             ([str(flux), "--lora", str(vae_weights)], f"paradiff: error: --lora {vae_weights}: holds no adapter"),
             ([str(broken)], f"paradiff: error: {weights}: "),
             ([str(broken), "--tp", "2"], f"{weights}: tensor "),  # named by the TP check, which reads it first
             ([str(no_vae)], f"paradiff: error: {no_vae}: model_index.json names vae"),
             ([str(bad_index)], f"paradiff: error: {bad_index / 'model_index.json'}: not valid JSON"),
             ([str(bad_config)], f"paradiff: error: {bad_config / 'transformer' / 'config.json'}: not valid JSON"),
             (["--device-memory", "24"], "paradiff: error: --device-memory 24 without --dry-run"),
             (["--world", "2"], "paradiff: error: --world 2 without --parallel auto"),
             (["--cfg", "2", "--dry-run"], "paradiff: error: --cfg 2: ")]
    for argv, message in cases:
        try:
            code, err = run(capsys, "generate", *argv, "--out", str(tmp_path / "out"))
        except SystemExit as exit_info:  # the parser's own refusal
            code, err = exit_info.code, capsys.readouterr().err
        assert (code, no_worker) == (2, []), (argv, err)
        assert len(err.strip().splitlines()) == 1 and message in err, (argv, err)


def test_a_run_into_a_folder_of_an_earlier_run_removes_that_runs_outputs_first(tmp_path, capsys, no_worker):
    """The outputs the earlier report.json names (inside --out, with an output's suffix) go, with that report;
    anything else in the folder, or named but elsewhere, stays."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere.png"
    out.mkdir()
    for name in ("0000.png", "0001.png", "0001-without-lora.png", "compare.png", "notes.txt", "mine.png"):
        (out / name).write_text("x")
    elsewhere.write_text("x")
    (out / "report.json").write_text(json.dumps({
        "images": {"0": str(out / "0000.png"), "1": str(out / "0001.png")},
        "without_lora": {"1": str(out / "0001-without-lora.png")}, "compare_png": str(out / "compare.png"),
        "notes": str(out / "notes.txt"), "other": str(elsewhere)}))
    code, err = run(capsys, "generate", "--prompt", "x", "--out", str(out))
    assert (code, len(no_worker)) == (0, 1), err
    assert sorted(path.name for path in out.iterdir()) == ["mine.png", "notes.txt"] and elsewhere.exists()
    assert err.strip() == f"paradiff: --out {out}: removed the 4 output file(s) of the run before (its report.json " \
                          "named them)"
