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
- **Projector** (``LlavaOvProjector``): LLaVA's two-layer MLP on every tile token, then each
  item laid out from its size: tiles stitched, unpadded, shrunk and a learned ``image_newline``
  after each row (base image first); video frames pooled 2 x 2 and one newline at the end.
  The rearrangement needs whole items, so the tower does not run sequence-parallel.

Written from transformers' ``LlavaOnevisionForConditionalGeneration`` and its image processor
as described there (not copied); the parity tests hold it to them.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from dataloading.formats.media import MediaItem
from dataloading.formats.video import frame_times, sample_count
from omni.models.encoders.anyres import AnyresImageProcessor, AnyresLayout, checked_pinpoints
from omni.models.encoders.base import (EncoderAnchor, HostSizes, activation, check_sizes, transformer_activation_bytes,
                                       transformer_flops)
from omni.models.encoders.clip import TOWER_PREFIXES, llava_pretrained_projector
from omni.models.encoders.images import normalisation_params, resized, rgb_uint8
from omni.models.encoders.siglip import sincos_2d
from omni.models.encoders.vit import ViTLayers
from omni.models.projector import PretrainedProjector, Projector

_BICUBIC = 3  # PIL's code for bicubic resampling (transformers' PILImageResampling.BICUBIC)
_ASPECT = re.compile(r"^anyres_max_(\d+)$")


def default_pinpoints(image_size: int) -> List[List[int]]:
    """LLaVA-OneVision's tilings: 1 to 6 tiles per side, every combination."""
    return [[image_size * r, image_size * c] for r in range(1, 7) for c in range(1, 7)]


@dataclass
class LlavaOvEncoderConfig:
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
        for key in ("image_size", "patch_size"):
            value = getattr(self, key)
            if isinstance(value, (list, tuple)):
                if len(set(value)) != 1:
                    raise ValueError(f"LlavaOvEncoder needs a square {key}, got {value}")
                setattr(self, key, int(value[0]))
        if not isinstance(self.vision_feature_layer, int):
            raise ValueError(f"vision_feature_layer={self.vision_feature_layer}: features concatenated from several "
                             f"layers are not supported; the llava_ov encoder takes one layer")
        n = self.num_hidden_layers
        if not -(n + 1) <= self.vision_feature_layer <= n:
            raise ValueError(f"vision_feature_layer={self.vision_feature_layer} is not a hidden state of a tower of {n} "
                             f"layers (use {-(n + 1)}..{n})")
        if self.vision_feature_select_strategy != "full":
            raise ValueError(f"vision_feature_select_strategy={self.vision_feature_select_strategy!r}: a SigLIP tower has "
                             f"no class token to drop; LLaVA-OneVision takes 'full'")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads}")
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
        self.image_mean = [float(v) for v in self.image_mean]
        self.image_std = [float(v) for v in self.image_std]
        if len(self.image_mean) != self.num_channels or len(self.image_std) != self.num_channels:
            raise ValueError(f"image_mean and image_std need {self.num_channels} values (num_channels)")
        if not 1 <= self.min_frames <= self.max_frames or not self.video_fps > 0:
            raise ValueError(f"need video_fps > 0 and 1 <= min_frames ({self.min_frames}) <= max_frames "
                             f"({self.max_frames})")
        activation(self.hidden_act)  # fail early on an unknown name

    @property
    def side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def layers_run(self) -> int:
        layer = self.vision_feature_layer
        return layer if layer >= 0 else self.num_hidden_layers + 1 + layer

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


def simulated_anyres_image(layout: AnyresLayout, units: int) -> Tuple[int, int]:
    """(tower tokens, LLM rows) of an image of about ``units`` patches for the simulator: a
    square of sqrt(units) patches, cut into its base image and tiles as the layout cuts it
    (``side``^2 tokens a square), its rows the layout's (unpadded, shrunk, newlines)."""
    px = max(1, round(math.sqrt(units) * layout.patch_size))
    r, c = layout.tiles(px, px)
    return (1 + r * c) * layout.side ** 2, layout.image_tokens(px, px)


class _Embeddings(nn.Module):
    def __init__(self, c: LlavaOvEncoderConfig):
        super().__init__()
        self.patch_embedding = nn.Linear(c.num_channels * c.patch_size ** 2, c.hidden_size)
        self.position_embedding = nn.Embedding(c.side ** 2, c.hidden_size)
        with torch.no_grad():  # from scratch: where a patch sits is readable from step 0 (see siglip)
            self.position_embedding.weight.copy_(sincos_2d(c.side, c.hidden_size))


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


class LlavaOvEncoder(EncoderAnchor):
    """LLaVA-OneVision's SigLIP tower (see the module doc).

    ``forward(features [sum squares*side*side, C*P*P], sizes int64 [n, 4])`` -> the chosen
    hidden state of every patch of every square, item after item. Parameter names equal
    transformers' ``SiglipVisionModel``'s (its head apart), so a checkpoint loads key by key."""

    modality: ClassVar[str] = "image"
    Config: ClassVar[type] = LlavaOvEncoderConfig
    hf_model_types: ClassVar[Tuple[str, ...]] = ("llava_onevision", "siglip_vision_model", "siglip")
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = TOWER_PREFIXES

    def __init__(self, config: LlavaOvEncoderConfig):
        super().__init__(config)
        c = config
        self.output_dim = c.hidden_size
        self.embeddings = _Embeddings(c)
        self.encoder = ViTLayers(c)
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        # Never run: frozen, so that no optimizer step moves weights that only travel with the checkpoint.
        for unused in [*self.encoder.layers[c.layers_run:], self.post_layernorm]:
            unused.requires_grad_(False)

    @classmethod
    def processor(cls, config: LlavaOvEncoderConfig) -> LlavaOvProcessor:
        return LlavaOvProcessor(cls.build_config(config))

    def new_projector(self, llm_width: int, **kwargs: Any) -> LlavaOvProjector:
        return LlavaOvProjector(self.output_dim, llm_width, self.config.layout, **kwargs)

    def fresh_projector(self) -> Dict[str, Any]:
        """LLaVA's MLP: as wide as the LLM, so that a model trained from scratch exports."""
        return {"hidden_mult": 1.0}

    def init_rule(self, owner: nn.Module, path: str, attr: str):
        if path == "embeddings.position_embedding" and attr == "weight":
            from omni.models.materialize import Computed

            c = self.config
            return Computed(lambda: sincos_2d(c.side, c.hidden_size))
        return None

    def input_units(self, sizes: torch.Tensor) -> List[int]:
        """One feature row per patch: squares * side^2 per item."""
        return [int(row[0]) * self.config.side ** 2 for row in sizes.tolist()]

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
    def attention_heads(self) -> int:
        return self.config.num_attention_heads

    def layer_modules(self) -> List[nn.Module]:
        """The layers that run (up to ``vision_feature_layer``); the rest never do."""
        return list(self.encoder.layers[:self.config.layers_run])

    def simulated_item(self, units: int) -> Tuple[int, int]:
        """Base image and anyres tiles (``simulated_anyres_image``)."""
        return simulated_anyres_image(self.config.layout, units)

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
        vision = config if kind == "siglip_vision_model" else config.vision_config
        if vision.model_type != "siglip_vision_model":
            raise ValueError(f"this {kind} checkpoint's vision tower is {vision.model_type!r}; the llava_ov encoder "
                             f"loads SigLIP towers (siglip_vision_model) only")
        v = vision.to_dict()
        out.update({k: v[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                      "num_channels", "image_size", "patch_size", "layer_norm_eps", "hidden_act")})
        return out

    @classmethod
    def params_from_preprocessor_config(cls, pp: Dict[str, Any]) -> Dict[str, Any]:
        """A ``LlavaOnevisionImageProcessor`` preprocessor_config.json -> params (its
        normalisation); settings the processor does not follow are refused, naming the key."""
        for key in ("do_resize", "do_rescale", "do_normalize", "do_pad"):
            if pp.get(key) is False:
                raise ValueError(f"preprocessor_config.json: {key}=false is not supported by the llava_ov processor")
        if pp.get("do_center_crop"):
            raise ValueError("preprocessor_config.json: do_center_crop=true is not supported by the llava_ov processor")
        if pp.get("resample", _BICUBIC) != _BICUBIC:
            raise ValueError(f"preprocessor_config.json: resample={pp['resample']} is not supported (bicubic, 3, is)")
        if abs(float(pp.get("rescale_factor", 1 / 255)) - 1 / 255) > 1e-12:
            raise ValueError(f"preprocessor_config.json: rescale_factor={pp['rescale_factor']} is not supported")
        return normalisation_params(pp)

    def convert_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name == "embeddings.patch_embedding.weight" and tensor.dim() == 4:
            return tensor.reshape(tensor.shape[0], -1)  # Conv2d [D, C, p, p] -> Linear [D, C*p*p]
        return tensor

    def to_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Our tensor ``name`` in the checkpoint's shape (``convert_hf_tensor``'s inverse)."""
        if name == "embeddings.patch_embedding.weight":
            c = self.config
            return tensor.reshape(tensor.shape[0], c.num_channels, c.patch_size, c.patch_size)
        return tensor

    @classmethod
    def pretrained_projector(cls, path: str) -> Optional[PretrainedProjector]:
        """The checkpoint's ``multi_modal_projector`` (LLaVA's MLP) and ``image_newline``; None
        for a SigLIP checkpoint of its own."""
        return llava_pretrained_projector(path, "llava_onevision", newline=True)

    # --- export (omni.models.hf_vlm) ------------------------------------------------------------
    def hf_vision_config(self) -> Dict[str, Any]:
        """The checkpoint's ``vision_config`` (a ``SiglipVisionConfig`` without the pooling head)."""
        c = self.config
        return {"model_type": "siglip_vision_model", "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
                "num_attention_heads": c.num_attention_heads, "num_channels": c.num_channels,
                "image_size": c.image_size, "patch_size": c.patch_size, "layer_norm_eps": c.layer_norm_eps,
                "hidden_act": c.hidden_act, "vision_use_head": False}

    def hf_layout_config(self) -> Dict[str, Any]:
        """The ``LlavaOnevisionConfig`` fields of the feature choice and the layout."""
        c = self.config
        return {"vision_feature_layer": c.vision_feature_layer,
                "vision_feature_select_strategy": c.vision_feature_select_strategy,
                "image_grid_pinpoints": [list(p) for p in c.image_grid_pinpoints],
                "vision_aspect_ratio": c.vision_aspect_ratio}
