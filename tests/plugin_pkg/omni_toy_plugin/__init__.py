"""A toy image encoder: every image becomes a fixed 4x4 grid of patch embeddings (MLP only)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch import nn

from dataloading.formats.media import MediaItem
from omni.models.encoders.base import EncoderAnchor


@dataclass
class ToyPatchConfig:
    grid: int = 4
    patch_pixels: int = 4
    hidden_size: int = 32


class ToyPatchProcessor:
    modality = "image"

    def __init__(self, config: ToyPatchConfig):
        self.grid, self.px = config.grid, config.patch_pixels

    def __call__(self, raw: np.ndarray) -> MediaItem:
        side = self.grid * self.px
        img = np.asarray(Image.fromarray(raw).resize((side, side)), dtype=np.float32) / 255.0
        patches = img.reshape(self.grid, self.px, self.grid, self.px, 3).transpose(0, 2, 1, 3, 4)
        feats = torch.from_numpy(patches.reshape(self.grid * self.grid, -1).copy())
        return MediaItem(features=feats, size=(self.grid, self.grid), num_tokens=self.grid * self.grid)

    def num_tokens_from_meta(self, meta: dict) -> int:
        return self.grid * self.grid


class ToyPatchEncoder(EncoderAnchor):
    modality = "image"
    Config = ToyPatchConfig

    def __init__(self, config: ToyPatchConfig):
        super().__init__(config)
        in_dim = config.patch_pixels * config.patch_pixels * 3
        self.mlp = nn.Sequential(nn.Linear(in_dim, config.hidden_size), nn.GELU(), nn.Linear(config.hidden_size, config.hidden_size))
        self.pos = nn.Parameter(torch.zeros(config.grid * config.grid, config.hidden_size))
        self.output_dim = config.hidden_size

    @classmethod
    def processor(cls, config: ToyPatchConfig) -> ToyPatchProcessor:
        return ToyPatchProcessor(config)

    def forward(self, features: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        n_items = sizes.shape[0]
        return self.mlp(features) + self.pos.repeat(n_items, 1)

    def cost_coefficients(self) -> tuple[float, float]:
        return 0.0, 2.0 * sum(p.numel() for p in self.mlp.parameters())
