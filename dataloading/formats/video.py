"""Video fields (``mp4``, ``webm``): header metadata, evenly spaced frame times, frame decoding.

Decoding uses PyAV (FFmpeg's libraries), an optional extra: ``pip install 'omni-mm[video]'``.
It is imported only when a video is met, so text and image runs never need it, and its absence
is one ``DataError`` line naming the fix.

A sample's video stays encoded until its encoder's processor asks for frames: the processor
decides how many (per-source ``fps`` / ``min_frames`` / ``max_frames`` and its pixel budget), so
a long clip is never held whole in memory. Planning needs only the container's header
(``video_meta``), the same numbers the processor's frame count is computed from, so the index's
token counts equal the processed item's.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataloading.errors import DataError

INSTALL_HINT = "pip install 'omni-mm[video]'"


def require_av() -> Any:
    """The ``av`` module, or a one-line DataError saying how to install it."""
    try:
        import av
    except ImportError:
        raise DataError(f"video fields (mp4, webm) need the PyAV decoder, which is not installed; run "
                        f"`{INSTALL_HINT}` (or drop the video sources)", kind="config") from None
    return av


def _stream(container):
    if not container.streams.video:
        raise ValueError("the container has no video stream")
    return container.streams.video[0]


def video_meta(data: bytes) -> dict[str, Any]:
    """Header-only metadata of a video: ``width``, ``height`` (pixels), ``frames`` (count),
    ``fps`` (average frame rate), ``duration`` (seconds) and ``track``, its audio track's
    (``_track_meta``; None without one). Nothing is decoded.

    Containers that do not store a frame count (WebM) get ``round(duration x fps)``; one without
    a stream duration falls back to the container's."""
    av = require_av()
    with av.open(io.BytesIO(data)) as container:
        s = _stream(container)
        width, height = int(s.codec_context.width), int(s.codec_context.height)
        rate = s.average_rate or s.guessed_rate
        duration = None
        if s.duration is not None and s.time_base is not None:
            duration = float(s.duration * s.time_base)
        elif container.duration is not None:
            duration = container.duration / av.time_base
        frames = int(s.frames or 0)
        if rate is None and duration and frames:
            rate = frames / duration
        if rate is None or not float(rate) > 0:
            raise ValueError("the header gives no frame rate")
        fps = float(rate)
        if duration is None:
            if not frames:
                raise ValueError("the header gives neither a duration nor a frame count")
            duration = frames / fps
        if not frames:
            frames = max(1, round(duration * fps))
        track = _track_meta(container)
    if width < 1 or height < 1 or not duration > 0:
        raise ValueError(f"the header says {width}x{height} pixels and {duration} s")
    return {"width": width, "height": height, "frames": frames, "fps": fps, "duration": duration, "track": track}


def _track_meta(container) -> dict[str, int] | None:
    """The first audio stream's ``num_samples`` and ``sample_rate`` from the header (an audio
    file's metadata, what the audio tower's processor counts tokens from), None without one.
    ``audio_track`` decodes every packet whole, so a codec of fixed frames (AAC: 1024 samples,
    its priming frame included) gives packets x frame size; others the duration x the rate."""
    if not container.streams.audio:
        return None
    s = container.streams.audio[0]
    rate = int(s.rate or s.codec_context.sample_rate or 0)
    frame = int(s.codec_context.frame_size or 0)
    if s.frames and frame:
        n = int(s.frames) * frame
    elif s.duration is not None and s.time_base is not None:
        n = round(float(s.duration * s.time_base) * rate)
    else:
        n = round(container.duration / 1_000_000 * rate) if container.duration else 0
    return {"num_samples": n, "sample_rate": rate} if rate > 0 and n > 0 else None


def sample_count(meta: dict, fps: float, min_frames: int, max_frames: int, multiple: int) -> int:
    """How many frames to sample from a clip: ``round(duration x fps)`` within
    [min_frames, max_frames], never more than the clip holds, then rounded down to a multiple
    of ``multiple`` (a tower's temporal patch), at least one multiple. A clip with fewer frames
    than one multiple repeats its frames (as a still image fills a temporal patch)."""
    n = min(max(round(meta["duration"] * fps), min_frames), max_frames, int(meta["frames"]))
    return max(multiple, n // multiple * multiple)


def frame_times(duration: float, n: int) -> np.ndarray:
    """The times (seconds from the start) of ``n`` frames sampled from a clip: the middle of
    each of ``n`` equal spans, so the samples are evenly spaced and a clip's ends weigh as much
    as its middle. Deterministic: the same clip gives the same frames in every run."""
    return (np.arange(n) + 0.5) * (duration / n)


@dataclass
class Video:
    """An encoded video and its header metadata (``video_meta``), as a decoded sample carries
    it; ``frames(times)`` decodes the frames shown at the given times. Picklable (bytes)."""

    data: bytes
    meta: dict[str, Any]
    # The clip's own audio track, (float32 mono waveform, sample rate), when a model takes it
    # beside the frames (Qwen2.5-Omni's use_audio_in_video: ``audio_track``); None: frames only.
    audio: Any = None

    def frames(self, times) -> list[np.ndarray]:
        """One uint8 [H, W, 3] RGB array per time (seconds from the start, ascending): the frame
        on screen then (the last one whose presentation time is not later; a stream may change
        size midway); times past the last frame get the last frame. Decoding stops once every
        time is served."""
        av = require_av()
        times = np.asarray(times, dtype=np.float64)
        if np.any(np.diff(times) < 0):
            raise ValueError("frame times must be ascending")
        out: list[np.ndarray | None] = [None] * len(times)
        j = 0
        with av.open(io.BytesIO(self.data)) as container:
            s = _stream(container)
            s.thread_type = "AUTO"
            start = float(s.start_time * s.time_base) if s.start_time is not None and s.time_base else 0.0
            prev, prev_rgb = None, None
            for frame in container.decode(s):
                t = (float(frame.time) - start) if frame.time is not None else None
                # A time within a microsecond of a frame's start shows that frame (float rounding).
                while j < len(times) and prev is not None and t is not None and t > times[j] + 1e-6:
                    if prev_rgb is None:
                        prev_rgb = prev.to_ndarray(format="rgb24")
                    out[j] = prev_rgb
                    j += 1
                if j == len(times):
                    break
                prev, prev_rgb = frame, None
            if prev is None:
                raise ValueError("the stream holds no decodable frame")
            last = prev_rgb if prev_rgb is not None else prev.to_ndarray(format="rgb24")
            for k in range(j, len(times)):
                out[k] = last
        return out  # type: ignore[return-value] - every entry is set above


def audio_track(data: bytes) -> tuple[np.ndarray, int] | None:
    """The first audio stream of an encoded video as (float32 mono waveform, sample rate), its
    channels mixed down by FFmpeg's resampler at the stream's own rate; None when the container
    has no audio stream."""
    av = require_av()
    with av.open(io.BytesIO(data)) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        rate = int(stream.rate or stream.codec_context.sample_rate)
        mono = av.AudioResampler(format="flt", layout="mono", rate=rate)
        chunks = [f.to_ndarray().reshape(-1) for frame in container.decode(stream) for f in mono.resample(frame)]
        chunks += [f.to_ndarray().reshape(-1) for f in mono.resample(None)]  # what the resampler still holds
    if not chunks:
        return None
    return np.ascontiguousarray(np.concatenate(chunks), dtype=np.float32), rate


def decode_video(data: bytes) -> Video:
    """A sample's video field as a ``Video``: its header is read now (a corrupt file fails here,
    with the sample named), its frames when the processor samples them."""
    return Video(bytes(data), video_meta(data))


def sniff_video(data: bytes) -> str | None:
    """The field extension of video bytes that come without a file name, from their magic bytes
    (no decoder needed): EBML is Matroska / WebM, an ``ftyp`` box MP4."""
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    return "mp4" if data[4:8] == b"ftyp" else None
