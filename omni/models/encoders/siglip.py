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
from torch import nn

from dataloading.formats.media import MediaItem
from parallel.transfer import to_device
from omni.models.encoders.images import normalisation_params, resized_normalised, rgb_uint8
from omni.models.encoders.base import (
    EncoderAnchor,
    activation,
    check_sizes,
    AttentionSpec,
    transformer_activation_bytes,
    transformer_flops,
)
from omni.models.encoders.vit import ViTLayers


@dataclass
class SiglipEncoderConfig:
    """Defaults follow transformers' SiglipVisionConfig (google/siglip-base-patch16-224)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
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
        if isinstance(self.image_size, (list, tuple)):
            if len(set(self.image_size)) != 1:
                raise ValueError(f"SiglipEncoder needs a square image_size, got {self.image_size}")
            self.image_size = int(self.image_size[0])
        if isinstance(self.patch_size, (list, tuple)):
            if len(set(self.patch_size)) != 1:
                raise ValueError(f"SiglipEncoder needs a square patch_size, got {self.patch_size}")
            self.patch_size = int(self.patch_size[0])
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.max_patches is None:
            self.max_patches = (self.image_size // self.patch_size) ** 2
        if self.spatial_merge < 1 or self.max_patches < self.spatial_merge ** 2:
            raise ValueError(f"spatial_merge={self.spatial_merge} must be >= 1 with max_patches ({self.max_patches}) "
                             f"at least spatial_merge^2")
        if not 1 <= self.min_patches <= self.max_patches:
            raise ValueError(f"need 1 <= min_patches ({self.min_patches}) <= max_patches ({self.max_patches})")
        self.image_mean = [float(v) for v in self.image_mean]
        self.image_std = [float(v) for v in self.image_std]
        if len(self.image_mean) != self.num_channels or len(self.image_std) != self.num_channels:
            raise ValueError(f"image_mean and image_std need {self.num_channels} values (num_channels)")
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


class _Embeddings(nn.Module):
    def __init__(self, config: SiglipEncoderConfig):
        super().__init__()
        d, p = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Linear(config.num_channels * p * p, d)
        side = config.image_size // p
        self.position_embedding = nn.Embedding(side * side, d)
        # From scratch, start from a 2D sin-cos table (as MAE does) rather than noise: where a
        # patch sits is then readable from step 0, which a randomly initialised table takes
        # thousands of steps to learn. Loading a checkpoint overwrites it.
        with torch.no_grad():
            self.position_embedding.weight.copy_(sincos_2d(side, d))


def sincos_2d(side: int, dim: int) -> torch.Tensor:
    """[side*side, dim] table, row-major over (y, x): half the channels encode y, half x.

    The frequencies fall geometrically from 1 (about six patches per period) to 1/(2*side)
    (half a radian across the grid), so every channel varies over the grid. MAE's temperature
    of 10000 is made for sequences of thousands of positions: over the demo's 8x8 grid it left
    most channels nearly constant, and the demo's tiny LLM took most of its 800
    steps to tell left from right (held-out accuracy 0.81 at step 800; 0.94 at step 500 with
    this table, docs/benchmarks.md "Demo: held-out accuracy by step").
    """
    quarter = dim // 4
    temperature = 2.0 * max(1, side)
    freqs = 1.0 / (temperature ** (torch.arange(quarter, dtype=torch.float64) / max(1, quarter)))
    coords = torch.arange(side, dtype=torch.float64)
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    parts = []
    for c in (y.reshape(-1), x.reshape(-1)):
        angles = c[:, None] * freqs[None, :]
        parts += [angles.sin(), angles.cos()]
    table = torch.cat(parts, dim=1)
    if table.shape[1] < dim:  # dim not a multiple of 4: pad the rest with zeros
        table = torch.cat([table, table.new_zeros(table.shape[0], dim - table.shape[1])], dim=1)
    return table.float()


def merge_order(grid_h: int, grid_w: int, m: int) -> torch.Tensor:
    """[grid_h*grid_w] raster indices of an image's patches in merge order: the m x m blocks
    in raster order, and inside each block its patches in raster order."""
    idx = torch.arange(grid_h * grid_w, dtype=torch.int64).reshape(grid_h // m, m, grid_w // m, m)
    return idx.permute(0, 2, 1, 3).reshape(-1)


class SiglipEncoder(EncoderAnchor):
    """Packed SigLIP vision tower; output: post-layernorm hidden state, one token per patch.

    Parameter names equal transformers' SiglipVisionModel (without its pooling head), so a
    checkpoint loads key by key.
    """

    modality: ClassVar[str] = "image"
    Config: ClassVar[type] = SiglipEncoderConfig
    hf_model_types: ClassVar[Tuple[str, ...]] = ("siglip_vision_model", "siglip")
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = ("vision_model.", "")
    supports_sequence_parallel: ClassVar[bool] = True

    def __init__(self, config: SiglipEncoderConfig):
        super().__init__(config)
        self.output_dim = config.hidden_size
        self.spatial_merge = config.spatial_merge
        self.embeddings = _Embeddings(config)
        self.encoder = ViTLayers(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    @classmethod
    def processor(cls, config: SiglipEncoderConfig) -> SiglipProcessor:
        return SiglipProcessor(cls.build_config(config))

    @classmethod
    def params_from_hf_config(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        if hf_config.get("model_type") == "siglip":  # full SigLIP: the vision tower's config
            hf_config = hf_config.get("vision_config") or {}
        return super().params_from_hf_config(hf_config)

    @classmethod
    def params_from_preprocessor_config(cls, pp_config: Dict[str, Any]) -> Dict[str, Any]:
        return normalisation_params(pp_config)

    def init_rule(self, owner: nn.Module, path: str, attr: str):
        """The position table starts as the 2D sin-cos table (see ``_Embeddings``); the rest
        takes torch's defaults (``omni.models.materialize``)."""
        if path == "embeddings.position_embedding" and attr == "weight":
            from omni.models.materialize import Computed

            c = self.config
            return Computed(lambda: sincos_2d(c.image_size // c.patch_size, c.hidden_size))
        return None

    def convert_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name == "embeddings.patch_embedding.weight" and tensor.dim() == 4:
            return tensor.reshape(tensor.shape[0], -1)  # Conv2d [D, C, p, p] -> Linear [D, C*p*p]
        return tensor

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
            return features.new_zeros(0, self.output_dim, dtype=self.post_layernorm.weight.dtype), []
        grids = [(int(h), int(w)) for h, w in sizes.tolist()]
        m = self.spatial_merge
        if any(h % m or w % m for h, w in grids):
            bad = next((h, w) for h, w in grids if h % m or w % m)
            raise ValueError(f"SiglipEncoder: an image of {bad[0]}x{bad[1]} patches does not split into "
                             f"{m}x{m} blocks (spatial_merge={m}); its processor makes grids of multiples of {m}")
        tokens = check_sizes("SiglipEncoder", features, (h * w for h, w in grids))
        x = self.embeddings.patch_embedding(features.to(self.embeddings.patch_embedding.weight.dtype))
        cache: Dict[Tuple[int, int], torch.Tensor] = {}
        for g in grids:
            if g not in cache:
                cache[g] = self.position_embeddings(*g)
        x = x + torch.cat([cache[g] for g in grids], dim=0).to(x.dtype)
        if m > 1:
            order, start = [], 0
            for h, w in grids:
                order.append(merge_order(h, w, m) + start)
                start += h * w
            x = x.index_select(0, to_device([torch.cat(order)], x.device)[0])  # built on the host
        return x, tokens

    def encode_tokens(self, x: torch.Tensor, attention: AttentionSpec) -> torch.Tensor:
        return self.run_layers(self.encoder.layers, x, attention)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(x)

    def attention_heads(self) -> int:
        return self.config.num_attention_heads

    def input_units(self, sizes: torch.Tensor) -> List[int]:
        """One feature row (patch) per token: grid_h * grid_w per image."""
        return [int(h) * int(w) for h, w in sizes.tolist()]

    def layer_modules(self) -> List[nn.Module]:
        return list(self.encoder.layers)

    def activation_bytes(self, tokens: int, element_bytes: int = 4) -> float:
        c = self.config
        return transformer_activation_bytes(c.num_hidden_layers, c.hidden_size, c.intermediate_size, tokens, element_bytes,
                                            self.activation_checkpoint)

    def cost_coefficients(self) -> Tuple[float, float]:
        c = self.config
        alpha, beta = transformer_flops(c.num_hidden_layers, c.hidden_size, c.intermediate_size)
        beta += 2.0 * c.num_channels * c.patch_size**2 * c.hidden_size  # patch embedding
        return alpha, beta
