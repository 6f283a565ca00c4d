"""LLaVA-NeXT's and LLaVA-OneVision's "anyres" layout: how an image of any size becomes tiles of
the tower's fixed size, and how the tiles' features become the LLM's rows.

Both sides read the same rules from here, so the processor's token count (from the image's
height and width alone, for planning), the pixels it cuts and the projector's rearrangement
never disagree:

- **Tiles** (pixels): of the ``pinpoints`` (height, width) the one that keeps the most of the
  image's pixels when the image is scaled to fit it, then wastes the least (``best_resolution``);
  the image is resized into it keeping its aspect ratio (``fitted_size``), centred on black, and
  cut into ``image_size`` squares, row by row. A *base* image, the whole image squashed to one
  square, comes first.
- **Rows** (features): the tiles' feature grids stitched into one grid, the rows or columns
  that only saw the padding cut off again (``unpadded``), the grid scaled down (bilinear) when
  it holds more than ``max_tiles`` tiles' worth of features (``shrunk``: OneVision's
  ``anyres_max_N``; LLaVA-NeXT has no such limit, ``max_tiles`` None), and a learned newline
  vector after each row. The base image's features go first, as they are.
- **Video**: each frame squashed to one square, its projected features pooled 2 x 2 (bilinear
  to half the side, rounded up), frame after frame, one newline at the end.

An item without tiles (``base_only``: the base image and one newline) is what transformers makes
of the images of a sample with several of them (OneVision).

``AnyresImageProcessor`` cuts the pixels; ``LlavaOvProjector`` (both families' projector) lays
the features out; ``simulated_anyres_image`` is what the simulator draws of an image.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dataloading.formats.media import MediaItem
from omni.models.encoders.base import HostSizes
from omni.models.encoders.images import normalised, padded_to_square, resized, rgb_uint8
from omni.models.projector import Projector


def best_resolution(height: int, width: int, pinpoints: Sequence[Sequence[int]]) -> Tuple[int, int]:
    """The (height, width) of ``pinpoints`` an image is tiled at: the most pixels of the image
    kept when scaled to fit inside it (never more than the image has), ties broken by the
    fewest pixels wasted; the first such pinpoint."""
    best, kept_best, waste_best = None, 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        waste = pw * ph - kept
        if kept > kept_best or (kept == kept_best and waste < waste_best):
            best, kept_best, waste_best = (int(ph), int(pw)), kept, waste
    return best


def fitted_size(height: int, width: int, target_h: int, target_w: int) -> Tuple[int, int]:
    """The image's size resized into (target_h, target_w) keeping its aspect ratio: the side
    that limits the scale fills the target, the other rounds up (within the target)."""
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


def unpadded(grid_h: int, grid_w: int, height: int, width: int) -> Tuple[int, int, int, int]:
    """(top, rows, left, cols) of a grid_h x grid_w feature grid of an image of height x width
    that show the image rather than its padding: the padded axis loses the same number of rows
    (columns) on both sides, rounded down (so an odd difference keeps one more)."""
    if width / height > grid_w / grid_h:
        kept = int(round(height * (grid_w / width), 7))
        pad = (grid_h - kept) // 2
        return pad, grid_h - 2 * pad, 0, grid_w
    kept = int(round(width * (grid_h / height), 7))
    pad = (grid_w - kept) // 2
    return 0, grid_h, pad, grid_w - 2 * pad


def checked_pinpoints(pinpoints: Sequence[Sequence[int]], image_size: int) -> List[List[int]]:
    """``image_grid_pinpoints`` as [[height, width], ...] ints; a ValueError unless each is a
    positive multiple of the tower's ``image_size`` (the tiles are whole squares)."""
    out = [[int(h), int(w)] for h, w in pinpoints]
    bad = [p for p in out if p[0] % image_size or p[1] % image_size or min(p) < 1]
    if bad or not out:
        raise ValueError(f"image_grid_pinpoints {bad or '[]'}: each (height, width) must be a positive multiple of "
                         f"image_size {image_size}")
    return out


@dataclass(frozen=True)
class AnyresLayout:
    """The layout's numbers: the tower's square ``image_size`` (pixels) and ``patch_size``, the
    ``pinpoints`` (pixels, multiples of ``image_size``) and ``max_tiles`` (``anyres_max_N``;
    None: no limit)."""

    image_size: int
    patch_size: int
    pinpoints: Tuple[Tuple[int, int], ...]
    max_tiles: Optional[int] = None

    @property
    def side(self) -> int:
        """Feature rows (and columns) of one tile."""
        return self.image_size // self.patch_size

    @property
    def pooled_side(self) -> int:
        """A video frame's feature side after 2 x 2 pooling."""
        return math.ceil(self.side / 2)

    def tiles(self, height: int, width: int) -> Tuple[int, int]:
        """(rows, cols) of tiles an image of height x width is cut into (the base image apart)."""
        ph, pw = best_resolution(height, width, self.pinpoints)
        return ph // self.image_size, pw // self.image_size

    def shrunk(self, rows: int, cols: int) -> Tuple[int, int]:
        """The feature grid after the ``max_tiles`` limit: scaled down by the side ratio when it
        holds more than 1.1^2 x ``max_tiles`` tiles' worth, each side rounded down; unchanged
        without a limit."""
        if self.max_tiles is None:
            return rows, cols
        ratio = math.sqrt(rows * cols / (self.max_tiles * self.side ** 2))
        if ratio > 1.1:
            return int(rows // ratio), int(cols // ratio)
        return rows, cols

    def image_grid(self, height: int, width: int) -> Tuple[int, int, int, int, int, int]:
        """(tile rows, tile cols, top, rows, left, cols): an image's tiling, and the part of its
        tiles' feature grid that is kept (``unpadded``; ``shrunk`` scales it after)."""
        r, c = self.tiles(height, width)
        return (r, c, *unpadded(r * self.side, c * self.side, height, width))

    def image_tokens(self, height: int, width: int, base_only: bool = False) -> int:
        """LLM rows of an image: the base image's features, then (unless ``base_only``) the
        tiles' unpadded grid with a newline after each row; ``base_only``: one newline after the
        base image."""
        if base_only:
            return self.side ** 2 + 1
        _, _, _, rows, _, cols = self.image_grid(height, width)
        rows, cols = self.shrunk(rows, cols)
        return self.side ** 2 + rows * (cols + 1)

    def video_tokens(self, frames: int) -> int:
        """LLM rows of a video: each frame's pooled features, then one newline."""
        return frames * self.pooled_side ** 2 + 1


class AnyresImageProcessor:
    """An image -> its base image and tiles (module doc), each square cut into patches
    [side*side, C*patch*patch] (raster order, each patch flattened as (channel, row, col), the
    Conv2d weight's order), squares one after another; the item's size is ``(squares, height,
    width, 0)``, the original height and width in pixels (the last column: 1 for a video, which
    ``LlavaOvProcessor`` adds).

    Pixels as transformers' LLaVA-NeXT and LLaVA-OneVision image processors make them: PIL
    bicubic resizes of the uint8 image, black padding, x/255, (x - mean) / std. ``anyres=False``
    (a source's option): the base image alone, padded to a square with the mean colour first."""

    modality = "image"

    def __init__(self, layout: AnyresLayout, channels: int, mean: Sequence[float], std: Sequence[float]):
        self.layout = layout
        self.channels = channels
        self.mean = np.asarray(mean, dtype=np.float32)
        self.std = np.asarray(std, dtype=np.float32)
        self.pad_colour = [int(m * 255) for m in mean]
        self.anyres = True

    def with_options(self, anyres: Optional[bool] = None) -> "AnyresImageProcessor":
        """A copy with one data source's ``anyres`` (mixture ``image:`` options)."""
        other = copy.copy(self)
        other.anyres = bool(anyres) if anyres is not None else self.anyres
        return other

    def num_tokens_from_meta(self, meta: Dict[str, Any]) -> int:
        return self.layout.image_tokens(int(meta["height"]), int(meta["width"]), base_only=not self.anyres)

    def squares(self, img: np.ndarray) -> List[np.ndarray]:
        """uint8 [S, S, C] squares of an image: the base image, then its tiles row by row."""
        s = self.layout.image_size
        if not self.anyres:
            return [resized(padded_to_square(img, self.pad_colour), s, s)]
        h, w = img.shape[:2]
        ph, pw = self.layout.tiles(h, w)
        ph, pw = ph * s, pw * s
        nh, nw = fitted_size(h, w, ph, pw)
        canvas = np.zeros((ph, pw, img.shape[2]), dtype=np.uint8)
        top, left = (ph - nh) // 2, (pw - nw) // 2
        canvas[top:top + nh, left:left + nw] = resized(img, nh, nw)
        tiles = [canvas[i:i + s, j:j + s] for i in range(0, ph, s) for j in range(0, pw, s)]
        return [resized(img, s, s)] + tiles

    def _patches(self, squares: List[np.ndarray]) -> torch.Tensor:
        side, p, c = self.layout.side, self.layout.patch_size, self.channels
        # the patch convolution's stride covers side * p pixels of an S-pixel square: the rest is dropped
        x = np.stack([normalised(sq[:side * p, :side * p], self.mean, self.std) for sq in squares])  # [n, S', S', C]
        x = x.reshape(len(squares), side, p, side, p, c).transpose(0, 1, 3, 5, 2, 4)
        return torch.from_numpy(np.ascontiguousarray(x.reshape(len(squares) * side * side, c * p * p)))

    def __call__(self, raw: Any) -> MediaItem:
        img = rgb_uint8(raw, self.channels)
        h, w = img.shape[:2]
        squares = self.squares(img)
        return MediaItem(features=self._patches(squares), size=(len(squares), h, w, 0),
                         num_tokens=self.layout.image_tokens(h, w, base_only=not self.anyres))


def simulated_anyres_image(layout: AnyresLayout, units: int) -> Tuple[int, int]:
    """(tower tokens, LLM rows) of an image of about ``units`` patches for the simulator: a
    square of sqrt(units) patches, cut into its base image and tiles as the layout cuts it
    (``side``^2 tokens a square), its rows the layout's (unpadded, shrunk, newlines)."""
    px = max(1, round(math.sqrt(units) * layout.patch_size))
    r, c = layout.tiles(px, px)
    return (1 + r * c) * layout.side ** 2, layout.image_tokens(px, px)


class LlavaOvProjector(Projector):
    """LLaVA-OneVision's (and LLaVA-NeXT's: its ``layout`` has no ``max_tiles``, no video)
    ``multi_modal_projector`` (``fc1``/``fc2``: its ``linear_1``/``linear_2``) on every tower
    token, then each item laid out by ``layout`` from its size (module doc), with the learned
    ``image_newline`` (as wide as the LLM). Needs the items' sizes: rows that are
    pieces of items (``sizes`` None) are refused."""

    def __init__(self, in_dim: int, out_dim: int, layout: AnyresLayout, **kwargs: Any):
        super().__init__(in_dim, out_dim, **kwargs)
        if self.merge != 1:
            raise ValueError("the anyres (LLaVA-NeXT / OneVision) projector maps each tower token alone (merge 1)")
        self.layout = layout
        self.image_newline = nn.Parameter(torch.randn(out_dim) * out_dim ** -0.5)

    def init_rule(self, owner: nn.Module, path: str, attr: str):
        """The newline as transformers draws it (normal, std = width^-0.5); the rest torch's defaults."""
        if path == "" and attr == "image_newline":
            from omni.models.materialize import Normal

            return Normal(self.image_newline.shape[0] ** -0.5)
        return None

    def forward(self, x: torch.Tensor, sizes: Optional[torch.Tensor] = None) -> torch.Tensor:
        sizes = HostSizes.unwrap(sizes)
        if sizes is None:
            raise ValueError("the anyres (LLaVA-NeXT / OneVision) projector lays out whole items and needs their sizes")
        y = super().forward(x)
        s, d = self.layout.side, y.shape[1]
        newline = self.image_newline.to(y.dtype)
        out, start = [], 0
        for squares, h, w, video in sizes.tolist():
            item = y[start:start + squares * s * s]
            start += squares * s * s
            if video:
                out.append(self._pooled(item.view(squares, s, s, d)))
                out.append(newline[None])
            elif squares == 1:
                out += [item, newline[None]]
            else:
                out += [item[:s * s], self._tiled(item[s * s:], squares - 1, h, w, newline)]
        if start != y.shape[0]:
            raise ValueError(f"LlavaOvProjector: sizes describe {start} tower tokens but got {y.shape[0]}")
        return torch.cat(out) if out else y[:0]

    def _pooled(self, frames: torch.Tensor) -> torch.Tensor:
        """[n, s, s, D] -> [n * p * p, D], each frame bilinearly scaled to p = ceil(s / 2)."""
        p = self.layout.pooled_side
        pooled = F.interpolate(frames.permute(0, 3, 1, 2), size=(p, p), mode="bilinear")
        return pooled.permute(0, 2, 3, 1).reshape(-1, frames.shape[-1])

    def _tiled(self, tiles: torch.Tensor, n: int, height: int, width: int, newline: torch.Tensor) -> torch.Tensor:
        """The tiles' tokens [n * s * s, D] -> the unpadded, shrunk grid with a newline after each row."""
        s, d = self.layout.side, tiles.shape[1]
        r, c, top, rows, left, cols = self.layout.image_grid(height, width)
        if r * c != n:
            raise ValueError(f"an image of {height}x{width} pixels has {r}x{c} tiles, but its item holds {n}")
        grid = tiles.view(r, c, s, s, d).permute(4, 0, 2, 1, 3).reshape(d, r * s, c * s)
        grid = grid[:, top:top + rows, left:left + cols]
        small = self.layout.shrunk(rows, cols)
        if small != (rows, cols):
            grid = F.interpolate(grid[None], size=small, mode="bilinear")[0]
        grid = torch.cat([grid, newline[:, None, None].expand(d, grid.shape[1], 1)], dim=2)
        return grid.flatten(1).transpose(0, 1)


class AnyresTower:
    """What the towers on anyres items (LLaVA-NeXT's, LLaVA-OneVision's) do alike, mixed in
    before the tower's class: an item is ``squares`` squares of side^2 patches (one feature row
    each); ``LlavaOvProjector`` lays it out, LLaVA's MLP as wide as the LLM (so that a model
    trained from scratch exports); the simulator draws an image as ``simulated_anyres_image``
    (``side``^2 tokens a square: a class token's cost is the tower's ``cost_coefficients``);
    the checkpoint config's fields of the feature choice and the tilings. Reads ``config``'s
    ``layout``, ``side``, ``vision_feature_layer``, ``vision_feature_select_strategy`` and
    ``image_grid_pinpoints``."""

    def new_projector(self, llm_width: int, **kwargs: Any) -> LlavaOvProjector:
        return LlavaOvProjector(self.output_dim, llm_width, self.config.layout, **kwargs)

    def fresh_projector(self) -> Dict[str, Any]:
        """LLaVA's MLP: as wide as the LLM, so that a model trained from scratch exports."""
        return {"hidden_mult": 1.0}

    def input_units(self, sizes: torch.Tensor) -> List[int]:
        """One feature row per patch: squares * side^2 per item."""
        return [int(row[0]) * self.config.side ** 2 for row in sizes.tolist()]

    def simulated_item(self, units: int) -> Tuple[int, int]:
        """Base image and anyres tiles (``simulated_anyres_image``)."""
        return simulated_anyres_image(self.config.layout, units)

    # --- export (omni.models.families) ---------------------------------------------------------
    def hf_layout_config(self) -> Dict[str, Any]:
        """The family config's fields of the feature choice and the tilings."""
        c = self.config
        return {"vision_feature_layer": c.vision_feature_layer,
                "vision_feature_select_strategy": c.vision_feature_select_strategy,
                "image_grid_pinpoints": [list(p) for p in c.image_grid_pinpoints]}
