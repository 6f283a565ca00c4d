"""Image preprocessing the vision plugins share: checking the decoded array, resizing it to the
plugin's pixel grid, and normalising it (what each plugin's processor does before cutting
patches in its own layout)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def rgb_uint8(raw: Any, channels: int) -> np.ndarray:
    """A decoded image as uint8 [H, W, channels]: grey is repeated over the channels, an alpha
    channel dropped; anything else is a ValueError naming the shape or dtype."""
    img = np.asarray(raw)
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], channels, axis=2)
    if img.ndim != 3 or img.shape[2] not in (channels, 4):
        raise ValueError(f"image must be an array [H, W, {channels}], got shape {tuple(img.shape)}")
    if img.dtype != np.uint8:
        raise ValueError(f"image must be uint8, got {img.dtype}")
    return img[:, :, :channels]


def resized_normalised(img: np.ndarray, height: int, width: int, mean: Sequence[float] | np.ndarray,
                       std: Sequence[float] | np.ndarray) -> np.ndarray:
    """float32 [height, width, C]: the image resized with PIL's bicubic filter (as transformers'
    image processors resample; skipped when the size already matches), then x/255, then
    (x - mean) / std per channel."""
    if img.shape[:2] != (height, width):
        from PIL import Image

        img = np.asarray(Image.fromarray(np.ascontiguousarray(img)).resize((width, height), Image.BICUBIC))
    mean = np.asarray(mean, dtype=np.float32)
    std = np.asarray(std, dtype=np.float32)
    return (img.astype(np.float32) * np.float32(1 / 255) - mean) / std
