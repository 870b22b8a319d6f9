"""What a pipeline call produced, and the files written for it: a PNG per image; an MP4 plus a PNG per frame for a
video.

A pipeline's result is told apart by its fields, not by its class: diffusers' video pipelines (Wan, HunyuanVideo,
LTX, CogVideoX, ...) return `.frames`, shaped (batch, frames, height, width, channels) with output_type="np"; image
pipelines return `.images`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# MP4 codecs in order of preference; PyAV's wheels ship libx264.
_CODECS = ("libx264", "h264", "mpeg4")


def first_output(result) -> tuple[str, np.ndarray]:
    """("video", frames of shape (F, H, W, C)) or ("image", (H, W, C)): the first item of a pipeline result."""
    frames = getattr(result, "frames", None)
    if frames is not None:
        return "video", np.asarray(frames[0])
    images = getattr(result, "images", None)
    if images is not None:
        return "image", np.asarray(images[0])
    raise TypeError(f"the pipeline returned a {type(result).__name__}, which has neither .frames (a video) nor "
                    ".images (an image); paradiff generate can only save those")


def outputs_of(result) -> list[tuple[str, np.ndarray]]:
    """Every item of a pipeline result (one per prompt of a batched call), each as `first_output` gives it."""
    frames = getattr(result, "frames", None)
    if frames is not None:
        return [("video", np.asarray(item)) for item in frames]
    images = getattr(result, "images", None)
    if images is not None:
        return [("image", np.asarray(item)) for item in images]
    return [first_output(result)]  # raises with the reason


def to_uint8(array: np.ndarray) -> np.ndarray:
    return (np.clip(array, 0, 1) * 255).round().astype("uint8")


def save_output(kind: str, array: np.ndarray, out: Path, index: int, fps: int) -> dict:
    """Write one output of prompt `index` under `out`; returns its report entry (kind, frame count, paths)."""
    from PIL import Image

    if kind == "image":
        path = out / f"{index:04d}.png"
        Image.fromarray(to_uint8(array)).save(path)
        return {"kind": "image", "frames": 1, "path": str(path)}
    frames = to_uint8(array)
    folder = out / f"{index:04d}_frames"
    folder.mkdir(exist_ok=True)
    frame_files = []
    for number, frame in enumerate(frames):
        frame_files.append(str(folder / f"{number:04d}.png"))
        Image.fromarray(frame).save(frame_files[-1])
    video = out / f"{index:04d}.mp4"
    write_mp4(frames, video, fps)
    return {"kind": "video", "frames": len(frames), "path": str(video), "fps": fps, "frame_files": frame_files}


def write_mp4(frames: np.ndarray, path: Path, fps: int) -> None:
    """Encode uint8 RGB frames (F, H, W, 3) as an H.264 MP4 (yuv420p, which most players need)."""
    import av

    codec = next((name for name in _CODECS if name in av.codecs_available), None)
    if codec is None:
        raise RuntimeError(f"no MP4 video encoder in this PyAV build; tried {list(_CODECS)}")
    height, width = frames.shape[1:3]
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "18"}  # near-transparent quality; the default (23) smears tiny frames
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())  # flush the encoder's delayed frames
