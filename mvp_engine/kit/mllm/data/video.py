"""Video access for the DataKit: container metadata for planning, the chosen frames decoded for encoding.

A video is a file PyAV (FFmpeg) demuxes, or a frame folder: its image files, sorted by name with numbers compared
as numbers (``frame_2`` before ``frame_10``), are the frames, and its frame rate is the record's ``fps``, else
:data:`DEFAULT_FRAME_FOLDER_FPS`.

:func:`read_video_info` reads what planning needs without decoding a pixel: for a file the video stream's header
(frame count, average rate, width, height), for a folder its file list and the first frame's image header. Where
the container has no frame count (WebM and Matroska write none) or one its own duration and rate contradict, the
frames are counted by demuxing packets (the file is read, nothing is decoded); a frame rate missing from the header
is derived from the count and the duration.

:func:`load_video_frames` decodes the chosen frames as transformers' PyAV reader does (every frame up to the last
chosen one is decoded, only the chosen ones are converted to RGB). Frames are used as stored: a display-matrix
rotation is not applied (PyAV exposes it only on decoded frames, and transformers' reader ignores it too), so the
size ``measure`` reads is the size ``encode`` gets.

Failures are :class:`MLLMRecordError` s whose message starts with the path: ``missing_video``, ``unreadable_video``
(no header, no video stream, no frame rate, a frame folder without images), ``corrupt_video`` (a frame that does
not decode) and ``video_measure_mismatch`` (the file yields fewer frames than its header promised, so the frames
sampled - and the tokens planned - cannot be produced).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import av
from PIL import Image

from .images import load_image, read_image_size
from .members import open_media
from .sources import MLLMRecordError

DEFAULT_FRAME_FOLDER_FPS = 2.0  # Qwen's sampling rate: by default a folder's frames are all kept, as given
_AV_ERRORS = (av.FFmpegError, OSError, ValueError)


@dataclass(frozen=True)
class VideoInfo:
    """What a video is, read from metadata only: ``num_frames`` frames at ``fps``, each ``width`` x ``height``;
    ``frame_files`` are a frame folder's images in frame order (empty for a video file)."""

    path: str
    num_frames: int
    fps: float
    width: int
    height: int
    frame_files: tuple[str, ...] = ()


def read_video_info(path: str | os.PathLike, fps: float | None = None) -> VideoInfo:
    """The video's :class:`VideoInfo`, from headers only; ``fps`` is a frame folder's rate (a file has its own)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return _folder_info(path, fps or DEFAULT_FRAME_FOLDER_FPS)
    try:
        with av.open(open_media(path)) as container:
            if not container.streams.video:
                raise MLLMRecordError(f"{path}: cannot read video header: no video stream", "unreadable_video")
            stream = container.streams.video[0]
            rate = float(stream.average_rate) if stream.average_rate else None
            duration = _duration(stream, container)
            frames = stream.frames
            if frames <= 0 or (rate and duration and abs(frames - duration * rate) > 1 + 0.01 * frames):
                frames = sum(1 for packet in container.demux(stream) if packet.size)
            width, height = stream.codec_context.width, stream.codec_context.height
    except MLLMRecordError:
        raise
    except _AV_ERRORS as exc:
        raise _video_error(path, "read video header", exc, "unreadable_video") from None
    rate = rate or (frames / duration if duration else None)
    if not frames or not rate or width <= 0 or height <= 0:
        raise MLLMRecordError(f"{path}: cannot read video header: {frames} frames at {rate} fps, {width}x{height}",
                              "unreadable_video")
    return VideoInfo(path, frames, rate, width, height)


def load_video_frames(info: VideoInfo, indices: list[int]) -> list[Image.Image]:
    """The frames at ``indices`` (increasing) as RGB images, decoded."""
    if info.frame_files:
        try:
            return [load_image(info.frame_files[i]) for i in indices]
        except MLLMRecordError as err:
            raise MLLMRecordError(f"{info.path}: cannot load frame: {err}", "corrupt_video") from None
    wanted, frames = set(indices), {}
    try:
        with av.open(open_media(info.path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    frames[i] = frame.to_image()
                if len(frames) == len(wanted):
                    break
    except _AV_ERRORS as exc:
        raise _video_error(info.path, "decode video", exc, "corrupt_video") from None
    missing = sorted(wanted - set(frames))
    if missing:
        raise MLLMRecordError(f"{info.path}: the header promised {info.num_frames} frames but frame {missing[0]} "
                              f"(of the {len(indices)} sampled) does not decode", "video_measure_mismatch")
    return [frames[i] for i in indices]


def _duration(stream, container) -> float | None:
    """Seconds, from the stream's header, else the container's; None when neither says."""
    if stream.duration is not None and stream.time_base:
        return float(stream.duration * stream.time_base)
    return container.duration / av.time_base if container.duration else None


def _folder_info(path: str, fps: float) -> VideoInfo:
    files = sorted((entry.path for entry in os.scandir(path)
                    if entry.is_file() and not entry.name.startswith(".") and _is_image_name(entry.name)),
                   key=lambda name: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", os.path.basename(name))])
    if not files:
        raise MLLMRecordError(f"{path}: cannot read video header: frame folder has no image files", "unreadable_video")
    try:
        width, height = read_image_size(files[0])
    except MLLMRecordError as err:
        raise MLLMRecordError(f"{path}: cannot read video header: {err}", "unreadable_video") from None
    return VideoInfo(path, len(files), fps, width, height, tuple(files))


def _is_image_name(name: str) -> bool:
    Image.init()
    return Image.registered_extensions().get(os.path.splitext(name)[1].lower()) in Image.OPEN


def _video_error(path: str, action: str, exc: Exception, reason: str) -> MLLMRecordError:
    """The error for a video PyAV refused; a missing file keeps its own reason."""
    if isinstance(exc, FileNotFoundError):
        reason = "missing_video"
    return MLLMRecordError(f"{path}: cannot {action}: {exc}", reason)
