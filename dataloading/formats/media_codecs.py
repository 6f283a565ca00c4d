"""Image and audio bytes: header-only metadata, decoding, and the field extension of bytes that
come without a file name. The image and audio declarations (``dataloading.formats.modality``)
name these; a video's are in ``dataloading.formats.video``.

PIL and soundfile are imported when the first such item is met, so ``import dataloading`` stays cheap.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np

_IMAGE_FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}  # PIL's format names -> field extensions


def image_meta(data: bytes) -> dict[str, Any]:
    """``height``, ``width`` from the header; the pixels are not decoded."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        width, height = im.size
    return {"height": int(height), "width": int(width)}


def decode_image(data: bytes) -> np.ndarray:
    """uint8 [H, W, 3] RGB."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def sniff_image(data: bytes) -> str | None:
    """The field extension of image bytes (PIL's format, lower case where Omni has no name for it)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return _IMAGE_FORMATS.get(im.format or "", (im.format or "").lower() or None)


def audio_meta(data: bytes) -> dict[str, Any]:
    """``num_samples``, ``sample_rate`` from the header; the samples are not decoded."""
    import soundfile

    info = soundfile.info(io.BytesIO(data))
    return {"num_samples": int(info.frames), "sample_rate": int(info.samplerate)}


def decode_audio(data: bytes) -> tuple[np.ndarray, int]:
    """(float32 mono waveform [n], sample rate): the channels are averaged."""
    import soundfile

    wave, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return np.ascontiguousarray(wave.mean(axis=1), dtype=np.float32), int(rate)


def sniff_audio(data: bytes) -> str:
    """The field extension of audio bytes (libsndfile's container name, lower case)."""
    import soundfile

    return soundfile.info(io.BytesIO(data)).format.lower()
