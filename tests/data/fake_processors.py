"""Tiny fake encoder processors for the data-plane tests.

A module of its own (not conftest.py): Ray actors and spawned workers unpickle these classes
by module name, and several conftest.py files share that name.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from dataloading.formats.media import MediaItem

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
