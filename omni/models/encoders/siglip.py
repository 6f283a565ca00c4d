"""SigLIP-compatible vision encoder on packed, variable-size images (NaViT style).

Each image keeps (roughly) its own aspect ratio and resolution: the processor resizes it so
that height and width are multiples of ``patch_size`` within a patch budget, and cuts it into
patches. Images of different grids are packed into one sequence; attention stays inside each
image. The learned position table of the pretrained (image_size/patch)^2 grid is interpolated to
each image's grid exactly as transformers' ``interpolate_pos_encoding=True`` does.

Weights load from a ``SiglipVisionModel`` or a full ``SiglipModel`` checkpoint directory; the
patch Conv2d (stride == kernel) becomes a Linear over flattened (channel, row, col) patches.
"""
import copy
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from dataloading.formats.media import MediaItem
from parallel.transfer import to_device
from omni.models.encoders.images import checked_mean_std, normalisation_params, resized_normalised, rgb_uint8
from omni.models.encoders.base import check_sizes
from omni.models.encoders.blocks import activation
from omni.models.encoders.vit import PackedViT, PatchEmbeddings, SiglipTowerFields, square


@dataclass
class SiglipEncoderConfig(SiglipTowerFields):
    """Defaults follow transformers' SiglipVisionConfig (google/siglip-base-patch16-224)."""

    image_size: int = 224
    # preprocessing
    max_patches: Optional[int] = None  # patch budget per image; None: (image_size // patch_size) ** 2
    min_patches: int = 1  # smaller images are scaled up to at least this many patches
    image_mean: List[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: List[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    # Patches per side the projector merges into one LLM token (Qwen2-VL's 2x2 patch merger:
    # 2). Grids are then multiples of it, and an image of h x w patches fills h*w/merge^2
    # placeholders. 1: one LLM token per patch.
    spatial_merge: int = 1

    def __post_init__(self) -> None:
        self.image_size = square(self.image_size, "image_size", "SiglipEncoder")
        super().__post_init__()
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.max_patches is None:
            self.max_patches = (self.image_size // self.patch_size) ** 2
        if self.spatial_merge < 1 or self.max_patches < self.spatial_merge ** 2:
            raise ValueError(f"spatial_merge={self.spatial_merge} must be >= 1 with max_patches ({self.max_patches}) "
                             f"at least spatial_merge^2")
        if not 1 <= self.min_patches <= self.max_patches:
            raise ValueError(f"need 1 <= min_patches ({self.min_patches}) <= max_patches ({self.max_patches})")
        self.image_mean, self.image_std = checked_mean_std(self.image_mean, self.image_std, self.num_channels)
        activation(self.hidden_act)  # fail early on an unknown name


def patch_grid(height: int, width: int, patch: int, max_patches: int, min_patches: int) -> Tuple[int, int]:
    """The (grid_h, grid_w) an image of height x width is resized to.

    Start from the nearest multiples of ``patch`` (at least one patch per side); if the grid has
    more than ``max_patches`` patches scale it down keeping the aspect ratio (floor), if fewer
    than ``min_patches`` scale it up (ceil). The budget wins over the minimum. Pure integer /
    float arithmetic on (height, width), so the processor and the planner always agree.
    """
    if height < 1 or width < 1:
        raise ValueError(f"image has no pixels ({height}x{width})")
    gh = max(1, round(height / patch))
    gw = max(1, round(width / patch))
    if gh * gw > max_patches:
        s = math.sqrt(max_patches * patch * patch / (height * width))
        gh = max(1, math.floor(height * s / patch))
        gw = max(1, math.floor(width * s / patch))
    elif gh * gw < min_patches:
        s = math.sqrt(min_patches * patch * patch / (height * width))
        gh = max(1, math.ceil(height * s / patch))
        gw = max(1, math.ceil(width * s / patch))
    while gh * gw > max_patches:  # rounding or an extreme aspect ratio: shrink the longer side
        if gw >= gh:
            gw = min(gw - 1, max(1, max_patches // gh))
        else:
            gh = min(gh - 1, max(1, max_patches // gw))
    return gh, gw


class SiglipProcessor:
    """uint8 [H, W, C] image -> patches [grid_h*grid_w, C*patch*patch] (rows of patches in
    raster order; each patch flattened as (channel, row, col), the order of the Conv2d weight).

    Resizing (only when the size is not already the target) uses PIL bicubic, like
    transformers' SiglipImageProcessor; then x/255, then (x - mean) / std.
    """

    modality = "image"

    RESIZE_POLICIES = ("fit", "square")

    def __init__(self, config: SiglipEncoderConfig):
        self.patch_size = config.patch_size
        self.num_channels = config.num_channels
        self.max_patches = config.max_patches
        self.min_patches = config.min_patches
        self.merge = config.spatial_merge
        self.resize = "fit"
        self.mean = np.asarray(config.image_mean, dtype=np.float32)
        self.std = np.asarray(config.image_std, dtype=np.float32)

    def with_options(self, max_patches: Optional[int] = None, min_patches: Optional[int] = None,
                     resize: Optional[str] = None) -> "SiglipProcessor":
        """A copy with one data source's settings (mixture file ``image:`` options).

        ``resize="fit"`` keeps the aspect ratio inside the patch budget (NaViT style);
        ``"square"`` resizes every image to the largest square grid in the budget (classic
        fixed-resolution SigLIP input)."""
        other = copy.copy(self)
        other.max_patches = int(max_patches) if max_patches is not None else self.max_patches
        other.min_patches = int(min_patches) if min_patches is not None else min(self.min_patches, other.max_patches)
        other.resize = resize or self.resize
        if other.resize not in self.RESIZE_POLICIES:
            raise ValueError(f"image resize policy {other.resize!r} is not one of {self.RESIZE_POLICIES}")
        if not 1 <= other.min_patches <= other.max_patches:
            raise ValueError(f"need 1 <= min_patches ({other.min_patches}) <= max_patches ({other.max_patches})")
        return other

    def grid(self, height: int, width: int) -> Tuple[int, int]:
        """The patch grid; with ``spatial_merge`` m both sides are multiples of m (the grid of
        m x m blocks is chosen as a grid of patches of m times the size, then scaled back)."""
        m = self.merge
        if self.resize == "square":
            side = max(1, math.isqrt(self.max_patches // (m * m)))
            return side * m, side * m
        gh, gw = patch_grid(int(height), int(width), self.patch_size * m, self.max_patches // (m * m),
                            max(1, -(-self.min_patches // (m * m))))
        return gh * m, gw * m

    def num_tokens_from_meta(self, meta: Dict[str, Any]) -> int:
        gh, gw = self.grid(meta["height"], meta["width"])
        return gh * gw // (self.merge * self.merge)

    def __call__(self, raw: Any) -> MediaItem:
        img = rgb_uint8(raw, self.num_channels)
        gh, gw = self.grid(*img.shape[:2])
        p = self.patch_size
        x = resized_normalised(img, gh * p, gw * p, self.mean, self.std)  # [H, W, C]
        c = self.num_channels
        patches = x.reshape(gh, p, gw, p, c).transpose(0, 2, 4, 1, 3).reshape(gh * gw, c * p * p)
        return MediaItem(features=torch.from_numpy(np.ascontiguousarray(patches)), size=(gh, gw),
                         num_tokens=gh * gw // (self.merge * self.merge))


def merge_order(grid_h: int, grid_w: int, m: int) -> torch.Tensor:
    """[grid_h*grid_w] raster indices of an image's patches in merge order: the m x m blocks
    in raster order, and inside each block its patches in raster order."""
    idx = torch.arange(grid_h * grid_w, dtype=torch.int64).reshape(grid_h // m, m, grid_w // m, m)
    return idx.permute(0, 2, 1, 3).reshape(-1)


class SiglipEncoder(PackedViT):
    """Packed SigLIP vision tower; output: post-layernorm hidden state, one token per patch.

    Parameter names equal transformers' SiglipVisionModel (without its pooling head), so a
    checkpoint loads key by key.
    """

    Config: ClassVar[type] = SiglipEncoderConfig
    hf_full_model_type: ClassVar[str] = "siglip"
    hf_model_types: ClassVar[Tuple[str, ...]] = ("siglip_vision_model", hf_full_model_type)
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = ("vision_model.", "")

    def __init__(self, config: SiglipEncoderConfig):
        p = config.patch_size
        super().__init__(config, PatchEmbeddings(config.num_channels, p, config.image_size // p, config.hidden_size))
        self.spatial_merge = config.spatial_merge

    @classmethod
    def processor(cls, config: SiglipEncoderConfig) -> SiglipProcessor:
        return SiglipProcessor(cls.build_config(config))

    @classmethod
    def params_from_preprocessor_config(cls, pp_config: Dict[str, Any]) -> Dict[str, Any]:
        return normalisation_params(pp_config)

    def position_embeddings(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """[grid_h*grid_w, D]: the learned table, bicubically interpolated to the grid as
        transformers' SiglipVisionEmbeddings.interpolate_pos_encoding does."""
        table = self.embeddings.position_embedding.weight
        n, d = table.shape
        if grid_h * grid_w == n and grid_h == grid_w:
            return table
        side = math.isqrt(n)
        grid = table.reshape(1, side, side, d).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(grid_h, grid_w), mode="bicubic", align_corners=False)
        return grid.permute(0, 2, 3, 1).reshape(grid_h * grid_w, d)

    def embed_inputs(self, features: torch.Tensor, sizes: torch.Tensor) -> Tuple[torch.Tensor, List[int]]:
        """Patch embedding plus each image's interpolated position table; with
        ``spatial_merge`` m, each image's tokens reordered so that every m x m block of
        neighbouring patches is m^2 consecutive tokens (block after block, in raster order of
        the blocks and inside each block), what the projector's merge takes. Attention within
        an image does not depend on the order: the positions travel with the tokens."""
        if sizes.shape[0] == 0:
            return self.no_items(features)
        grids = [(int(h), int(w)) for h, w in sizes.tolist()]
        m = self.spatial_merge
        if any(h % m or w % m for h, w in grids):
            bad = next((h, w) for h, w in grids if h % m or w % m)
            raise ValueError(f"SiglipEncoder: an image of {bad[0]}x{bad[1]} patches does not split into "
                             f"{m}x{m} blocks (spatial_merge={m}); its processor makes grids of multiples of {m}")
        tokens = check_sizes("SiglipEncoder", features, (h * w for h, w in grids))
        x = self.embedded(features, grids)
        if m > 1:
            order, start = [], 0
            for h, w in grids:
                order.append(merge_order(h, w, m) + start)
                start += h * w
            x = x.index_select(0, to_device([torch.cat(order)], x.device)[0])  # built on the host
        return x, tokens
