"""Fixtures for the data-plane tests: tiny fake encoder processors and small datasets."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from dataloading.media import MediaItem

PATCH = 8
FRAME = 160


def _grid(h: int, w: int) -> tuple[int, int]:
    return max(1, round(h / PATCH)), max(1, round(w / PATCH))


class FakeImageProcessor:
    """Resize to multiples of 8, cut 8x8 patches; one LLM token per patch."""

    modality = "image"

    def __call__(self, raw):
        from PIL import Image

        gh, gw = _grid(*raw.shape[:2])
        im = np.asarray(Image.fromarray(raw).resize((gw * PATCH, gh * PATCH)), dtype=np.float32) / 255.0
        patches = im.reshape(gh, PATCH, gw, PATCH, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, -1)
        return MediaItem(torch.from_numpy(np.ascontiguousarray(patches)), (gh, gw), gh * gw)

    def num_tokens_from_meta(self, meta):
        gh, gw = _grid(meta["height"], meta["width"])
        return gh * gw


class FakeAudioProcessor:
    """Frames of 160 samples (zero-padded); one LLM token per frame."""

    modality = "audio"

    def __call__(self, raw):
        wave, _rate = raw
        n = max(1, math.ceil(len(wave) / FRAME))
        frames = np.zeros(n * FRAME, dtype=np.float32)
        frames[: len(wave)] = wave
        return MediaItem(torch.from_numpy(frames.reshape(n, FRAME)), (n,), n)

    def num_tokens_from_meta(self, meta):
        return max(1, math.ceil(meta["num_samples"] / FRAME))


@pytest.fixture(scope="session")
def processors():
    return {"image": FakeImageProcessor(), "audio": FakeAudioProcessor()}


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    from dataloading.demo import write_demo_dataset

    return write_demo_dataset(tmp_path_factory.mktemp("demo"), seed=0, scale=0.04, progress=False)


def png_bytes(h: int, w: int, value: int = 128) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (value, value // 2, 255 - value)).save(buf, format="PNG")
    return buf.getvalue()


def wav_bytes(n: int, rate: int = 16000) -> bytes:
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, np.linspace(-0.5, 0.5, n), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="session")
def media_bytes():
    """(png_bytes, wav_bytes) factories."""
    return png_bytes, wav_bytes
