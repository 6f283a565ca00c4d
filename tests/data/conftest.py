"""Fixtures for the data-plane tests: tiny fake encoder processors and small datasets."""
from __future__ import annotations

import io

import numpy as np
import pytest

from fake_processors import FakeAudioProcessor, FakeImageProcessor  # noqa: F401 - also importable by name


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
