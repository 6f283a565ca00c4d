"""LLaVA-NeXT's vision side: CLIP's tower on fixed-size tiles, and the anyres layout of the tiles'
features for the LLM.

- **Tower**: ``omni.models.encoders.clip.ClipTower``, the tower LLaVA-1.5 uses, run once per
  square (base image or tile), each with its class token; LLaVA-NeXT projects
  ``hidden_states[vision_feature_layer]`` (-2 in its checkpoints) with the class token dropped
  (``vision_feature_select_strategy: default``, the only choice: the layout reads each square's
  features as a side x side grid, which a kept class token breaks, in transformers too).
- **Items** (``omni.models.encoders.anyres.AnyresImageProcessor``): an image becomes its base
  image and its tiles over ``image_grid_pinpoints``, as transformers' ``LlavaNextImageProcessor``
  cuts them: the same rules as LLaVA-OneVision's (best pinpoint, aspect-keeping resize, black
  centred padding, ``image_size`` tiles), with CLIP's normalisation. Its ``size.shortest_edge``
  and ``crop_size`` resize and crop each square again; both must be ``image_size`` (then they
  leave the squares as they are).
- **Projector** (``omni.models.encoders.anyres.LlavaOvProjector``): LLaVA's two-layer MLP on
  every tile token, then the base image's features, the tiles' grid unpadded to the image's
  aspect ratio with the learned ``image_newline`` after each row. LLaVA-NeXT has no
  ``anyres_max`` limit, so the grid is never shrunk (the layout's ``max_tiles`` is None). The
  rearrangement needs whole items, so the tower does not run sequence-parallel.

Written from transformers' ``LlavaNextForConditionalGeneration`` and its image processor as
described there (not copied); the parity tests (``tests/models/test_llava_next.py``) hold it to
them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch

from omni.models.encoders.anyres import AnyresImageProcessor, AnyresLayout, AnyresTower, checked_pinpoints
from omni.models.encoders.base import check_sizes
from omni.models.encoders.blocks import transformer_activation_bytes, transformer_flops
from omni.models.encoders.clip import ClipEncoder, ClipEncoderConfig, ClipTower
from omni.models.encoders.llava_projector import llava_pretrained_projector
from omni.models.projector import PretrainedProjector


def default_pinpoints(image_size: int) -> List[List[int]]:
    """LLaVA-NeXT's tilings (transformers' default): 1 x 2, 2 x 1, 2 x 2, 3 x 1 and 1 x 3 tiles."""
    return [[image_size * r, image_size * c] for r, c in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))]


@dataclass
class LlavaNextEncoderConfig(ClipEncoderConfig):
    """Defaults: llava-v1.6's tower (CLIP ViT-L/14 at 336 pixels, feature layer -2, class token
    dropped) and tilings; ``from_pretrained`` reads a checkpoint's. Of CLIP's preprocessing
    knobs only the normalisation applies: ``shortest_edge`` and ``crop_size`` must be
    ``image_size`` (or None), the square resize and the square padding are LLaVA-1.5's."""

    image_grid_pinpoints: Optional[List[List[int]]] = None  # None: default_pinpoints(image_size)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vision_feature_select_strategy != "default":
            raise ValueError(f"vision_feature_select_strategy={self.vision_feature_select_strategy!r}: LLaVA-NeXT lays "
                             f"each tile out as a side x side grid, which needs the class token dropped ('default')")
        if self.shortest_edge not in (None, self.image_size):
            raise ValueError(f"shortest_edge={self.shortest_edge}: the llava_next processor resizes squares of "
                             f"image_size {self.image_size} to themselves only; set it to image_size")
        if self.resize_to_square or self.pad_to_square:
            raise ValueError("resize_to_square / pad_to_square are LLaVA-1.5's preprocessing (the clip encoder); the "
                             "llava_next processor tiles images (image_grid_pinpoints)")
        if self.image_grid_pinpoints is None:
            self.image_grid_pinpoints = default_pinpoints(self.image_size)
        self.image_grid_pinpoints = checked_pinpoints(self.image_grid_pinpoints, self.image_size)

    @property
    def layout(self) -> AnyresLayout:
        return AnyresLayout(self.image_size, self.patch_size, tuple(tuple(p) for p in self.image_grid_pinpoints))


class LlavaNextEncoder(AnyresTower, ClipTower):
    """LLaVA-NeXT's CLIP tower on anyres items (see the module doc).

    ``forward(features [sum squares*side*side, C*P*P], sizes int64 [n, 4] = (squares, height,
    width, 0))`` -> every square's patch features (class token dropped), item after item."""

    Config: ClassVar[type] = LlavaNextEncoderConfig
    hf_model_types: ClassVar[Tuple[str, ...]] = ("llava_next", "clip_vision_model", "clip")
    plugin: ClassVar[str] = "llava_next"

    @classmethod
    def processor(cls, config: LlavaNextEncoderConfig) -> AnyresImageProcessor:
        c = cls.build_config(config)
        return AnyresImageProcessor(c.layout, c.num_channels, c.image_mean, c.image_std)

    def forward(self, features: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        if any(int(row[3]) for row in sizes.tolist()):
            raise ValueError("LlavaNextEncoder: a video item; LLaVA-NeXT's tower encodes images only")
        units = check_sizes(type(self).__name__, features, self.input_units(sizes))
        return self.squares(features, sum(units) // self.config.side ** 2)

    # --- the planner's view --------------------------------------------------------------------
    def cost_coefficients(self) -> Tuple[float, float]:
        """Per LLM row: an item of n rows runs about n / side^2 squares of side^2 + 1 tokens (the
        class token; unpadding and newlines aside), so its cost is linear in n."""
        c = self.config
        alpha, beta = transformer_flops(c.layers_run, c.hidden_size, c.intermediate_size)
        t = c.side ** 2 + 1
        return 0.0, (alpha * t * t + beta * t) / c.side ** 2 + 2.0 * c.num_channels * c.patch_size ** 2 * c.hidden_size

    def activation_bytes(self, tokens: int, element_bytes: int = 4) -> float:
        c = self.config
        run = tokens + math.ceil(tokens / c.side ** 2)  # each square's class token runs too
        return transformer_activation_bytes(c.layers_run, c.hidden_size, c.intermediate_size, run, element_bytes,
                                            self.activation_checkpoint)

    # --- checkpoints -------------------------------------------------------------------------
    @classmethod
    def params_from_hf_config(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        """A LLaVA-NeXT config.json (tower, feature choice, tilings) or a CLIP one -> params."""
        from omni.models.hf_checkpoint import transformers_config

        out = super().params_from_hf_config(hf_config)
        if hf_config.get("model_type") == "llava_next":
            out["image_grid_pinpoints"] = [list(p) for p in transformers_config(hf_config).image_grid_pinpoints]
        return out

    @classmethod
    def params_from_preprocessor_config(cls, pp: Dict[str, Any]) -> Dict[str, Any]:
        """A ``LlavaNextImageProcessor`` preprocessor_config.json -> params: read as CLIP's
        (resize, crop, rescale and normalisation, the same keys), its ``do_pad`` being the
        batch's padding of tiles, not LLaVA-1.5's square padding. Its ``image_grid_pinpoints``
        are config.json's (the model's layout is the one that counts)."""
        return ClipEncoder.params_from_preprocessor_config({k: v for k, v in pp.items() if k != "do_pad"})

    @classmethod
    def pretrained_projector(cls, path: str) -> Optional[PretrainedProjector]:
        """The checkpoint's ``multi_modal_projector`` (LLaVA's MLP) and ``image_newline``; None
        for a CLIP checkpoint of its own."""
        return llava_pretrained_projector(path, "llava_next", newline=True)

    # --- export (omni.models.families) ---------------------------------------------------------
    def hf_image_processor(self) -> Any:
        """transformers' image processor of this tower's preprocessing (its PIL variant, which
        writes the same preprocessor_config.json as the default one, which needs torchvision)."""
        import transformers

        c = self.config
        return transformers.LlavaNextImageProcessorPil(
            size={"shortest_edge": c.image_size}, crop_size={"height": c.image_size, "width": c.image_size},
            image_grid_pinpoints=[list(p) for p in c.image_grid_pinpoints], image_mean=list(c.image_mean),
            image_std=list(c.image_std))
