"""Conditioning inputs (reference images, masks, image-to-video) on split pipelines, the CLI flags that pass them,
and audio pipelines' WAV files."""

from __future__ import annotations

import pytest

import rank_cases_conditioning as cases
from paradiff_testkit import command

RTOL = 1e-5
CP_MODES = {"ulysses2": dict(ulysses=2), "ring2": dict(ring=2)}


@pytest.mark.parametrize("case", sorted(cases.CASES))
def test_conditioned_pipeline_under_cp_equals_single_process(pools, tiny_pipeline_folders, case):
    folder = str(tiny_pipeline_folders[cases.CASES[case]["family"]])
    results = pools.get(2).run(cases.conditioned_equivalence, case=case, folder=folder, modes=CP_MODES,
                               reference=cases.conditioned_reference(case, folder))
    (tokens,) = results[0]["tokens"]
    assert tokens % 2 == 1, results[0]  # the ranks' shares are uneven
    for mode in CP_MODES:  # each rank holds its own share of the image + condition tokens, together all of them
        shares = [result["modes"][mode]["local_tokens"] for result in results]
        assert all(len(share) == 1 for share in shares) and sum(share[0] for share in shares) == tokens, shares
    for result in results:
        for mode, outcome in result["modes"].items():
            print(case, mode, result["rank"], outcome)
            assert outcome["max_abs_diff"] <= RTOL * max(outcome["scale"], 1.0), (case, mode, outcome)
            assert outcome["share_diff"] <= 1e-6, (case, mode, outcome)  # its slice of the whole sequence


# --- ControlNet: its residuals reach the transformer's blocks split like the tokens they are added to -------------

# tp2 x ulysses2 staged: the ControlNet is freed and read again, shard-on-read, with the transformer at its stage
CONTROLNET_MODES = {2: {"tp2": dict(tp=2), "ulysses2": dict(ulysses=2), "ring2": dict(ring=2)},
                    4: {"tp2xulysses2-staged": dict(tp=2, ulysses=2, stages=True)}}


@pytest.fixture(scope="module")
def controlnet_folders(tmp_path_factory):
    from paradiff_testkit.pipelines import CONTROLNET_FAMILIES, save_controlnet_pipeline

    root = tmp_path_factory.mktemp("controlnet")
    return {family: str(save_controlnet_pipeline(root / family, family)) for family in CONTROLNET_FAMILIES}


@pytest.fixture(scope="module")
def controlnet_references(controlnet_folders):
    """Diffusers' single-process ControlNet call per family, made once in this process (not on every rank of every
    world size)."""
    made = {}

    def reference(family: str) -> dict:
        if family not in made:
            made[family] = cases.controlnet_reference(family, controlnet_folders[family])
        return made[family]

    return reference


@pytest.fixture(scope="module")
def controlnet_folder(controlnet_folders):
    return controlnet_folders["flux"]


@pytest.mark.parametrize("world", sorted(CONTROLNET_MODES))
@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_controlnet_pipeline_equals_single_process_with_residuals_split_like_tokens(pools, controlnet_folders,
                                                                                    controlnet_references, family,
                                                                                    world):
    """FluxControlNetPipeline (99 image tokens) and StableDiffusion3ControlNetPipeline (35) at tp2, ulysses2, ring2 and
    tp2 x ulysses2 (staged), uneven shares: the images equal diffusers' single process; the ControlNet's residuals change the
    image far beyond the tolerance (so residuals added to the wrong tokens, or left out, fail); each rank's block after
    the first residual receives its own slice of the single-process tokens (block output + residual); at TP each rank
    holds its shard of the ControlNet."""
    results = pools.get(world).run(cases.controlnet_equivalence, family=family, folder=controlnet_folders[family],
                                   modes=CONTROLNET_MODES[world], reference=controlnet_references(family),
                                   timeout_s=400)
    for result in results:
        # the residuals are large next to the block outputs they are added to, and change the image
        assert result["tokens"] == cases.CONTROLNET_TOKENS[family] and result["residual_effect"] > 0.1 and result["residual_scale"] > 1.0, (
            {k: v for k, v in result.items() if k != "modes"})
        for mode, outcome in result["modes"].items():
            print(mode, result["rank"], {k: v for k, v in outcome.items() if k not in ("sharded_linears",)})
            assert outcome["max_abs_diff"] <= RTOL * max(outcome["scale"], 1.0), (mode, outcome)
            # the residuals come back whole from the ControlNet in every mode, equal to the unsplit ones
            assert outcome["residual_shapes"] == result["full_residual_shapes"], (mode, outcome)
            assert outcome["residual_diff"] <= RTOL * result["residual_scale"], (mode, outcome)
            assert outcome["share_diff"] <= 1e-5, (mode, outcome)
            if "tp" in mode:  # every block linear split, residual projections by their input features
                assert outcome["shard_diff"] == 0.0 and outcome["held_fraction"] < 0.6, (mode, outcome)
                assert "controlnet_blocks.0" in outcome["sharded_linears"], outcome["sharded_linears"]
                assert "transformer_blocks.0.attn.to_q" in outcome["rows_split"], outcome["rows_split"]
            else:
                assert outcome["sharded_linears"] == [] and outcome["held_fraction"] == 1.0, (mode, outcome)
    tokens = cases.CONTROLNET_TOKENS[family]
    for mode in CONTROLNET_MODES[world]:
        shares = [result["modes"][mode]["local_tokens"] for result in results]
        if mode in ("ulysses2", "ring2"):
            assert sorted(shares) == [tokens // 2, tokens - tokens // 2], shares
        elif mode == "tp2xulysses2-staged":
            assert sorted(shares) == [tokens // 2] * 2 + [tokens - tokens // 2] * 2, shares


# --- the command line: conditioning flags checked before any worker starts ---------------------------------------

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

import paradiff.cli  # noqa: E402
from paradiff.cli import main  # noqa: E402
from paradiff.cli.args import build_parser  # noqa: E402
from paradiff.cli.worker import call_kwargs  # noqa: E402


@pytest.fixture
def no_worker(monkeypatch):
    started = []
    monkeypatch.setattr(paradiff.cli, "launch", lambda *args, **kwargs: started.append(args) or 0)
    return started


@pytest.fixture
def pictures(tmp_path):
    """A 32x32 image, a 32x32 mask, a 16x32 mask and a file that is no image."""
    rng = np.random.default_rng(0)
    paths = {"image": tmp_path / "image.png", "mask": tmp_path / "mask.png", "small_mask": tmp_path / "small.png",
             "text": tmp_path / "notes.png"}
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(paths["image"])
    Image.fromarray(np.full((32, 32), 255, dtype=np.uint8)).save(paths["mask"])
    Image.fromarray(np.full((16, 32), 255, dtype=np.uint8)).save(paths["small_mask"])
    paths["text"].write_text("not a picture")
    return {name: str(path) for name, path in paths.items()}


def _error(capsys, no_worker, *argv) -> str:
    code = main(["generate", *argv])
    err = capsys.readouterr().err
    assert (code, no_worker) == (2, []), err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_image_on_a_pipeline_that_takes_none(tiny_pipeline_folders, tmp_path, pictures, capsys, no_worker):
    err = _error(capsys, no_worker, str(tiny_pipeline_folders["flux"]), "--image", pictures["image"],
                 "--out", str(tmp_path / "out"))
    assert err.startswith("paradiff: error: --image: FluxPipeline's __call__ takes no image")
    assert "--pipeline" in err


def test_missing_image_file(tiny_pipeline_folders, tmp_path, capsys, no_worker):
    err = _error(capsys, no_worker, str(tiny_pipeline_folders["flux"]), "--pipeline", "FluxImg2ImgPipeline",
                 "--image", str(tmp_path / "absent.png"), "--out", str(tmp_path / "out"))
    assert err == f"paradiff: error: --image {tmp_path / 'absent.png'}: no such file"


def test_unreadable_image(tiny_pipeline_folders, tmp_path, pictures, capsys, no_worker):
    err = _error(capsys, no_worker, str(tiny_pipeline_folders["flux"]), "--pipeline", "FluxImg2ImgPipeline",
                 "--image", pictures["text"], "--out", str(tmp_path / "out"))
    assert err.startswith(f"paradiff: error: --image {pictures['text']}: not a readable image")


def test_mask_of_another_size_than_the_image(tiny_pipeline_folders, tmp_path, pictures, capsys, no_worker):
    err = _error(capsys, no_worker, str(tiny_pipeline_folders["flux"]), "--pipeline", "FluxInpaintPipeline",
                 "--image", pictures["image"], "--mask", pictures["small_mask"], "--out", str(tmp_path / "out"))
    assert err == (f"paradiff: error: --mask {pictures['small_mask']} is 32x16 but --image {pictures['image']} is "
                   "32x32; the mask must be as large as the image")


def test_unknown_pipeline_class_lists_close_names(tiny_pipeline_folders, tmp_path, capsys, no_worker):
    err = _error(capsys, no_worker, str(tiny_pipeline_folders["flux"]), "--pipeline", "FluxKontexPipeline",
                 "--out", str(tmp_path / "out"))
    assert err.startswith("paradiff: error: --pipeline FluxKontexPipeline: diffusers ")
    assert "close names: " in err and "FluxKontextPipeline" in err


def test_strength_out_of_range(tiny_pipeline_folders, tmp_path, pictures, capsys, no_worker):
    err = _error(capsys, no_worker, str(tiny_pipeline_folders["flux"]), "--pipeline", "FluxImg2ImgPipeline",
                 "--image", pictures["image"], "--strength", "1.5", "--out", str(tmp_path / "out"))
    assert err == "paradiff: error: --strength 1.5: expected a number from 0 to 1"


def test_valid_conditioning_reaches_the_launcher_and_the_call(tiny_pipeline_folders, tmp_path, pictures, capsys,
                                                              no_worker):
    argv = ["generate", str(tiny_pipeline_folders["flux"]), "--pipeline", "FluxInpaintPipeline", "--image",
            pictures["image"], "--mask", pictures["mask"], "--strength", "0.7", "--ulysses", "2",
            "--out", str(tmp_path / "out")]
    assert main(argv) == 0 and len(no_worker) == 1
    kwargs = call_kwargs(build_parser().parse_args(argv))
    assert kwargs["strength"] == 0.7 and kwargs["image"].size == (32, 32) and kwargs["mask_image"].mode == "L"
    assert np.array_equal(np.asarray(kwargs["image"]), np.asarray(Image.open(pictures["image"]).convert("RGB")))


def test_a_pipeline_naming_the_input_otherwise_gets_it_under_its_keyword(tiny_pipeline_folders, tmp_path, pictures,
                                                                         no_worker):
    # LTX's long multi-prompt I2V takes its image as cond_image= (plans/pipelines.py, PipelineSpec.call_keywords)
    argv = ["generate", str(tiny_pipeline_folders["ltx"]), "--pipeline", "LTXI2VLongMultiPromptPipeline", "--image",
            pictures["image"], "--out", str(tmp_path / "out")]
    assert main(argv) == 0 and len(no_worker) == 1
    kwargs = call_kwargs(build_parser().parse_args(argv))
    assert "image" not in kwargs and kwargs["cond_image"].size == (32, 32)


def test_controlnet_scale_on_a_pipeline_without_a_controlnet(tiny_pipeline_folders, tmp_path, capsys, no_worker):
    err = _error(capsys, no_worker, str(tiny_pipeline_folders["flux"]), "--controlnet-scale", "0.5",
                 "--out", str(tmp_path / "out"))
    assert err.startswith("paradiff: error: --controlnet-scale: FluxPipeline's __call__ takes no "
                          "controlnet_conditioning_scale"), err
    assert "FluxControlNetPipeline" in err


def test_controlnet_scale_not_a_finite_number(controlnet_folder, tmp_path, capsys, no_worker):
    err = _error(capsys, no_worker, controlnet_folder, "--controlnet-scale", "nan", "--out", str(tmp_path / "out"))
    assert err == "paradiff: error: --controlnet-scale nan: expected a finite number (1.0: the residuals as trained)"


def test_controlnet_scale_and_control_image_reach_the_call(controlnet_folder, tmp_path, pictures, no_worker):
    argv = ["generate", controlnet_folder, "--control-image", pictures["image"], "--controlnet-scale", "0.6",
            "--tp", "2", "--out", str(tmp_path / "out")]
    assert main(argv) == 0 and len(no_worker) == 1
    kwargs = call_kwargs(build_parser().parse_args(argv))
    assert kwargs["controlnet_conditioning_scale"] == 0.6 and kwargs["control_image"].size == (32, 32)


def test_last_and_reference_images_reach_the_call_where_the_pipeline_takes_them(tiny_pipeline_folders, tmp_path,
                                                                                  pictures, capsys, no_worker):
    wan = str(tiny_pipeline_folders["wan"])
    err = _error(capsys, no_worker, wan, "--last-image", pictures["image"], "--out", str(tmp_path / "out"))
    assert err.startswith("paradiff: error: --last-image: WanPipeline's __call__ takes no last_image"), err
    err = _error(capsys, no_worker, wan, "--pipeline", "WanVACEPipeline", "--reference-image", pictures["text"],
                 "--out", str(tmp_path / "out"))
    assert err.startswith(f"paradiff: error: --reference-image {pictures['text']}: not a readable image"), err
    argv = ["generate", wan, "--pipeline", "WanImageToVideoPipeline", "--image", pictures["image"], "--last-image",
            pictures["mask"], "--ulysses", "2", "--out", str(tmp_path / "out")]
    assert main(argv) == 0 and len(no_worker) == 1
    kwargs = call_kwargs(build_parser().parse_args(argv))
    assert kwargs["last_image"].mode == "RGB" and kwargs["image"].size == kwargs["last_image"].size == (32, 32)
    vace = ["generate", wan, "--pipeline", "WanVACEPipeline", "--reference-image", pictures["image"],
            "--reference-image", pictures["mask"], "--out", str(tmp_path / "out")]
    assert len(call_kwargs(build_parser().parse_args(vace))["reference_images"]) == 2


def test_repeated_image_is_a_list_of_references(tiny_pipeline_folders, tmp_path, pictures):
    argv = ["generate", str(tiny_pipeline_folders["flux2"]), "--image", pictures["image"], "--image",
            pictures["mask"], "--out", str(tmp_path / "out")]
    kwargs = call_kwargs(build_parser().parse_args(argv))
    assert isinstance(kwargs["image"], list) and len(kwargs["image"]) == 2


# --- audio: a Stable Audio pipeline's sound written as WAV by the CLI -----------------------------------------------

import json  # noqa: E402
import wave  # noqa: E402


def _wav_samples(path) -> tuple[int, np.ndarray]:
    with wave.open(str(path), "rb") as handle:
        assert handle.getsampwidth() == 2
        pcm = np.frombuffer(handle.readframes(handle.getnframes()), dtype="<i2")
        return handle.getframerate(), pcm.reshape(-1, handle.getnchannels()).T


@pytest.mark.slow  # runs the `paradiff` command as a subprocess
def test_cli_writes_stable_audio_wav_equal_to_single_process(tmp_path):
    """ulysses2 over the 1 global + 8 audio tokens (uneven shares): the WAV's samples equal diffusers' single-process
    sound within one 16-bit step."""
    import torch
    from diffusers import StableAudioPipeline

    from paradiff.io.outputs import write_wav
    from paradiff_testkit.audio import CALL_KWARGS, SAMPLING_RATE, save_stable_audio

    folder = save_stable_audio(tmp_path / "stable-audio")
    out = tmp_path / "out"
    result = command.run(
        ["-m", "paradiff.cli", "generate", str(folder), "--ulysses", "2", "--prompt",
         CALL_KWARGS["prompt"], "--negative-prompt", CALL_KWARGS["negative_prompt"], "--guidance-scale",
         str(CALL_KWARGS["guidance_scale"]), "--steps", str(CALL_KWARGS["num_inference_steps"]), "--out", str(out)],
        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    entry = report["outputs"]["0"]
    assert entry["kind"] == "audio" and entry["sampling_rate"] == SAMPLING_RATE and entry["seconds"] == 2.0
    assert report["audios"] == {"0": entry["path"]} and report["images"] == {}
    rate, written = _wav_samples(entry["path"])
    reference = StableAudioPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    kwargs = {key: value for key, value in CALL_KWARGS.items() if key != "audio_end_in_s"}  # the default: 2 s
    expected = np.asarray(reference(**kwargs, generator=torch.Generator("cpu").manual_seed(0)).audios[0])
    write_wav(expected, tmp_path / "reference.wav", SAMPLING_RATE)
    _, expected_pcm = _wav_samples(tmp_path / "reference.wav")
    assert rate == SAMPLING_RATE and written.shape == expected_pcm.shape == (2, 32)
    assert np.abs(written.astype(np.int32) - expected_pcm.astype(np.int32)).max() <= 1
    assert np.abs(expected_pcm).max() > 1000  # a real sound, not silence


@pytest.mark.slow  # runs the `paradiff` command as a subprocess
def test_cli_inpaints_with_another_pipeline_class_at_ulysses2(tiny_pipeline_folders, tmp_path, pictures):
    """--pipeline FluxInpaintPipeline on the FLUX.1 text-to-image folder, with --image, --mask and --strength, at
    ulysses2: --compare (diffusers' FluxInpaintPipeline, same inputs, one process) finds the same image."""
    out = tmp_path / "out"
    result = command.run(
        ["-m", "paradiff.cli", "generate", str(tiny_pipeline_folders["flux"]), "--pipeline",
         "FluxInpaintPipeline", "--image", pictures["image"], "--mask", pictures["mask"], "--strength", "0.75",
         "--ulysses", "2", "--steps", "4", "--height", "32", "--width", "32", "--guidance-scale", "3.5",
         "--compare", "--out", str(out)],
        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["ulysses"] == 2 and report["outputs"]["0"]["kind"] == "image"
    assert report["max_abs_diff_vs_single_process"] <= 1e-5


@pytest.mark.parametrize("name,expected", [
    ("FluxPipeline", {"height": 32, "width": 48, "num_inference_steps": 2}),
    ("FluxKontextPipeline", {"height": 32, "width": 48, "num_inference_steps": 2, "max_area": 32 * 48}),
    ("StableAudioPipeline", {"num_inference_steps": 2}),  # a length in seconds, no image size
])
def test_call_arguments_follow_the_pipeline_class(name, expected):
    import diffusers

    from paradiff.api.pipeline import ParallelPipelineMixin
    from paradiff.cli.worker import accepted_kwargs

    base = getattr(diffusers, name)
    parallel = type(f"Parallel{name}", (ParallelPipelineMixin, base), {})  # as load_pipeline makes it
    pipeline = parallel.__new__(parallel)
    assert accepted_kwargs(dict(height=32, width=48, num_inference_steps=2), pipeline) == expected
