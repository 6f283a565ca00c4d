"""What Qwen2-VL's and Qwen2.5-VL's image processor makes of an image or a video: the pixel
budget (``smart_resize``) and the patches in merge-window order (``QwenVisionProcessor``), run
by the data-loading workers and counted by the planner from metadata alone. The tower is
``omni.models.encoders.qwen_vl``.
"""
from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import numpy as np
import torch

from dataloading.formats.media import MediaItem
from dataloading.formats.video import frame_times, sample_count
from omni.models.encoders.images import resized_normalised, rgb_uint8

if TYPE_CHECKING:  # the config's home is the tower's module, which imports this one
    from omni.models.encoders.qwen_vl import QwenVisionConfig


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> Tuple[int, int]:
    """The (height, width) in pixels Qwen's image processor resizes an image to: both sides
    multiples of ``factor`` (patch x merge), the aspect ratio kept as nearly as rounding allows,
    the area within [min_pixels, max_pixels] (scaled down with floor, up with ceil)."""
    if height < 1 or width < 1:
        raise ValueError(f"image has no pixels ({height}x{width})")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image of {height}x{width} has an aspect ratio over 200, which Qwen's processor refuses")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


class QwenVisionProcessor:
    """uint8 [H, W, C] image -> patches [grid_h*grid_w, C*T*P*P] in merge-window order, size
    (1, grid_h, grid_w): resized by ``smart_resize`` (PIL bicubic, only when the size changes),
    x/255, normalised, the frame repeated ``temporal_patch_size`` times (one temporal patch),
    each patch flattened as (channel, frame, row, col).

    A video (``video``, a ``dataloading.formats.video.Video``) becomes one item of ``t`` temporal
    patches, as in Qwen2-VL: ``n`` frames sampled at evenly spaced times (``fps`` frames per
    second within [``min_frames``, ``max_frames``], a multiple of ``temporal_patch_size``),
    every frame resized alike by ``smart_resize`` within the per-frame limits and the
    ``max_video_pixels`` budget for the whole clip (n x height x width after resizing; fewer
    frames, down to ``min_frames``, when even frames resized to ``min_pixels`` do not fit), then
    consecutive frames grouped by ``temporal_patch_size`` and each temporal patch laid out as an
    image's: size (t, grid_h, grid_w), t = n / temporal_patch_size."""

    modality = "image"

    def __init__(self, config: QwenVisionConfig, resume_after_largest: bool = False):
        # Where text resumes after a video (``rope_grid``'s fifth field): past its grid (Qwen2-VL,
        # Qwen2.5-VL), or past its largest position (Qwen2.5-Omni's TMRoPE, whose timed frames
        # can outrun the grid): dataloading.construct.positions.mrope_position_ids
        self.resume_after_largest = resume_after_largest
        # Whether the family interleaves a video's own audio track with its frames, and how: in
        # chunks of track_chunk_positions rotary positions (Qwen2.5-Omni: seconds_per_chunk 2 at
        # tokens_per_second), or token by token by time with 0 (Qwen3-Omni's processor sets it)
        self.takes_track = resume_after_largest
        self.track_chunk_positions = 2.0 * config.tokens_per_second if resume_after_largest else 0.0
        self.video_audio = False  # a source's ``video: {audio: true}``: each clip's own track beside its frames
        self.patch = config.patch_size
        self.merge = config.spatial_merge
        self.frames = config.temporal_patch_size
        self.channels = config.in_channels
        self.min_pixels = config.min_pixels
        self.max_pixels = config.max_pixels
        self.mean = np.asarray(config.image_mean, dtype=np.float32)
        self.std = np.asarray(config.image_std, dtype=np.float32)
        # Qwen2.5-VL spaces a video's temporal positions by time; Qwen2-VL by temporal patch.
        self.tokens_per_second = float(config.tokens_per_second) if config.variant == "qwen2_5_vl" else None
        # Video sampling, Qwen2-VL's defaults: 2 frames a second, 4 to 768 of them, and at most
        # 24576 merge groups' worth of pixels per clip (24576 x 28 x 28 for 14-pixel patches).
        self.fps = 2.0
        self.min_frames = 2 * self.frames
        self.max_frames = 768 // self.frames * self.frames
        self.max_video_pixels = 24576 * (self.patch * self.merge) ** 2

    def with_options(self, max_pixels: Optional[int] = None, min_pixels: Optional[int] = None,
                     fps: Optional[float] = None, min_frames: Optional[int] = None, max_frames: Optional[int] = None,
                     max_video_pixels: Optional[int] = None, audio: Optional[bool] = None) -> "QwenVisionProcessor":
        """A copy with one data source's settings: the pixel budget of an image or a video frame
        (mixture file ``image:`` options), video sampling and a clip's own audio track (``video:``
        options)."""
        other = copy.copy(self)
        if audio is not None:
            if audio and not self.takes_track:
                raise ValueError("audio: a video's own audio track goes beside its frames only in a model that "
                                 "interleaves them (the Qwen2.5-Omni and Qwen3-Omni thinkers)")
            other.video_audio = bool(audio)
        other.max_pixels = int(max_pixels) if max_pixels is not None else self.max_pixels
        other.min_pixels = int(min_pixels) if min_pixels is not None else min(self.min_pixels, other.max_pixels)
        side = self.patch * self.merge
        if not side * side <= other.min_pixels <= other.max_pixels:
            raise ValueError(f"need {side * side} <= min_pixels ({other.min_pixels}) <= max_pixels ({other.max_pixels})")
        other.fps = float(fps) if fps is not None else self.fps
        other.max_frames = int(max_frames) if max_frames is not None else self.max_frames
        other.min_frames = int(min_frames) if min_frames is not None else min(self.min_frames, other.max_frames)
        other.max_video_pixels = int(max_video_pixels) if max_video_pixels is not None else self.max_video_pixels
        t = self.frames
        if not other.fps > 0:
            raise ValueError(f"fps must be > 0, got {other.fps}")
        if other.min_frames % t or other.max_frames % t or not t <= other.min_frames <= other.max_frames:
            raise ValueError(f"need min_frames ({other.min_frames}) <= max_frames ({other.max_frames}), both "
                             f"multiples of the tower's temporal patch ({t} frames)")
        return other

    def grid(self, height: int, width: int) -> Tuple[int, int]:
        h, w = smart_resize(int(height), int(width), self.patch * self.merge, self.min_pixels, self.max_pixels)
        return h // self.patch, w // self.patch

    def video_grid(self, meta: Dict[str, Any]) -> Tuple[int, int, int]:
        """(frames sampled, grid_h, grid_w) of a video from its header metadata
        (``dataloading.formats.video.video_meta``): what ``video`` makes of it and the planner counts."""
        t, side = self.frames, self.patch * self.merge
        height, width, budget = int(meta["height"]), int(meta["width"]), self.max_video_pixels
        wanted = sample_count(meta, self.fps, self.min_frames, self.max_frames, t)
        least = min(wanted, self.min_frames)  # a clip shorter than min_frames has fewer
        # The smallest frame: a frame's pixel limit never goes below min_pixels (as in Qwen).
        sh, sw = smart_resize(height, width, side, self.min_pixels, self.min_pixels)
        n = min(wanted, budget // (sh * sw) // t * t)  # no more frames than fit at the smallest size
        if n < least:
            raise ValueError(f"a {width}x{height} video of {meta['duration']:.3g} s needs at least {least} frames of "
                             f"{sw}x{sh} pixels ({least * sh * sw} pixels) but max_video_pixels is {budget}; raise "
                             f"video.max_video_pixels (or lower video.min_frames) for its source in the mixture")
        share = max(self.min_pixels, min(self.max_pixels, budget // n))
        h, w = smart_resize(height, width, side, self.min_pixels, share)
        if n * h * w > budget:  # rounding kept a side at one merge group, or scaled the frame up
            h, w = sh, sw
        return n, h // self.patch, w // self.patch

    def num_tokens_from_meta(self, meta: Dict[str, Any]) -> int:
        if "duration" in meta:  # a video's header (dataloading.formats.video.video_meta)
            n, gh, gw = self.video_grid(meta)
            return n // self.frames * gh * gw // (self.merge * self.merge)
        gh, gw = self.grid(meta["height"], meta["width"])
        return gh * gw // (self.merge * self.merge)

    def _patches(self, frames: np.ndarray, gh: int, gw: int) -> np.ndarray:
        """float32 [n, C, H, W] frames (n a multiple of temporal_patch_size) -> patches
        [n / T * gh * gw, C * T * P * P]: temporal patch after temporal patch, each in
        merge-window order, each patch flattened as (channel, frame, pixel row, pixel col)."""
        p, m, c, t = self.patch, self.merge, self.channels, self.frames
        n = frames.shape[0] // t
        x = frames.reshape(n, t, c, gh // m, m, p, gw // m, m, p)
        # -> (temporal patch, group row, group col, row in group, col in group) x (channel, frame, pixel row, pixel col)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(n * gh * gw, c * t * p * p)
        return np.ascontiguousarray(x)

    def __call__(self, raw: Any) -> MediaItem:
        img = rgb_uint8(raw, self.channels)
        gh, gw = self.grid(*img.shape[:2])
        p, m, c, t = self.patch, self.merge, self.channels, self.frames
        x = resized_normalised(img, gh * p, gw * p, self.mean, self.std).transpose(2, 0, 1)  # [C, H, W]
        x = np.broadcast_to(x[None], (t, c, gh * p, gw * p))  # one temporal patch: the frame repeated
        return MediaItem(features=torch.from_numpy(self._patches(x, gh, gw)), size=(1, gh, gw),
                         num_tokens=gh * gw // (m * m), rope_grid=(1, gh // m, gw // m, 1.0))

    def video(self, clip: Any) -> MediaItem:
        """A ``dataloading.formats.video.Video`` -> one item of size (t, grid_h, grid_w). Its temporal
        rotary step (``rope_grid``'s interval) is Qwen2.5-VL's ``tokens_per_second x
        temporal_patch_size / fps``, fps the rate the frames were sampled at (n / duration); 1
        for Qwen2-VL."""
        meta = clip.meta
        n, gh, gw = self.video_grid(meta)
        p, m, c, t = self.patch, self.merge, self.channels, self.frames
        frames = clip.frames(frame_times(meta["duration"], n))
        x = np.stack([resized_normalised(rgb_uint8(f, c), gh * p, gw * p, self.mean, self.std) for f in frames])
        x = x.transpose(0, 3, 1, 2)  # [n, C, H, W]
        interval = 1.0 if self.tokens_per_second is None else self.tokens_per_second * t * meta["duration"] / n
        return MediaItem(features=torch.from_numpy(self._patches(x, gh, gw)), size=(n // t, gh, gw),
                         num_tokens=n // t * gh * gw // (m * m),
                         rope_grid=(n // t, gh // m, gw // m, interval, self.resume_after_largest))
