"""Media written in tests: short video clips encoded with PyAV."""
from __future__ import annotations

import io

import numpy as np


def clip_bytes(fmt: str = "mp4", codec: str = "mpeg4", frames: int = 20, rate: int = 10, height: int = 32,
               width: int = 48, texture_seed: int | None = None) -> bytes:
    """A clip whose frame i has red 10 + 12 i (mod 256), so a decoded frame of the first 20 tells
    its index; grey-green elsewhere, or (``texture_seed``) random green and blue, so that a
    vision tower's output depends on where it looks."""
    import av

    rng = None if texture_seed is None else np.random.default_rng(texture_seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            img = np.full((height, width, 3), 40, np.uint8)
            if rng is not None:
                img[..., 1:] = rng.integers(0, 256, size=(height, width, 2), dtype=np.uint8)
            img[..., 0] = (10 + 12 * i) % 256
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def clip_with_audio_bytes(seconds: float = 3.0, rate: int = 10, height: int = 56, width: int = 84,
                          hz: float = 440.0, sample_rate: int = 16000, texture_seed: int = 0) -> bytes:
    """An MP4 of ``seconds`` of textured frames (``clip_bytes``'s) and an AAC audio track of a
    ``hz`` tone (mono, ``sample_rate``)."""
    import av

    rng = np.random.default_rng(texture_seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        video = container.add_stream("mpeg4", rate=rate)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio = container.add_stream("aac", rate=sample_rate, layout="mono")
        for i in range(int(seconds * rate)):
            img = np.full((height, width, 3), 40, np.uint8)
            img[..., 1:] = rng.integers(0, 256, size=(height, width, 2), dtype=np.uint8)
            img[..., 0] = (10 + 12 * i) % 256
            for packet in video.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        t = np.arange(int(seconds * sample_rate), dtype=np.float32) / sample_rate
        wave = (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
        step = 1024
        for lo in range(0, len(wave), step):
            frame = av.AudioFrame.from_ndarray(wave[None, lo:lo + step], format="fltp", layout="mono")
            frame.sample_rate = sample_rate
            for packet in audio.encode(frame):
                container.mux(packet)
        for stream in (video, audio):
            for packet in stream.encode():
                container.mux(packet)
    return buf.getvalue()
