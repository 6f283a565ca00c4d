"""CLIP's vision tower as LLaVA uses it, on packed fixed-size images.

The tower is transformers' ``CLIPVisionModel``: a patch embedding (a Conv2d without bias with
stride == kernel, here a Linear over each patch flattened as (channel, row, col)), a learned
class embedding put in front of each image's patches, a learned position table over (class,
patches), a LayerNorm before the layers (``pre_layrnorm``, transformers' spelling), the pre-norm
layers CLIP shares with SigLIP (``omni.models.encoders.vit``, quick GELU), and a LayerNorm after
them.

LLaVA (``LlavaForConditionalGeneration``) feeds its projector the hidden state after
``vision_feature_layer`` layers: transformers' ``hidden_states`` index, where 0 is the input of
the first layer and -1 the last layer's output (LLaVA-1.5: -2, the second-to-last layer). With
``vision_feature_select_strategy`` ``default`` it drops the class token, ``full`` keeps it. So
the layers after the chosen one and the post-layernorm never run: they are kept, frozen, only
so that the checkpoint loads and exports whole.

Each image is preprocessed as ``CLIPImageProcessor`` does (see ``ClipProcessor``) to one fixed
``image_size`` square, so every item is the same (image_size / patch_size)^2 patches. Items are
packed one after another, each with its class token, and attention stays inside each item.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from dataloading.formats.media import MediaItem
from omni.models.encoders.base import check_sizes
from omni.models.encoders.blocks import activation, transformer_activation_bytes, transformer_flops
from omni.models.encoders.images import (BICUBIC, center_cropped, checked_mean_std, normalisation_params, normalised,
                                         padded_to_square, refuse_unsupported_steps, resized, rgb_uint8,
                                         shortest_edge_size)
from omni.models.encoders.llava_projector import llava_pretrained_projector
from omni.models.encoders.vit import FeatureLayerFields, FeatureLayerTower, ViTLayers, feature_layers_run, sincos_2d
from omni.models.projector import PretrainedProjector

SELECT_STRATEGIES = ("default", "full")
# OpenAI CLIP's normalisation (transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD)
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# LLaVA's tower weights: the checkpoint layouts that hold them, tried in order (transformers'
# save_pretrained writes vision_tower.*, LLaVA-1.5 files and transformers 4.x
# vision_tower.vision_model.*, transformers 5 holds model.vision_tower.*; a CLIP checkpoint
# of its own: vision_model.* (4.x, and the full CLIPModel) or no prefix (5.x CLIPVisionModel)).
TOWER_PREFIXES = ("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.",
                  "model.vision_tower.", "vision_model.", "")


@dataclass
class ClipEncoderConfig(FeatureLayerFields):
    """Defaults: LLaVA-1.5's tower (CLIP ViT-L/14 at 336 pixels) and its feature choice;
    ``from_pretrained`` reads a checkpoint's."""

    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 336
    patch_size: int = 14
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    # The hidden state LLaVA projects: after this many layers (transformers' hidden_states
    # index; negative counts from the last layer's output, -1).
    vision_feature_layer: int = -2
    vision_feature_select_strategy: str = "default"  # default: drop the class token; full: keep it
    # preprocessing (CLIPImageProcessor): the shorter side resized to shortest_edge (None:
    # image_size) keeping the aspect ratio, then the centre image_size square cropped;
    # resize_to_square: resized straight to the square instead. pad_to_square: first padded to
    # a square with the mean colour (LLaVA-1.5's `image_aspect_ratio: pad`).
    shortest_edge: Optional[int] = None
    resize_to_square: bool = False
    pad_to_square: bool = False
    crop_size: Optional[int] = None  # the processor's crop; must be image_size (None: image_size)
    image_mean: List[float] = field(default_factory=lambda: list(CLIP_MEAN))
    image_std: List[float] = field(default_factory=lambda: list(CLIP_STD))

    def __post_init__(self) -> None:
        self.check_squares("ClipEncoder")
        if isinstance(self.vision_feature_layer, (list, tuple)) or type(self.vision_feature_layer).__name__ == "ListConfig":
            raise ValueError(f"vision_feature_layer={list(self.vision_feature_layer)}: features concatenated from several "
                             f"layers (newer LLaVA configs) are not supported; the clip encoder takes one layer")
        feature_layers_run(self.vision_feature_layer, self.num_hidden_layers)
        if self.vision_feature_select_strategy not in SELECT_STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy={self.vision_feature_select_strategy!r} is not one of "
                             f"{SELECT_STRATEGIES}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.crop_size is not None and self.crop_size != self.image_size:
            raise ValueError(f"the processor crops {self.crop_size} pixels but the tower takes image_size={self.image_size} "
                             f"(CLIP's position table has no other size); set crop_size to image_size")
        if self.shortest_edge is not None and self.shortest_edge < 1:
            raise ValueError(f"shortest_edge must be >= 1, got {self.shortest_edge}")
        self.image_mean, self.image_std = checked_mean_std(self.image_mean, self.image_std, self.num_channels)
        activation(self.hidden_act)  # fail early on an unknown name

    @property
    def keeps_class_token(self) -> bool:
        return self.vision_feature_select_strategy == "full"

    @property
    def tokens_per_image(self) -> int:
        """LLM placeholders per image: one per patch, plus the class token with ``full``."""
        return self.side ** 2 + int(self.keeps_class_token)


class ClipProcessor:
    """uint8 [H, W, C] image -> patches [side*side, C*patch*patch] (raster order, each patch
    flattened as (channel, row, col), the Conv2d weight's order), size (side, side).

    The steps of transformers' ``CLIPImageProcessor`` (``LlavaImageProcessor`` with ``do_pad``
    for ``pad_to_square``): pad to a square with the mean colour (each channel's mean x 255,
    rounded down), resize (PIL bicubic) the shorter side to ``shortest_edge`` keeping the aspect
    ratio (or straight to the square with ``resize_to_square``), centre-crop ``image_size``,
    x/255, (x - mean) / std."""

    modality = "image"

    def __init__(self, config: ClipEncoderConfig):
        self.channels = config.num_channels
        self.patch = config.patch_size
        self.side = config.side
        self.image_size = config.image_size
        self.edge = config.shortest_edge or config.image_size
        self.resize_to_square = config.resize_to_square
        self.pad_colour = [int(m * 255) for m in config.image_mean] if config.pad_to_square else None
        self.num_tokens = config.tokens_per_image
        self.mean = np.asarray(config.image_mean, dtype=np.float32)
        self.std = np.asarray(config.image_std, dtype=np.float32)

    def num_tokens_from_meta(self, meta: Dict[str, Any]) -> int:
        return self.num_tokens  # every image becomes the same square

    def pixels(self, raw: Any) -> np.ndarray:
        """float32 [image_size, image_size, C]: the normalised square the tower sees."""
        img = rgb_uint8(raw, self.channels)
        if self.pad_colour is not None:
            img = padded_to_square(img, self.pad_colour)
        h, w = (self.edge, self.edge) if self.resize_to_square else shortest_edge_size(*img.shape[:2], self.edge)
        img = center_cropped(resized(img, h, w), self.image_size, self.image_size)
        return normalised(img, self.mean, self.std)

    def __call__(self, raw: Any) -> MediaItem:
        s, p, c = self.side, self.patch, self.channels
        x = self.pixels(raw).reshape(s, p, s, p, c).transpose(0, 2, 4, 1, 3).reshape(s * s, c * p * p)
        return MediaItem(features=torch.from_numpy(np.ascontiguousarray(x)), size=(s, s), num_tokens=self.num_tokens)


class _Embeddings(nn.Module):
    def __init__(self, c: ClipEncoderConfig):
        super().__init__()
        d = c.hidden_size
        self.class_embedding = nn.Parameter(torch.randn(d) * d ** -0.5)
        self.patch_embedding = nn.Linear(c.num_channels * c.patch_size ** 2, d, bias=False)
        self.position_embedding = nn.Embedding(c.side ** 2 + 1, d)
        with torch.no_grad():
            self.position_embedding.weight.copy_(_position_table(c))


def _position_table(c: ClipEncoderConfig) -> torch.Tensor:
    """The position table a tower trained from scratch starts from: zeros for the class token,
    the 2D sin-cos table over the patches (where a patch sits is readable from step 0, the
    reason ``siglip`` starts so too); a checkpoint overwrites it."""
    return torch.cat([torch.zeros(1, c.hidden_size), sincos_2d(c.side, c.hidden_size)])


class ClipTower(FeatureLayerTower):
    """CLIP's vision tower, the part LLaVA's families share: its modules (parameter names equal
    transformers' ``CLIPVisionModel``'s, so a checkpoint loads key by key), the run of fixed
    squares with their class tokens, and the checkpoint's tower config. A family's plugin
    (``ClipEncoder``, ``omni.models.encoders.llava_next``) adds what an item is: its processor,
    ``forward`` and projector."""

    Config: ClassVar[type] = ClipEncoderConfig
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = TOWER_PREFIXES
    plugin: ClassVar[str] = "clip"
    tower_name: ClassVar[str] = "CLIP"
    vision_model_type: ClassVar[str] = "clip_vision_model"

    def __init__(self, config: ClipEncoderConfig):
        super().__init__(config)
        c = config
        self.output_dim = c.hidden_size
        self.embeddings = _Embeddings(c)
        self.pre_layrnorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.encoder = ViTLayers(c)
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.freeze_unused()  # the layers after the feature layer never run (see the module doc)

    def init_rule(self, owner: nn.Module, path: str, attr: str):
        """From scratch: the class embedding as CLIP draws it (normal, std = width^-0.5), the
        position table as ``_position_table``; the rest takes torch's defaults."""
        from omni.models.materialize import Computed, Normal

        if path == "embeddings" and attr == "class_embedding":
            return Normal(self.config.hidden_size ** -0.5)
        if path == "embeddings.position_embedding" and attr == "weight":
            c = self.config
            return Computed(lambda: _position_table(c))
        return None

    def squares(self, features: torch.Tensor, n: int) -> torch.Tensor:
        """``n`` squares' patches [n*side*side, C*P*P] -> their chosen hidden states
        [n * tokens_per_image, hidden_size], square after square (class token first with
        ``full``); each square attends within itself, its class token included."""
        c = self.config
        s, d = c.side, c.hidden_size
        emb = self.embeddings
        x = emb.patch_embedding(features.to(emb.patch_embedding.weight.dtype)).view(n, s * s, d)
        x = torch.cat([emb.class_embedding.to(x.dtype).expand(n, 1, d), x], dim=1)
        x = self.pre_layrnorm(x + emb.position_embedding.weight.to(x.dtype)).reshape(n * (s * s + 1), d)
        if n:  # no items: nothing to attend over; the embedding stays in the graph
            x = self.run_layers(self.encoder.layers[:c.layers_run], x, self.item_attention([s * s + 1] * n, x.device))
        x = x.view(n, s * s + 1, d)
        return (x if c.keeps_class_token else x[:, 1:]).reshape(-1, d)

    # --- checkpoints -------------------------------------------------------------------------
    @classmethod
    def params_from_hf_config(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        """A LLaVA-family config.json (its ``vision_config`` and feature choice), a CLIP one (its
        ``vision_config``) or a CLIPVisionModel's -> params; keys the file leaves out take
        transformers' defaults (``transformers_config``)."""
        from omni.models.hf_checkpoint import transformers_config

        config = transformers_config(hf_config)
        out: Dict[str, Any] = {}
        kind = hf_config.get("model_type")
        if kind not in ("clip_vision_model", "clip"):
            out["vision_feature_layer"] = config.vision_feature_layer
            out["vision_feature_select_strategy"] = config.vision_feature_select_strategy
        out.update(cls.vision_params(config if kind == "clip_vision_model" else config.vision_config, kind))
        return out


class ClipEncoder(ClipTower):
    """CLIP vision tower with LLaVA's feature choice (see the module doc): one square per image.

    ``forward(features [n*side*side, C*P*P], sizes int64 [n, 2] = (side, side))`` ->
    ``[n * tokens_per_image, hidden_size]``, image after image (class token first with ``full``)."""

    hf_model_types: ClassVar[Tuple[str, ...]] = ("llava", "clip_vision_model", "clip")

    @classmethod
    def processor(cls, config: ClipEncoderConfig) -> ClipProcessor:
        return ClipProcessor(cls.build_config(config))

    # --- the model ---------------------------------------------------------------------------
    def forward(self, features: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        c = self.config
        s = c.side
        grids = [(int(h), int(w)) for h, w in sizes.tolist()]
        if any(g != (s, s) for g in grids):
            bad = next(g for g in grids if g != (s, s))
            raise ValueError(f"ClipEncoder: an image of {bad[0]}x{bad[1]} patches; the tower takes {s}x{s} "
                             f"(image_size {c.image_size} / patch_size {c.patch_size}), which its processor makes")
        check_sizes(type(self).__name__, features, (h * w for h, w in grids))
        return self.squares(features, len(grids))

    # --- the planner's view --------------------------------------------------------------------
    def cost_coefficients(self) -> Tuple[float, float]:
        """FLOPs of an image of n placeholders ~ alpha*n^2 + beta*n: the layers that run, on
        n + 1 tokens when the class token is dropped ((n+1)^2 = n^2 + 2n + 1, the constant
        left out), and the patch embedding."""
        c = self.config
        alpha, beta = transformer_flops(c.layers_run, c.hidden_size, c.intermediate_size)
        if not c.keeps_class_token:
            beta += 2 * alpha
        return alpha, beta + 2.0 * c.num_channels * c.patch_size ** 2 * c.hidden_size

    def activation_bytes(self, tokens: int, element_bytes: int = 4) -> float:
        c = self.config
        run = tokens + (0 if c.keeps_class_token else 1)
        return transformer_activation_bytes(c.layers_run, c.hidden_size, c.intermediate_size, run, element_bytes,
                                            self.activation_checkpoint)

    def simulated_item(self, units: int) -> Tuple[int, int]:
        """Every image becomes the one square of image_size pixels, whatever its size: its
        placeholders (the class token's cost is in ``cost_coefficients``)."""
        n = self.config.tokens_per_image
        return n, n

    # --- checkpoints -------------------------------------------------------------------------
    @classmethod
    def params_from_preprocessor_config(cls, pp: Dict[str, Any]) -> Dict[str, Any]:
        """A ``CLIPImageProcessor`` / ``LlavaImageProcessor`` preprocessor_config.json ->
        params; settings the tower cannot take (no resize, no crop of a non-square resize,
        another rescale) are refused, naming the key."""
        refuse_unsupported_steps(pp, "the clip encoder's processor")
        out: Dict[str, Any] = normalisation_params(pp)
        size = pp.get("size")
        if isinstance(size, int):
            out["shortest_edge"] = size
        elif isinstance(size, dict) and size.get("shortest_edge") is not None:
            out["shortest_edge"] = int(size["shortest_edge"])
        elif isinstance(size, dict) and size.get("height") is not None:
            if size.get("height") != size.get("width"):
                raise ValueError(f"preprocessor_config.json: size={size} is not square; the tower takes a square")
            out.update(shortest_edge=int(size["height"]), resize_to_square=True)
        crop = pp.get("crop_size")
        if isinstance(crop, dict):
            if crop.get("height") != crop.get("width"):
                raise ValueError(f"preprocessor_config.json: crop_size={crop} is not square; the tower takes a square")
            crop = crop.get("height")
        if pp.get("do_center_crop") is False:
            if not out.get("resize_to_square"):
                raise ValueError("preprocessor_config.json: do_center_crop=false after a shortest-edge resize leaves "
                                 "images that are not square, which the tower cannot take")
        elif crop is not None:
            out["crop_size"] = int(crop)
        if pp.get("do_pad"):
            out["pad_to_square"] = True
        return out

    @classmethod
    def pretrained_projector(cls, path: str) -> Optional[PretrainedProjector]:
        """LLaVA's projector (``multi_modal_projector``: linear_1, the activation, linear_2, both
        as wide as the LLM), which is Omni's projector without a merge; None for a checkpoint
        without one (a CLIP model of its own)."""
        return llava_pretrained_projector(path, "llava")

    # --- export (omni.models.families) ---------------------------------------------------------
    def hf_preprocessor_config(self) -> Dict[str, Any]:
        """preprocessor_config.json of this tower's processor: a ``CLIPImageProcessor``, or a
        ``LlavaImageProcessor`` when it pads to a square (``params_from_preprocessor_config``
        reads it back)."""
        c = self.config
        edge = c.shortest_edge or c.image_size
        out = {"image_processor_type": "LlavaImageProcessor" if c.pad_to_square else "CLIPImageProcessor",
               "do_resize": True, "size": {"height": edge, "width": edge} if c.resize_to_square else {"shortest_edge": edge},
               "resample": BICUBIC, "do_center_crop": True, "crop_size": {"height": c.image_size, "width": c.image_size},
               "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(c.image_mean),
               "image_std": list(c.image_std), "do_convert_rgb": True}
        if c.pad_to_square:
            out["do_pad"] = True
        return out

