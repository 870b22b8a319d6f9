"""`paradiff generate` on video pipelines: an MP4 and a PNG per frame for each prompt, report.json saying so, and
every frame equal to the single-process pipeline's under tensor x context parallelism."""

from __future__ import annotations

import json
import re

import av
import numpy as np
import pytest
from PIL import Image

import rank_cases_cli as cases
from paradiff.cli.args import CliError, build_parser, check_args
from paradiff.cli.embedded import embedded_default
from paradiff_testkit import command

VIDEO = ["--frames", "5", "--steps", "2", "--height", "32", "--width", "32"]
FAMILIES = ("wan2.2", "hunyuanvideo", "ltx")


@pytest.fixture(scope="module")
def folders(tiny_pipeline_folders):
    return {family: str(tiny_pipeline_folders[family]) for family in FAMILIES}


def _luma(frames: np.ndarray) -> np.ndarray:
    return frames.astype(np.float64) @ np.array([0.299, 0.587, 0.114])


def _decode_mp4(path: str) -> np.ndarray:
    with av.open(path) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def test_videos_under_tp2_ulysses2_equal_the_single_process_videos(pools, folders, tmp_path):
    """Built-in plans, 4 ranks; then 4 prompts as 4 data-parallel replicas (videos made on every rank, one report)."""
    prompts = ["a small red fox running through the snow", "a cat", "a dog", "a red cube"]
    runs = [["generate", folders[family], "--tp", "2", "--ulysses", "2", *VIDEO, "--compare",
             "--out", str(tmp_path / family), "--prompt", prompts[0]] for family in FAMILIES]
    runs.append(["generate", folders["ltx"], "--dp", "4", *VIDEO, "--compare", "--out", str(tmp_path / "ltx-dp4"),
                 *[flag for prompt in prompts for flag in ("--prompt", prompt)]])
    by_rank = pools.get(4).run(cases.generate_each, timeout_s=600, runs=runs)
    for position, family in enumerate([*FAMILIES, "ltx-dp4"]):
        report = by_rank[0][position]["report"]
        assert all(by_rank[rank][position]["report"] is None for rank in (1, 2, 3))
        assert report["config"]["world_size"] == 4 and report["frames"] == 5
        if family != "ltx-dp4":  # the transformer really is split: every rank holds well under all of it
            assert (report["config"]["tp"], report["config"]["ulysses"]) == (2, 2)
            for rank in range(4):
                measured = by_rank[rank][position]
                assert measured["local_params"] < 0.75 * measured["whole_params"], (family, measured)
        assert report["max_abs_diff_vs_single_process"] <= 1e-5, (family, report)
        per_frame = report["max_abs_diff_per_frame_vs_single_process"]
        assert len(per_frame) == 5 and max(per_frame) == report["max_abs_diff_vs_single_process"], family
        assert report["images"] == {}
        # compare.png: rank 0's one video as three rows (first, middle, last frame), each 32 px + 2 px gap enlarged
        # 3x under its 12 px caption, below the 14 px of panel titles
        assert report["compare_png"] == str(tmp_path / family / "compare.png")
        assert Image.open(report["compare_png"]).size == (3 * 34 * 3, 14 + 3 * (12 + 34 * 3)), family
        assert sorted(report["outputs"]) == [str(i) for i in range(len(report["prompts"]))]
        written = json.loads((tmp_path / family / "report.json").read_text())
        for index, entry in report["outputs"].items():
            assert entry["kind"] == "video" and entry["frames"] == 5, entry
            assert entry["prompt"] == report["prompts"][int(index)]
            assert entry["path"] == str(tmp_path / family / f"{int(index):04d}.mp4")
            pngs = np.stack([np.asarray(Image.open(path)) for path in entry["frame_files"]])
            assert pngs.shape == (5, 32, 32, 3)
            video = _decode_mp4(entry["path"])
            assert video.shape == (5, 32, 32, 3)
            # lossy H.264 (4:2:0, so colour is shared between pixels) of the same frames: the brightness is close
            assert np.abs(_luma(video) - _luma(pngs)).mean() < 8, family
            assert written["outputs"][index] == entry


def test_paradiff_generate_command_writes_a_video(folders, tmp_path):
    """The real command (launcher, two workers) on a video pipeline folder."""
    out = tmp_path / "out"
    result = command.run(["-m", "paradiff.cli", "generate", folders["wan2.2"], "--ulysses", "2",
                          *VIDEO, "--fps", "8", "--out", str(out)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 video(s) (5 frames)" in result.stdout
    report = json.loads((out / "report.json").read_text())
    entry = report["outputs"]["0"]
    assert entry["kind"] == "video" and entry["fps"] == 8 and len(entry["frame_files"]) == 5
    with av.open(entry["path"]) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == 8 and (stream.width, stream.height) == (32, 32)
        assert sum(1 for _ in container.decode(video=0)) == 5


def test_frames_needs_a_video_pipeline(tmp_path):
    """Refused before any process starts, naming the pipeline."""
    image_folder = embedded_default()
    for model, message in ((None, "the embedded default pipeline makes images"),
                           (str(image_folder), "makes images (its pipeline's __call__ takes no num_frames)")):
        args = build_parser().parse_args(["generate", *([model] if model else []), "--frames", "5",
                                          "--out", str(tmp_path)])
        with pytest.raises(CliError, match=re.escape(message)):
            check_args(args)


def test_sound_is_written_as_wav_beside_the_video_and_alone(tmp_path):
    """LTX-2 returns `.frames` and `.audio`; audio pipelines `.audios`: each sound becomes a 16-bit WAV at the
    pipeline's sampling rate (its vocoder's config here), and an unknown rate is refused with the reason."""
    import wave
    from types import SimpleNamespace

    from paradiff.io.outputs import outputs_of, sampling_rate, save_output

    rng = np.random.default_rng(0)
    sound = rng.uniform(-1, 1, size=(2, 2, 480)).astype(np.float32)  # batch, channels, samples
    video = SimpleNamespace(frames=rng.uniform(0, 1, size=(2, 3, 16, 16, 3)), audio=sound)
    pipeline = SimpleNamespace(vocoder=SimpleNamespace(config={"output_sampling_rate": 24000}))
    rate = sampling_rate(pipeline)
    assert rate == 24000 and sampling_rate(SimpleNamespace()) is None
    entries = [save_output(output, tmp_path, index, 8, rate) for index, output in enumerate(outputs_of(video))]
    assert [e["kind"] for e in entries] == ["video", "video"] and entries[1]["audio_path"].endswith("0001.wav")
    with wave.open(entries[1]["audio_path"]) as handle:
        assert (handle.getnchannels(), handle.getframerate(), handle.getnframes()) == (2, 24000, 480)
        pcm = np.frombuffer(handle.readframes(480), dtype="<i2").reshape(480, 2).T
    np.testing.assert_allclose(pcm / 32767, sound[1], atol=1 / 32767)

    (only,) = outputs_of(SimpleNamespace(audios=sound[:1]))
    assert only.kind == "audio"
    entry = save_output(only, tmp_path, 5, 8, 16000)
    assert entry["path"].endswith("0005.wav") and entry["seconds"] == 480 / 16000
    with pytest.raises(RuntimeError, match="names no sampling rate"):
        save_output(only, tmp_path, 6, 8, None)
    with pytest.raises(TypeError, match="none of .frames"):
        outputs_of(SimpleNamespace(latents=sound))
