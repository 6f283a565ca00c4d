"""Image preprocessing the vision plugins share: checking the decoded array, resizing it to the
plugin's pixel grid, and normalising it (what each plugin's processor does before cutting
patches in its own layout)."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

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


def resized(img: np.ndarray, height: int, width: int, resample: str = "bicubic") -> np.ndarray:
    """uint8 [height, width, C]: the image resized with PIL's ``resample`` filter (bicubic or
    bilinear), as transformers' image processors resample (most bicubic, SigLIP2's bilinear);
    the same array when the size already matches."""
    if img.shape[:2] == (height, width):
        return img
    from PIL import Image

    filters = {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR}
    if resample not in filters:
        raise ValueError(f"resample {resample!r} is not one of {', '.join(filters)}")
    return np.asarray(Image.fromarray(np.ascontiguousarray(img)).resize((width, height), filters[resample]))


def normalised(img: np.ndarray, mean: Sequence[float] | np.ndarray, std: Sequence[float] | np.ndarray) -> np.ndarray:
    """float32 [H, W, C]: x/255, then (x - mean) / std per channel."""
    mean = np.asarray(mean, dtype=np.float32)
    std = np.asarray(std, dtype=np.float32)
    return (img.astype(np.float32) * np.float32(1 / 255) - mean) / std


def resized_normalised(img: np.ndarray, height: int, width: int, mean: Sequence[float] | np.ndarray,
                       std: Sequence[float] | np.ndarray, resample: str = "bicubic") -> np.ndarray:
    """float32 [height, width, C]: ``resized``, then ``normalised``."""
    return normalised(resized(img, height, width, resample), mean, std)


def padded_to_square(img: np.ndarray, colour: Sequence[int]) -> np.ndarray:
    """uint8 [S, S, C] with S the longer side: the image centred on a ``colour`` background
    (LLaVA-1.5's ``image_aspect_ratio: pad``, transformers' ``LlavaImageProcessor(do_pad=True)``;
    the offset rounds down, as there)."""
    h, w, c = img.shape
    if h == w:
        return img
    side = max(h, w)
    out = np.empty((side, side, c), dtype=img.dtype)
    out[:] = np.asarray(colour, dtype=img.dtype)
    top, left = (side - h) // 2, (side - w) // 2
    out[top:top + h, left:left + w] = img
    return out


def shortest_edge_size(height: int, width: int, edge: int) -> tuple[int, int]:
    """(height, width) with the shorter side ``edge`` and the longer one scaled by the same
    factor, rounded down (transformers' ``get_resize_output_image_size(default_to_square=False)``)."""
    if height < 1 or width < 1:
        raise ValueError(f"image has no pixels ({height}x{width})")
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(edge * long / short)
    return (new_long, edge) if width <= height else (edge, new_long)


def center_cropped(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """[height, width, C]: the centre of the image (offsets rounded down); a side shorter than
    the crop is first padded with zeros around the image (offsets rounded up), as transformers'
    ``center_crop`` does."""
    h, w = img.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return img[top:top + height, left:left + width]
    nh, nw = max(height, h), max(width, w)
    pad_top, pad_left = -(-(nh - h) // 2), -(-(nw - w) // 2)
    out = np.zeros((nh, nw, *img.shape[2:]), dtype=img.dtype)
    out[pad_top:pad_top + h, pad_left:pad_left + w] = img
    top, left = top + pad_top, left + pad_left
    return out[max(0, top):min(nh, top + height), max(0, left):min(nw, left + width)]


def normalisation_params(pp_config: Mapping[str, Any]) -> Dict[str, Any]:
    """``image_mean`` / ``image_std`` of a ``preprocessor_config.json``, where it lists them."""
    return {k: list(pp_config[k]) for k in ("image_mean", "image_std") if isinstance(pp_config.get(k), list)}


BICUBIC = 3  # PIL's (and transformers' PILImageResampling) code for bicubic resampling


def refuse_unsupported_steps(pp: Mapping[str, Any], who: str,
                             steps: Sequence[str] = ("do_resize", "do_rescale", "do_normalize")) -> None:
    """A ValueError naming the key for a preprocessor_config.json whose steps a fixed-square
    processor (``who``, for the message) does not follow: one of ``steps`` switched off, another
    resampling than bicubic, another rescale than 1/255."""
    for key in steps:
        if pp.get(key) is False:
            raise ValueError(f"preprocessor_config.json: {key}=false is not supported by {who}")
    if pp.get("resample", BICUBIC) != BICUBIC:
        raise ValueError(f"preprocessor_config.json: resample={pp['resample']} is not supported (bicubic, 3, is)")
    if abs(float(pp.get("rescale_factor", 1 / 255)) - 1 / 255) > 1e-12:
        raise ValueError(f"preprocessor_config.json: rescale_factor={pp['rescale_factor']} is not supported (1/255 is)")


def checked_mean_std(mean: Sequence[float], std: Sequence[float], channels: int,
                     key: str = "num_channels") -> tuple[list[float], list[float]]:
    """A config's ``image_mean`` / ``image_std`` as floats, one per channel (``key``: the
    config's name of the channel count, for the message)."""
    mean, std = [float(v) for v in mean], [float(v) for v in std]
    if len(mean) != channels or len(std) != channels:
        raise ValueError(f"image_mean and image_std need {channels} values ({key})")
    return mean, std
