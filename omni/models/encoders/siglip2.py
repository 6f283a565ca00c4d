"""SigLIP2's NaFlex vision tower (transformers' ``Siglip2VisionModel``) on packed images.

NaFlex keeps each image's native aspect ratio: the processor scales the image by the largest
factor whose patch grid (each side rounded *up* to whole patches) still fits ``max_num_patches``,
so a wide image becomes a wide grid. The learned position table is one square grid
(``num_patches`` = side^2 entries); each image gets it resized to its own (grid_h, grid_w) with
antialiased bilinear interpolation. Transformers pads every image to ``max_num_patches`` and
masks the padding; Omni packs the images back to back instead, and attention stays inside each
image (the same packed attention the ``siglip`` plugin uses).

What differs from SigLIP v1 (``omni.models.encoders.siglip``), and why this is a plugin of its
own rather than options there: the resize rule, the bilinear (not bicubic) resampling of both
the pixels and the position table, the patch layout (each patch flattened as (row, col,
channel), the order of the checkpoint's Linear patch embedding) and the position table's shape.
The transformer layers are the same and come from ``omni.models.encoders.vit``.

The output is the post-layernorm state, one token per patch: what an LLM consumes. The
attention-pooling head (``vision_use_head``), which turns an image into one vector for
contrastive training, is not built; its weights in a checkpoint are left unread.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from dataloading.formats.media import MediaItem
from omni.models.encoders.base import check_sizes
from omni.models.encoders.blocks import activation
from omni.models.encoders.images import checked_mean_std, normalisation_params, resized_normalised, rgb_uint8
from omni.models.encoders.vit import PackedViT, PatchEmbeddings, SiglipTowerFields

# The resize rule's search: the scale of an image is looked for in [SCALE_TOL / 10, MAX_SCALE]
# until the bracket is narrower than SCALE_TOL (see naflex_grid).
SCALE_TOL = 1e-5
MAX_SCALE = 100.0


@dataclass
class Siglip2EncoderConfig(SiglipTowerFields):
    """Defaults are transformers' ``Siglip2VisionConfig`` (google/siglip2-base-patch16-naflex):
    a key a config.json leaves out means transformers' default, so ours must agree."""

    # entries of the learned position table, a square grid (256: 16 x 16)
    num_patches: int = 256
    # preprocessing (Siglip2ImageProcessor): the patch budget per image (None: num_patches,
    # which is what the released checkpoints' preprocessor_config.json says too)
    max_num_patches: Optional[int] = None
    image_mean: List[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: List[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])

    def __post_init__(self) -> None:
        super().__post_init__()
        side = math.isqrt(self.num_patches) if self.num_patches > 0 else 0
        if side < 1 or side * side != self.num_patches:
            raise ValueError(f"num_patches {self.num_patches} is not a square (the position table is a square grid)")
        if self.max_num_patches is None:
            self.max_num_patches = self.num_patches
        if self.max_num_patches < 1:
            raise ValueError(f"max_num_patches must be >= 1, got {self.max_num_patches}")
        self.image_mean, self.image_std = checked_mean_std(self.image_mean, self.image_std, self.num_channels)
        activation(self.hidden_act)  # fail early on an unknown name

    @property
    def position_side(self) -> int:
        return math.isqrt(self.num_patches)


def naflex_grid(height: int, width: int, patch: int, max_num_patches: int) -> Tuple[int, int]:
    """(grid_h, grid_w) of an image of height x width pixels: each side scaled by s and rounded
    up to whole patches (at least one), with s the largest scale whose grid fits
    ``max_num_patches``, as found by bisection on s.

    Why a bisection on a float rather than an exact search over the points where a side spans a
    whole number of patches (the grid only changes there): SigLIP2 was trained with this
    bisection (big_vision's ``resize_to_sequence``) and transformers' Siglip2ImageProcessor runs
    it too. It stops within SCALE_TOL of the largest fitting scale, and so misses a larger grid
    that fits only on a sliver of scales narrower than that (about 1 in 7000 image sizes at 256
    patches of 16 pixels); an exact search would give those images another grid than the model
    saw. Plain float arithmetic on (height, width), so the processor and the planner
    (``num_tokens_from_meta``) agree on every image.
    """
    if height < 1 or width < 1:
        raise ValueError(f"image has no pixels ({height}x{width})")
    if max_num_patches < 1:
        raise ValueError(f"max_num_patches must be >= 1, got {max_num_patches}")

    def grid_at(scale: float) -> Tuple[int, int]:
        return max(1, math.ceil(height * scale / patch)), max(1, math.ceil(width * scale / patch))

    fits, too_big = SCALE_TOL / 10, MAX_SCALE  # at the lower end every image is 1 x 1 patch: it fits
    while too_big - fits >= SCALE_TOL:
        mid = (fits + too_big) / 2
        gh, gw = grid_at(mid)
        if gh * gw <= max_num_patches:
            fits = mid
        else:
            too_big = mid
    return grid_at(fits)


class Siglip2Processor:
    """uint8 [H, W, C] image -> patches [grid_h*grid_w, patch*patch*C]: the image resized to
    (grid_h*patch, grid_w*patch) pixels with PIL's bilinear filter (as Siglip2ImageProcessor;
    skipped when the size already matches), x/255, (x - mean)/std, then cut into patches in
    raster order, each flattened as (row, col, channel)."""

    modality = "image"

    def __init__(self, config: Siglip2EncoderConfig):
        self.patch_size = config.patch_size
        self.num_channels = config.num_channels
        self.max_num_patches = config.max_num_patches
        self.mean = np.asarray(config.image_mean, dtype=np.float32)
        self.std = np.asarray(config.image_std, dtype=np.float32)

    def with_options(self, max_num_patches: Optional[int] = None) -> "Siglip2Processor":
        """A copy with one data source's patch budget (mixture file ``image:`` options)."""
        other = copy.copy(self)
        if max_num_patches is not None:
            if int(max_num_patches) < 1:
                raise ValueError(f"max_num_patches must be >= 1, got {max_num_patches}")
            other.max_num_patches = int(max_num_patches)
        return other

    def grid(self, height: int, width: int) -> Tuple[int, int]:
        return naflex_grid(int(height), int(width), self.patch_size, self.max_num_patches)

    def num_tokens_from_meta(self, meta: Dict[str, Any]) -> int:
        gh, gw = self.grid(meta["height"], meta["width"])
        return gh * gw

    def __call__(self, raw: Any) -> MediaItem:
        img = rgb_uint8(raw, self.num_channels)
        gh, gw = self.grid(*img.shape[:2])
        p, c = self.patch_size, self.num_channels
        x = resized_normalised(img, gh * p, gw * p, self.mean, self.std, resample="bilinear")  # [H, W, C]
        patches = x.reshape(gh, p, gw, p, c).transpose(0, 2, 1, 3, 4).reshape(gh * gw, p * p * c)
        return MediaItem(features=torch.from_numpy(np.ascontiguousarray(patches)), size=(gh, gw), num_tokens=gh * gw)


class Siglip2Encoder(PackedViT):
    """Packed SigLIP2 NaFlex vision tower; output: post-layernorm hidden state, one token per patch.

    Parameter names equal transformers' ``Siglip2VisionModel`` (without its pooling head), so
    a checkpoint loads key by key."""

    Config: ClassVar[type] = Siglip2EncoderConfig
    hf_full_model_type: ClassVar[str] = "siglip2"
    hf_model_types: ClassVar[Tuple[str, ...]] = ("siglip2_vision_model", hf_full_model_type)
    # Siglip2Model and transformers-4 Siglip2VisionModel files: vision_model.*; transformers 5
    # writes a Siglip2VisionModel without the prefix.
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = ("vision_model.", "")

    def __init__(self, config: Siglip2EncoderConfig):
        # The learned table is one square grid (num_patches entries), resized to each image's.
        super().__init__(config, PatchEmbeddings(config.num_channels, config.patch_size, config.position_side,
                                                 config.hidden_size))

    @classmethod
    def processor(cls, config: Siglip2EncoderConfig) -> Siglip2Processor:
        return Siglip2Processor(cls.build_config(config))

    @classmethod
    def params_from_preprocessor_config(cls, pp_config: Dict[str, Any]) -> Dict[str, Any]:
        params: Dict[str, Any] = normalisation_params(pp_config)
        if isinstance(pp_config.get("max_num_patches"), int):
            params["max_num_patches"] = pp_config["max_num_patches"]
        return params

    def position_embeddings(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """[grid_h*grid_w, D]: the square table resized to the image's grid by antialiased
        bilinear interpolation (what transformers' Siglip2VisionEmbeddings computes), in fp32
        as there, so a bf16 table is not interpolated in bf16."""
        table = self.embeddings.position_embedding.weight
        side = self.config.position_side
        if (grid_h, grid_w) == (side, side):
            return table
        grid = table.float().reshape(1, side, side, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(grid_h, grid_w), mode="bilinear", align_corners=False, antialias=True)
        return grid.permute(0, 2, 3, 1).reshape(grid_h * grid_w, -1).to(table.dtype)

    def embed_inputs(self, features: torch.Tensor, sizes: torch.Tensor) -> Tuple[torch.Tensor, List[int]]:
        """Patch embedding plus each image's resized position table."""
        if sizes.shape[0] == 0:
            return self.no_items(features)
        grids = [(int(h), int(w)) for h, w in sizes.tolist()]
        if any(h < 1 or w < 1 for h, w in grids):
            raise ValueError(f"Siglip2Encoder: an image has an empty patch grid ({next(g for g in grids if min(g) < 1)})")
        tokens = check_sizes("Siglip2Encoder", features, (h * w for h, w in grids))
        return self.embedded(features, grids), tokens

    def simulated_item(self, units: int) -> Tuple[int, int]:
        """An image of about ``units`` patches (a square of sqrt(units) patches), resized as the
        processor resizes every image: scaled up or down to fill max_num_patches (naflex_grid)."""
        c = self.config
        px = max(1, round(math.sqrt(units) * c.patch_size))
        gh, gw = naflex_grid(px, px, c.patch_size, c.max_num_patches)
        return gh * gw, gh * gw
