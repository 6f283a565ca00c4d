"""LLaVA-OneVision's vision side: a SigLIP tower on fixed-size tiles, and the projector that
lays the tiles' features out for the LLM.

- **Tower**: transformers' ``SiglipVisionModel`` without its pooling head (patch embedding, a
  learned position table for the tower's one square size, the pre-norm layers of
  ``omni.models.encoders.vit``). LLaVA-OneVision projects ``hidden_states[vision_feature_layer]``
  (-1: the last layer's output, before the post-layernorm), so the layers after that one and the
  post-layernorm never run: they are kept, frozen, only so that the checkpoint loads and exports
  whole. Every tile (and every video frame) attends within itself.
- **Items** (``LlavaOvProcessor``): an image becomes its base image and its tiles
  (``omni.models.encoders.anyres``), a video its frames, each square of ``image_size`` pixels.
  An item's size is ``(squares, height, width, video)``: the number of squares, the original
  height and width in pixels (the image's; a video's frame size), and 1 for a video.
- **Projector** (``anyres.LlavaOvProjector``): LLaVA's two-layer MLP on every tile token, then each
  item laid out from its size: tiles stitched, unpadded, shrunk and a learned ``image_newline``
  after each row (base image first); video frames pooled 2 x 2 and one newline at the end.
  The rearrangement needs whole items, so the tower does not run sequence-parallel.

Written from transformers' ``LlavaOnevisionForConditionalGeneration`` and its image processor
as described there (not copied); the parity tests hold it to them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from torch import nn

from dataloading.formats.media import MediaItem
from dataloading.formats.video import frame_times, sample_count
from omni.models.encoders.anyres import AnyresImageProcessor, AnyresLayout, AnyresTower, checked_pinpoints
from omni.models.encoders.base import check_sizes
from omni.models.encoders.blocks import activation, transformer_activation_bytes, transformer_flops
from omni.models.encoders.clip import TOWER_PREFIXES
from omni.models.encoders.llava_projector import llava_pretrained_projector
from omni.models.encoders.images import (checked_mean_std, normalisation_params, refuse_unsupported_steps, resized,
                                         rgb_uint8)
from omni.models.encoders.vit import FeatureLayerFields, FeatureLayerTower, PatchEmbeddings, ViTLayers, feature_layers_run
from omni.models.projector import PretrainedProjector

_ASPECT = re.compile(r"^anyres_max_(\d+)$")


def default_pinpoints(image_size: int) -> List[List[int]]:
    """LLaVA-OneVision's tilings: 1 to 6 tiles per side, every combination."""
    return [[image_size * r, image_size * c] for r in range(1, 7) for c in range(1, 7)]


@dataclass
class LlavaOvEncoderConfig(FeatureLayerFields):
    """Defaults: llava-onevision-qwen2's tower (SigLIP so400m at 384 pixels) and layout;
    ``from_pretrained`` reads a checkpoint's."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 26
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 384
    patch_size: int = 14
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    # The hidden state the projector takes (transformers' hidden_states index: 0 is the
    # embedding, -1 the last layer's output).
    vision_feature_layer: int = -1
    # full: every patch token. (default would drop the first token, a class token SigLIP does
    # not have; transformers' layout then fails, so it is refused.)
    vision_feature_select_strategy: str = "full"
    image_grid_pinpoints: Optional[List[List[int]]] = None  # None: default_pinpoints(image_size)
    vision_aspect_ratio: str = "anyres_max_9"
    image_mean: List[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: List[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    # Video sampling: video_fps frames a second, within [min_frames, max_frames].
    video_fps: float = 1.0
    min_frames: int = 1
    max_frames: int = 32

    def __post_init__(self) -> None:
        self.check_squares("LlavaOvEncoder")
        if not isinstance(self.vision_feature_layer, int):
            raise ValueError(f"vision_feature_layer={self.vision_feature_layer}: features concatenated from several "
                             f"layers are not supported; the llava_ov encoder takes one layer")
        feature_layers_run(self.vision_feature_layer, self.num_hidden_layers)
        if self.vision_feature_select_strategy != "full":
            raise ValueError(f"vision_feature_select_strategy={self.vision_feature_select_strategy!r}: a SigLIP tower has "
                             f"no class token to drop; LLaVA-OneVision takes 'full'")
        if self.image_size < self.patch_size:
            raise ValueError(f"image_size {self.image_size} is smaller than patch_size {self.patch_size}")
        # An image_size that is no whole number of patches (the real 384-pixel tiles of 14-pixel
        # patches) is what the checkpoints have: the patch convolution covers image_size //
        # patch_size patches a side and drops the last pixels (AnyresProcessor._patches too).
        if self.image_grid_pinpoints is None:
            self.image_grid_pinpoints = default_pinpoints(self.image_size)
        self.image_grid_pinpoints = checked_pinpoints(self.image_grid_pinpoints, self.image_size)
        if _ASPECT.match(str(self.vision_aspect_ratio)) is None:
            raise ValueError(f"vision_aspect_ratio={self.vision_aspect_ratio!r} is not of the form anyres_max_N")
        self.image_mean, self.image_std = checked_mean_std(self.image_mean, self.image_std, self.num_channels)
        if not 1 <= self.min_frames <= self.max_frames or not self.video_fps > 0:
            raise ValueError(f"need video_fps > 0 and 1 <= min_frames ({self.min_frames}) <= max_frames "
                             f"({self.max_frames})")
        activation(self.hidden_act)  # fail early on an unknown name

    @property
    def layout(self) -> AnyresLayout:
        max_tiles = int(_ASPECT.match(self.vision_aspect_ratio).group(1))
        return AnyresLayout(self.image_size, self.patch_size, tuple(tuple(p) for p in self.image_grid_pinpoints),
                            max_tiles)


class LlavaOvProcessor(AnyresImageProcessor):
    """An image -> its base image and tiles (``AnyresImageProcessor``, as transformers'
    ``LlavaOnevisionImageProcessor`` makes them); a video -> its frames, each squashed to one
    square. Video frames are resized as images are (transformers' video processor resizes with
    torchvision, so its pixels may differ by resampling rounding). ``anyres=False`` (a source's
    option): the base image alone, padded to a square with the mean colour first, as
    transformers treats the images of a sample that has several."""

    def __init__(self, config: LlavaOvEncoderConfig):
        super().__init__(config.layout, config.num_channels, config.image_mean, config.image_std)
        self.fps, self.min_frames, self.max_frames = config.video_fps, config.min_frames, config.max_frames

    def with_options(self, anyres: Optional[bool] = None, fps: Optional[float] = None, min_frames: Optional[int] = None,
                     max_frames: Optional[int] = None) -> "LlavaOvProcessor":
        """A copy with one data source's settings: ``anyres`` (mixture ``image:`` options) and
        video sampling (``video:`` options)."""
        other = super().with_options(anyres=anyres)
        other.fps = float(fps) if fps is not None else self.fps
        other.min_frames = int(min_frames) if min_frames is not None else self.min_frames
        other.max_frames = int(max_frames) if max_frames is not None else self.max_frames
        if not 1 <= other.min_frames <= other.max_frames or not other.fps > 0:
            raise ValueError(f"need fps > 0 and 1 <= min_frames ({other.min_frames}) <= max_frames ({other.max_frames})")
        return other

    def frames(self, meta: Dict[str, Any]) -> int:
        """Frames sampled from a video of header ``meta`` (``dataloading.formats.video.video_meta``)."""
        return sample_count(meta, self.fps, self.min_frames, self.max_frames, 1)

    def num_tokens_from_meta(self, meta: Dict[str, Any]) -> int:
        if "duration" in meta:
            return self.layout.video_tokens(self.frames(meta))
        return super().num_tokens_from_meta(meta)

    def video(self, clip: Any) -> MediaItem:
        """A ``dataloading.formats.video.Video`` -> one item of its sampled frames, each squashed to the
        tower's square."""
        meta = clip.meta
        n, s = self.frames(meta), self.layout.image_size
        frames = [resized(rgb_uint8(f, self.channels), s, s) for f in clip.frames(frame_times(meta["duration"], n))]
        return MediaItem(features=self._patches(frames), size=(n, int(meta["height"]), int(meta["width"]), 1),
                         num_tokens=self.layout.video_tokens(n))


class LlavaOvEncoder(AnyresTower, FeatureLayerTower):
    """LLaVA-OneVision's SigLIP tower (see the module doc).

    ``forward(features [sum squares*side*side, C*P*P], sizes int64 [n, 4])`` -> the chosen
    hidden state of every patch of every square, item after item. Parameter names equal
    transformers' ``SiglipVisionModel``'s (its head apart), so a checkpoint loads key by key."""

    Config: ClassVar[type] = LlavaOvEncoderConfig
    hf_model_types: ClassVar[Tuple[str, ...]] = ("llava_onevision", "siglip_vision_model", "siglip")
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = TOWER_PREFIXES
    plugin: ClassVar[str] = "llava_ov"
    tower_name: ClassVar[str] = "SigLIP"
    vision_model_type: ClassVar[str] = "siglip_vision_model"
    hf_vision_extra: ClassVar[Dict[str, Any]] = {"vision_use_head": False}  # no pooling head

    def __init__(self, config: LlavaOvEncoderConfig):
        super().__init__(config)
        c = config
        self.output_dim = c.hidden_size
        self.embeddings = PatchEmbeddings(c.num_channels, c.patch_size, c.side, c.hidden_size)
        self.encoder = ViTLayers(c)
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.freeze_unused()

    @classmethod
    def processor(cls, config: LlavaOvEncoderConfig) -> LlavaOvProcessor:
        return LlavaOvProcessor(cls.build_config(config))

    def forward(self, features: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        c = self.config
        t = c.side ** 2
        squares = sum(int(row[0]) for row in sizes.tolist())
        check_sizes(type(self).__name__, features, self.input_units(sizes))
        emb = self.embeddings
        x = emb.patch_embedding(features.to(emb.patch_embedding.weight.dtype)).view(squares, t, c.hidden_size)
        x = (x + emb.position_embedding.weight.to(x.dtype)).reshape(squares * t, c.hidden_size)
        if squares:  # each square attends within itself
            x = self.run_layers(self.encoder.layers[:c.layers_run], x, self.item_attention([t] * squares, x.device))
        return x

    # --- the planner's view --------------------------------------------------------------------
    def cost_coefficients(self) -> Tuple[float, float]:
        """Per LLM row: an item of n rows runs about n / side^2 squares of side^2 tokens each
        (unpadding and newlines aside), so its cost is linear in n."""
        c = self.config
        alpha, beta = transformer_flops(c.layers_run, c.hidden_size, c.intermediate_size)
        return 0.0, alpha * c.side ** 2 + beta + 2.0 * c.num_channels * c.patch_size ** 2 * c.hidden_size

    def activation_bytes(self, tokens: int, element_bytes: int = 4) -> float:
        c = self.config
        return transformer_activation_bytes(c.layers_run, c.hidden_size, c.intermediate_size, tokens, element_bytes,
                                            self.activation_checkpoint)

    # --- what the simulator asks (omni.sim.spec) ------------------------------------------------
    def simulated_clip(self, frames: int, units: int) -> Tuple[int, int, int]:
        """One item: the frames sampled within [min_frames, max_frames], each squashed to one
        square whatever its size; its rows the pooled frames and a newline."""
        c = self.config
        n = min(max(frames, c.min_frames), c.max_frames)
        return 1, n * c.side ** 2, c.layout.video_tokens(n)

    # --- checkpoints -------------------------------------------------------------------------
    @classmethod
    def params_from_hf_config(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        """A LLaVA-OneVision config.json (its ``vision_config`` and layout) or a SigLIP one ->
        params; keys the file leaves out take transformers' defaults."""
        from omni.models.hf_checkpoint import transformers_config

        config = transformers_config(hf_config)
        out: Dict[str, Any] = {}
        kind = hf_config.get("model_type")
        if kind == "llava_onevision":
            out.update(vision_feature_layer=config.vision_feature_layer,
                       vision_feature_select_strategy=config.vision_feature_select_strategy,
                       image_grid_pinpoints=[list(p) for p in config.image_grid_pinpoints],
                       vision_aspect_ratio=config.vision_aspect_ratio)
        out.update(cls.vision_params(config if kind == "siglip_vision_model" else config.vision_config, kind))
        return out

    @classmethod
    def params_from_preprocessor_config(cls, pp: Dict[str, Any]) -> Dict[str, Any]:
        """A ``LlavaOnevisionImageProcessor`` preprocessor_config.json -> params (its
        normalisation); settings the processor does not follow are refused, naming the key."""
        refuse_unsupported_steps(pp, "the llava_ov processor", ("do_resize", "do_rescale", "do_normalize", "do_pad"))
        if pp.get("do_center_crop"):
            raise ValueError("preprocessor_config.json: do_center_crop=true is not supported by the llava_ov processor")
        return normalisation_params(pp)

    @classmethod
    def pretrained_projector(cls, path: str) -> Optional[PretrainedProjector]:
        """The checkpoint's ``multi_modal_projector`` (LLaVA's MLP) and ``image_newline``; None
        for a SigLIP checkpoint of its own."""
        return llava_pretrained_projector(path, "llava_onevision", newline=True)

    # --- export (omni.models.families) ---------------------------------------------------------
    def hf_layout_config(self) -> Dict[str, Any]:
        """The ``LlavaOnevisionConfig`` fields of the feature choice and the layout."""
        return {**super().hf_layout_config(), "vision_aspect_ratio": self.config.vision_aspect_ratio}
