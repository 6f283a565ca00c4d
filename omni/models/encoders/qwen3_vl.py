"""The vision transformer of Qwen3-VL on packed images, with its DeepStack features.

What differs from the Qwen2-VL tower (``qwen_vl``), from the Qwen3-VL model card and the
configs of its Hugging Face checkpoints:

- **Patches of 16 pixels**, embedded by a Conv3d *with* a bias (here a Linear over the
  flattened patch, as in ``qwen_vl``), in the same merge-window order.
- **Learned absolute positions** besides the 2-D rotary ones: a square table of
  ``num_position_embeddings`` entries, resampled to each item's ``h x w`` grid by bilinear
  interpolation with aligned corners (each patch a weighted sum of four entries); every frame of
  a video repeats the image's.
- **Videos** as one item per temporal patch, a timestamp written before each
  (``Qwen3VisionProcessor``).
- **Blocks**: LayerNorm, fused qkv with bias, a plain ``linear_fc1``/``linear_fc2`` MLP (tanh
  GELU); attention over each frame of each item, no windows.
- **DeepStack**: the hidden states after the layers ``deepstack_visual_indexes`` are merged
  like the last one (each by a merger of its own, normed after the 2 x 2 shuffle) and added to
  the LLM's hidden states at the media positions after its first layers, one per layer.

The encoder returns every patch's last hidden state followed by those of the DeepStack layers,
side by side: ``[patches, hidden_size x (1 + len(deepstack_visual_indexes))]``. Its projector
(``DeepStackProjector``) merges each part with its merger and returns the LLM rows side by
side too, ``[patches / 4, llm_width x (1 + k)]``: the first ``llm_width`` columns are the
embeddings, the others the DeepStack residuals (``omni.models.multimodal`` splits them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from dataloading.formats.media import MediaItem
from dataloading.formats.video import frame_times
from parallel.transfer import to_device
from omni.models.encoders.base import EncoderAnchor, check_sizes
from omni.models.encoders.blocks import activation
from omni.models.encoders.qwen_vl import QwenTowerGeometry, QwenVisionEncoder, _Attention
from omni.models.encoders.qwen_vl_processor import QwenVisionProcessor
from omni.models.encoders.qwen_vl_windows import merge_order_positions
from omni.models.projector import Projector, PretrainedProjector
from omni.models.recompute import recompute

VARIANT = "qwen3_vl"


@dataclass
class Qwen3VisionConfig(QwenTowerGeometry):
    """Defaults follow Qwen3-VL-8B's vision tower; ``from_pretrained`` reads a checkpoint's."""

    variant: str = VARIANT  # what the shared Qwen processor reads; Qwen3-VL's only
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge: int = 2
    hidden_act: str = "gelu_pytorch_tanh"
    num_position_embeddings: int = 2304  # a square table: 48 x 48
    deepstack_visual_indexes: List[int] = field(default_factory=lambda: [8, 16, 24])
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # preprocessing (Qwen3-VL's image processor): pixel budget per image, mean/std 0.5
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: List[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: List[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    tokens_per_second: int = 2  # read by the shared processor for Qwen2.5-VL only

    def __post_init__(self) -> None:
        if self.variant != VARIANT:
            raise ValueError(f"Qwen3VisionEncoder variant {self.variant!r} is unknown; it is {VARIANT!r}")
        self.check_geometry()
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} is not a square table")
        self.deepstack_visual_indexes = [int(i) for i in self.deepstack_visual_indexes]
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.num_hidden_layers]
        if bad or len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
            raise ValueError(f"deepstack_visual_indexes {self.deepstack_visual_indexes} must be distinct layers of "
                             f"0..{self.num_hidden_layers - 1}")

    def windowed(self, layer: int) -> bool:
        """No window attention in Qwen3-VL (what ``QwenVisionEncoder``'s cost model asks)."""
        return False


class Qwen3VisionProcessor(QwenVisionProcessor):
    """Qwen's image processor with Qwen3-VL's patch, budget and normalisation.

    A video is sampled and resized as Qwen2-VL's (``QwenVisionProcessor.video``), and becomes one
    item per temporal patch, each of size (1, grid_h, grid_w) with the frame text Qwen3-VL's
    processor writes before it, ``<{seconds:.1f} seconds>``: the mean time of its two frames
    (transformers' ``Qwen3VLProcessor.replace_video_token``). The tower attends within each
    temporal patch and repeats its positions per frame, so the items encode as the clip would;
    the LLM places each as an image (transformers' ``get_rope_index`` splits the video's grid
    the same way), with the timestamp's tokens as text between them."""

    def frame_seconds(self, duration: float, n: int) -> np.ndarray:
        """Each temporal patch's time: the mean of its frames' (``frame_times``)."""
        return frame_times(duration, n).reshape(-1, self.frames).mean(axis=1)

    def video(self, clip: Any) -> List[MediaItem]:
        whole = super().video(clip)
        t, gh, gw = whole.size
        per = gh * gw
        seconds = self.frame_seconds(clip.meta["duration"], t * self.frames)
        rows, cols = gh // self.merge, gw // self.merge
        return [MediaItem(features=whole.features[i * per:(i + 1) * per], size=(1, gh, gw), num_tokens=rows * cols,
                          rope_grid=(1, rows, cols, 1.0), frame_text=_stamp(s)) for i, s in enumerate(seconds)]

    def frame_texts_from_meta(self, meta: Dict[str, Any]) -> List[str]:
        if "duration" not in meta:  # an image
            return []
        n = self.video_grid(meta)[0]
        return [_stamp(s) for s in self.frame_seconds(meta["duration"], n)]


def _stamp(seconds: float) -> str:
    return f"<{seconds:.1f} seconds>"


class _Block(nn.Module):
    def __init__(self, c: Qwen3VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=c.norm_eps)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=c.norm_eps)
        self.attn = _Attention(c)
        self.act = activation(c.hidden_act)
        self.mlp = nn.ModuleDict({"linear_fc1": nn.Linear(c.hidden_size, c.intermediate_size),
                                  "linear_fc2": nn.Linear(c.intermediate_size, c.hidden_size)})

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seg)
        return x + self.mlp["linear_fc2"](self.act(self.mlp["linear_fc1"](self.norm2(x))))


def interpolation_taps(grids: List[Tuple[int, int, int]], side: int, merge: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """On the host, for every patch of the packed items (merge-window order): the four entries
    of the ``side x side`` position table it interpolates and their weights (bilinear, aligned
    corners: the grid's first and last rows and columns take the table's), [patches, 4] each."""
    rows, cols, heights, widths = [], [], [], []
    for t, h, w in grids:
        pos = merge_order_positions(t, h, w, merge)
        rows.append(pos[:, 0])
        cols.append(pos[:, 1])
        heights.append(torch.full((pos.shape[0],), h))
        widths.append(torch.full((pos.shape[0],), w))

    def axis(index: torch.Tensor, size: torch.Tensor):
        src = index.float() * (side - 1) / (size - 1).clamp(min=1).float()
        low = src.floor()
        taps = (low.long()[:, None] + torch.arange(2)).clamp(0, side - 1)
        weights = (1 - (src[:, None] - low[:, None] - torch.arange(2)).abs()).clamp(min=0)
        return taps, weights

    h_taps, h_w = axis(torch.cat(rows), torch.cat(heights))
    w_taps, w_w = axis(torch.cat(cols), torch.cat(widths))
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weight = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return index, weight


class Qwen3VisionEncoder(QwenVisionEncoder):
    """Qwen3-VL's vision transformer (the mergers excluded: they are the projector).

    ``forward(features [sum t*h*w, C*T*P*P], sizes int64 [n, 3] = (t, h, w) per item)`` ->
    ``[sum t*h*w, hidden_size x (1 + DeepStack layers)]`` in the input's merge-window order: the
    last hidden state, then those after each DeepStack layer."""

    Config: ClassVar[type] = Qwen3VisionConfig
    hf_model_types: ClassVar[Tuple[str, ...]] = ("qwen3_vl", "qwen3_vl_moe")
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = ("model.visual.", "visual.")

    def __init__(self, config: Qwen3VisionConfig):
        EncoderAnchor.__init__(self, config)  # the blocks are Qwen3-VL's, not QwenVisionEncoder's
        c = config
        self.spatial_merge = c.spatial_merge
        self.deepstack_layers = len(c.deepstack_visual_indexes)
        self.width = c.hidden_size
        self.output_dim = c.hidden_size * (1 + self.deepstack_layers)
        self.patch_embed = nn.Linear(c.patch_dim, c.hidden_size)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.num_hidden_layers))

    @classmethod
    def processor(cls, config: Qwen3VisionConfig) -> Qwen3VisionProcessor:
        return Qwen3VisionProcessor(cls.build_config(config))

    def forward(self, features: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        c = self.config
        grids = [tuple(int(v) for v in row) for row in sizes.tolist()]
        check_sizes(type(self).__name__, features, (t * h * w for t, h, w in grids))
        x = self.patch_embed(features.to(self.patch_embed.weight.dtype))
        if not grids:
            return x.new_zeros(0, self.output_dim)
        device = x.device
        pos = torch.cat([merge_order_positions(t, h, w, c.spatial_merge) for t, h, w in grids])
        taps, weights = interpolation_taps(grids, math.isqrt(c.num_position_embeddings), c.spatial_merge)
        pos, taps, weights = to_device([pos, taps, weights], device)  # host-built, one batched copy
        x = x + (self.pos_embed(taps) * weights[:, :, None]).sum(1).to(x.dtype)
        half = c.head_dim // 2
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, half, 2, device=device).float() / half)
        angles = torch.cat([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], dim=-1).float()
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        frames = self._segments_spec([h * w for t, h, w in grids for _ in range(t)], device)
        stacked = {}  # layer -> its hidden state, for DeepStack
        for i, block in enumerate(self.blocks):  # under parallel.encoder_activation_checkpoint
            x = recompute(block, x, cos, sin, frames, mode=self.activation_checkpoint)
            if i in c.deepstack_visual_indexes:
                stacked[i] = x
        return torch.cat([x] + [stacked[i] for i in c.deepstack_visual_indexes], dim=1)

    def feature_width(self) -> int:
        return self.config.patch_dim

    # --- checkpoints -------------------------------------------------------------------------
    @classmethod
    def params_from_hf_config(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        """A Qwen3-VL config.json (the whole model's: its ``vision_config``) -> params."""
        v = cls.vision_config_of(hf_config)
        rope = v.get("rope_parameters") or {}
        out = {"hidden_size": v.get("hidden_size"), "intermediate_size": v.get("intermediate_size"),
               "num_hidden_layers": v.get("depth"), "num_attention_heads": v.get("num_heads"),
               "in_channels": v.get("in_channels"), "patch_size": v.get("patch_size"),
               "temporal_patch_size": v.get("temporal_patch_size"), "spatial_merge": v.get("spatial_merge_size"),
               "hidden_act": v.get("hidden_act"), "num_position_embeddings": v.get("num_position_embeddings"),
               "deepstack_visual_indexes": v.get("deepstack_visual_indexes"),
               "rope_theta": rope.get("rope_theta", v.get("rope_theta"))}
        return {k: val for k, val in out.items() if val is not None}

    @classmethod
    def hf_name(cls, name: str) -> str:
        if name.startswith("patch_embed."):
            return "patch_embed.proj." + name.split(".", 1)[1]
        return name

    @classmethod
    def vision_config_of(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        """The tower's ``vision_config`` in a config.json (Qwen3-VL's: at the top)."""
        return dict(hf_config.get("vision_config") or {})

    @classmethod
    def merger_names(cls, layers: int, prefix: str) -> Dict[str, str]:
        """``DeepStackProjector``'s tensor names -> the checkpoint's (``deepstack_names``)."""
        return deepstack_names(layers, prefix)

    @classmethod
    def pretrained_projector(cls, path: str) -> Optional[PretrainedProjector]:
        """The checkpoint's merger and DeepStack mergers (``DeepStackProjector``)."""
        from omni.models.hf_checkpoint import CheckpointReader, read_hf_config

        hf = read_hf_config(path)
        params = cls.build_config(cls.params_from_hf_config(hf))
        layers = len(params.deepstack_visual_indexes)
        reader = CheckpointReader(path)
        prefix = next((p for p in cls.hf_weight_prefixes if cls.merger_names(layers, p)["merger.fc1.weight"] in reader),
                      None)
        if prefix is None:
            return None
        width = params.hidden_size * params.spatial_merge ** 2
        return PretrainedProjector(out_dim=int(cls.vision_config_of(hf).get("out_hidden_size")), hidden=width,
                                   names=cls.merger_names(layers, prefix))

    def new_projector(self, llm_width: int, **kwargs: Any) -> nn.Module:
        """Qwen3-VL's mergers (``DeepStackProjector``); ``kwargs`` (a slot's MLP shape) do not
        apply: every merger is as wide as its input, as the family's."""
        return DeepStackProjector(self.width, llm_width, self.tokens_per_row, self.deepstack_layers)

    def hf_vision_config(self, out_dim: int) -> Dict[str, Any]:
        """The checkpoint's ``vision_config`` of this tower, whose mergers map into ``out_dim``."""
        c = self.config
        return {"depth": c.num_hidden_layers, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                "num_heads": c.num_attention_heads, "in_channels": c.in_channels, "patch_size": c.patch_size,
                "temporal_patch_size": c.temporal_patch_size, "spatial_merge_size": c.spatial_merge,
                "hidden_act": c.hidden_act, "num_position_embeddings": c.num_position_embeddings,
                "deepstack_visual_indexes": list(c.deepstack_visual_indexes), "out_hidden_size": out_dim,
                "rope_parameters": {"rope_type": "axial", "rope_theta": c.rope_theta}}


class _PostShuffleMerger(nn.Module):
    """A DeepStack merger: the ``merge`` neighbours concatenated, then normed, then the MLP."""

    def __init__(self, width: int, out_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(width, eps=1e-6)
        self.fc1 = nn.Linear(width, width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.norm(x))))


class DeepStackProjector(nn.Module):
    """Qwen3-VL's mergers over a ``Qwen3VisionEncoder``'s output: the last hidden state through
    the patch merger (normed before the 2 x 2 shuffle: Omni's ``Projector``), each DeepStack
    layer's through its own merger; the rows side by side, ``[n / merge, out_dim x (1 + k)]``.
    ``deepstack_layers`` (k) tells the model how many LLM layers take a residual."""

    def __init__(self, in_dim: int, out_dim: int, merge: int, deepstack_layers: int):
        super().__init__()
        self.in_dim, self.merge, self.deepstack_layers = in_dim, merge, deepstack_layers
        self.merger = Projector(in_dim, out_dim, merge=merge, norm="layer", hidden=in_dim * merge)
        self.deepstack = nn.ModuleList(_PostShuffleMerger(in_dim * merge, out_dim) for _ in range(deepstack_layers))

    def forward(self, x: torch.Tensor, sizes: Optional[torch.Tensor] = None) -> torch.Tensor:
        d, n = self.in_dim, x.shape[0] // self.merge
        parts = [self.merger(x[:, :d])]
        parts += [m(x[:, d * (i + 1):d * (i + 2)].reshape(n, d * self.merge)) for i, m in enumerate(self.deepstack)]
        return torch.cat(parts, dim=1)


def deepstack_names(layers: int, prefix: str) -> Dict[str, str]:
    """``DeepStackProjector``'s tensor names -> the checkpoint's (below ``prefix``)."""
    names = {"merger.norm.weight": "merger.norm.weight", "merger.norm.bias": "merger.norm.bias"}
    for ours, theirs in (("fc1", "linear_fc1"), ("fc2", "linear_fc2")):
        for kind in ("weight", "bias"):
            names[f"merger.{ours}.{kind}"] = f"merger.{theirs}.{kind}"
            for i in range(layers):
                names[f"deepstack.{i}.{ours}.{kind}"] = f"deepstack_merger_list.{i}.{theirs}.{kind}"
    for i in range(layers):
        for kind in ("weight", "bias"):
            names[f"deepstack.{i}.norm.{kind}"] = f"deepstack_merger_list.{i}.norm.{kind}"
    return {k: prefix + v for k, v in names.items()}
