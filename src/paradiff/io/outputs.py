"""What a pipeline call produced, and the files written for it (by `paradiff generate`; `paradiff serve` sends the
same PNG / MP4 bytes): a PNG per image; an MP4 plus a PNG per frame for a
video; a WAV per sound (audio pipelines, and the soundtrack of audio + video pipelines such as LTX-2).

A pipeline's result is told apart by its fields, not by its class: diffusers' video pipelines (Wan, HunyuanVideo,
LTX, CogVideoX, ...) return `.frames`, shaped (batch, frames, height, width, channels) with output_type="np"; image
pipelines return `.images`; audio pipelines (Stable Audio, ...) `.audios`, shaped (batch, channels, samples); LTX-2
returns `.frames` and `.audio`. Modular Diffusers pipelines return their state, whose `images` or `videos` (same
layouts) are read alike.
"""

from __future__ import annotations

import wave
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

# MP4 codecs in order of preference; PyAV's wheels ship libx264.
_CODECS = ("libx264", "h264", "mpeg4")
# Where diffusers' audio components keep their output sampling rate, in order of preference.
_RATE_KEYS = ("output_sampling_rate", "sampling_rate", "sample_rate")


class Output(NamedTuple):
    kind: str  # "image", "video" or "audio"
    array: np.ndarray  # (H, W, C); (F, H, W, C); (channels, samples) for "audio"
    audio: np.ndarray | None = None  # a video's soundtrack, (channels, samples)


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().float().cpu().numpy()
    return np.asarray(value)


def outputs_of(result) -> list[Output]:
    """Every item of a pipeline result (one per prompt of a batched call)."""
    frames = getattr(result, "frames", None)
    if frames is None:  # a Modular Diffusers pipeline's state holds them as `videos`
        frames = getattr(result, "videos", None)
    if frames is not None:
        sound = getattr(result, "audio", None)
        return [Output("video", _numpy(item), None if sound is None else _numpy(sound[number]))
                for number, item in enumerate(frames)]
    images = getattr(result, "images", None)
    if images is not None:
        return [Output("image", _numpy(item)) for item in images]
    audios = getattr(result, "audios", None)
    if audios is not None:
        return [Output("audio", _numpy(item)) for item in audios]
    raise TypeError(f"the pipeline returned a {type(result).__name__}, which has none of .frames (a video), .images "
                    "(an image) or .audios (a sound); paradiff generate can only save those")


def first_output(result) -> Output:
    """The first item of a pipeline result."""
    return outputs_of(result)[0]


def sampling_rate(pipeline) -> int | None:
    """The rate of the pipeline's audio output: its `audio_sampling_rate`, else the vocoder's or the (audio) VAE's
    config; None when the pipeline makes no sound."""
    rate = getattr(pipeline, "audio_sampling_rate", None)
    for name in ("vocoder", "audio_vae", "vae"):
        config = getattr(getattr(pipeline, name, None), "config", None)
        if rate is None and config is not None:
            rate = next((config[key] for key in _RATE_KEYS if key in config), None)
    return int(rate) if rate is not None else None


def write_wav(samples: np.ndarray, path: Path, rate: int) -> None:
    """16-bit PCM WAV from float samples in [-1, 1], shaped (channels, samples) or (samples,)."""
    samples = np.atleast_2d(np.asarray(samples, dtype=np.float64))
    pcm = (np.clip(samples, -1.0, 1.0) * 32767).round().astype("<i2")
    with wave.open(str(path), "wb") as handle:
        handle.setnchannels(pcm.shape[0])
        handle.setsampwidth(2)
        handle.setframerate(rate)
        handle.writeframes(np.ascontiguousarray(pcm.T).tobytes())


def to_uint8(array: np.ndarray) -> np.ndarray:
    return (np.clip(array, 0, 1) * 255).round().astype("uint8")


def png_bytes(array: np.ndarray) -> bytes:
    """The PNG file of one image (H, W, C) in [0, 1], as `paradiff generate` writes it and `paradiff serve` sends it."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(to_uint8(array)).save(buffer, format="png")
    return buffer.getvalue()


def save_output(output: Output, out: Path, index: int, fps: int, rate: int | None = None,
                suffix: str = "") -> dict:
    """Write one output of prompt `index` under `out` (files named NNNN`suffix`.png ...); returns its report entry
    (kind, frame count, paths)."""
    from PIL import Image

    stem = f"{index:04d}{suffix}"
    if output.kind == "audio" or output.audio is not None:
        if rate is None:
            raise RuntimeError("the pipeline returned sound but names no sampling rate (no audio_sampling_rate, and "
                               "no sampling_rate in its vocoder's or VAE's config)")
    if output.kind == "audio":
        path = out / f"{stem}.wav"
        write_wav(output.array, path, rate)
        return {"kind": "audio", "path": str(path), "sampling_rate": rate,
                "seconds": output.array.shape[-1] / rate}
    if output.kind == "image":
        path = out / f"{stem}.png"
        path.write_bytes(png_bytes(output.array))
        return {"kind": "image", "frames": 1, "path": str(path)}
    frames = to_uint8(output.array)
    folder = out / f"{stem}_frames"
    folder.mkdir(exist_ok=True)
    frame_files = []
    for number, frame in enumerate(frames):
        frame_files.append(str(folder / f"{number:04d}.png"))
        Image.fromarray(frame).save(frame_files[-1])
    video = out / f"{stem}.mp4"
    write_mp4(frames, video, fps)
    entry = {"kind": "video", "frames": len(frames), "path": str(video), "fps": fps, "frame_files": frame_files}
    if output.audio is not None:
        entry["audio_path"] = str(out / f"{stem}.wav")
        entry["sampling_rate"] = rate
        write_wav(output.audio, Path(entry["audio_path"]), rate)
    return entry


def mp4_bytes(frames: np.ndarray, fps: int) -> bytes:
    """The MP4 file of float frames (F, H, W, 3) in [0, 1], in memory (what `paradiff serve` sends)."""
    import io

    buffer = io.BytesIO()
    write_mp4(to_uint8(frames), buffer, fps)
    return buffer.getvalue()


def write_mp4(frames: np.ndarray, path: Any, fps: int) -> None:
    """Encode uint8 RGB frames (F, H, W, 3) as an H.264 MP4 (yuv420p, which most players need) into a file path or a
    binary buffer."""
    import av

    codec = next((name for name in _CODECS if name in av.codecs_available), None)
    if codec is None:
        raise RuntimeError(f"no MP4 video encoder in this PyAV build; tried {list(_CODECS)}")
    height, width = frames.shape[1:3]
    target = str(path) if isinstance(path, (str, Path)) else path
    with av.open(target, mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "18"}  # near-transparent quality; the default (23) smears tiny frames
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())  # flush the encoder's delayed frames
