"""The vision transformer of Qwen2-VL and Qwen2.5-VL on packed images and videos.

What is Qwen's own, written from the models' published description (Qwen2-VL and Qwen2.5-VL
technical reports, and the configs of their Hugging Face checkpoints):

- **Inputs**: each item is a grid of ``t x h x w`` patches, ``t`` temporal patches of
  ``temporal_patch_size`` frames (a still image repeats its frame), each patch flattened as
  (channel, frame, row, col) — the order of the Conv3d that embeds it, which here is a Linear
  over the flattened patch. Patches come in *merge-window order*: the ``spatial_merge`` x
  ``spatial_merge`` neighbours that the patch merger turns into one LLM token are consecutive,
  windows in raster order, frame after frame (Qwen's image processor writes them so).
- **2-D rotary positions**: a quarter of each head's dimensions rotate with the patch's row,
  a quarter with its column (the same frequencies for both), over the whole head as
  ``rotate_half`` pairs; every frame of a video repeats the image's positions.
- **Attention** stays inside each frame of each item. Qwen2.5-VL attends inside windows of
  ``window_size`` pixels (whole merge groups, windows in raster order, the last ones cut by the
  frame's edge) in every layer but ``fullatt_block_indexes``, which attend over the frame.
  Qwen2.5-VL reorders tokens window by window to use a varlen kernel; attention only depends on
  which tokens share a segment, so here segment ids select the same sets in place and no
  reordering is needed.
- **Blocks**: pre-norm, fused qkv with bias. Qwen2-VL: LayerNorm and a ``fc1``/``fc2`` MLP
  (quick GELU); Qwen2.5-VL: RMSNorm and a gated ``gate/up/down`` MLP (SiLU), all with bias.

The encoder returns every patch's hidden state, in the input's merge-window order: the patch
merger (a norm, then an MLP over each group of ``spatial_merge ** 2`` patches) is the
projector's job in Omni (``omni.models.projector``), as it is the merger's in Qwen. The
processor is ``qwen_vl_processor``; the patches' positions and windows, ``qwen_vl_windows``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from torch import nn

from parallel.transfer import to_device
from omni.kernels.segment_attention import segment_attention
from omni.models.attention import PackedSegments, uses_varlen_kernels
from omni.models.encoders.base import EncoderAnchor, check_sizes
from omni.models.encoders.blocks import activation
from omni.models.encoders.images import checked_mean_std, normalisation_params
from omni.models.encoders.qwen_vl_processor import QwenVisionProcessor
from omni.models.encoders.qwen_vl_windows import merge_order_positions, window_order
from omni.models.llm.layers import RMSNorm
from omni.models.projector import PretrainedProjector
from omni.models.recompute import recompute

VARIANTS = ("qwen2_vl", "qwen2_5_vl")


class QwenTowerGeometry:
    """What the Qwen towers' configs share (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the head and patch
    sizes and the checks on them. A mixin of the config dataclasses."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def check_geometry(self) -> None:
        """Heads that split the width into a multiple of 4 (a quarter rotates with the row, a
        quarter with the column), an image of at least one merge group within the pixel budget,
        and the normalisation's shape."""
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.head_dim % 4:
            raise ValueError(f"the head dimension {self.head_dim} must be a multiple of 4 (a quarter rotates with "
                             f"the row, a quarter with the column)")
        if self.spatial_merge < 1:
            raise ValueError(f"spatial_merge must be >= 1, got {self.spatial_merge}")
        activation(self.hidden_act)
        side = self.patch_size * self.spatial_merge
        if not side * side <= self.min_pixels <= self.max_pixels:
            raise ValueError(f"need {side}x{side} = {side * side} <= min_pixels ({self.min_pixels}) <= max_pixels "
                             f"({self.max_pixels}): an image is at least one merge group")
        self.image_mean, self.image_std = checked_mean_std(self.image_mean, self.image_std, self.in_channels, "in_channels")


@dataclass
class QwenVisionConfig(QwenTowerGeometry):
    """Defaults follow Qwen2.5-VL-7B's vision tower; ``from_pretrained`` reads a checkpoint's."""

    variant: str = "qwen2_5_vl"  # qwen2_vl | qwen2_5_vl: norms, MLP and window attention
    hidden_size: int = 1280  # the ViT's width (Qwen2-VL's config calls it embed_dim)
    intermediate_size: int = 3420
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge: int = 2
    hidden_act: str = "silu"
    window_size: int = 112  # pixels per window side (Qwen2.5-VL); 0: every layer attends the frame
    fullatt_block_indexes: List[int] = field(default_factory=lambda: [7, 15, 23, 31])
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # preprocessing (Qwen's image processor): pixel budget per image, CLIP's normalisation
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: List[float] = field(default_factory=lambda: [0.48145466, 0.4578275, 0.40821073])
    image_std: List[float] = field(default_factory=lambda: [0.26862954, 0.26130258, 0.27577711])
    # videos (Qwen2.5-VL): temporal rotary positions per second of video; Qwen2-VL steps by one
    # per temporal patch whatever the frame rate
    tokens_per_second: int = 2

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"QwenVisionEncoder variant {self.variant!r} is unknown; use one of {VARIANTS}")
        self.check_geometry()
        if self.window_size and self.window_size % (self.spatial_merge * self.patch_size):
            raise ValueError(f"window_size {self.window_size} must be a multiple of spatial_merge x patch_size "
                             f"({self.spatial_merge * self.patch_size}) pixels")
        self.fullatt_block_indexes = [int(i) for i in self.fullatt_block_indexes]
        self.tokens_per_second = int(self.tokens_per_second)
        if not self.tokens_per_second > 0:
            raise ValueError(f"tokens_per_second must be > 0, got {self.tokens_per_second}")

    def windowed(self, layer: int) -> bool:
        """Whether ``layer`` attends inside windows (Qwen2.5-VL's layers but the full ones)."""
        return self.variant == "qwen2_5_vl" and self.window_size > 0 and layer not in self.fullatt_block_indexes


class _Attention(nn.Module):
    def __init__(self, c: QwenVisionConfig):
        super().__init__()
        self.heads = c.num_attention_heads
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seg: Optional[PackedSegments]) -> torch.Tensor:
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.heads, d // self.heads).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        o = segment_attention(q, k, v, None, causal=False) if seg is None else seg.attend(q, k, v, None)
        return self.proj(o[0].transpose(0, 1).reshape(n, d))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the whole head (``rotate_half`` pairs), in fp32. x [n, H, D]."""
    y = x.float()
    half = y.shape[-1] // 2
    rotated = torch.cat([-y[..., half:], y[..., :half]], dim=-1)
    return (y * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class _Block(nn.Module):
    def __init__(self, c: QwenVisionConfig):
        super().__init__()
        norm = (lambda: nn.LayerNorm(c.hidden_size, eps=c.norm_eps)) if c.variant == "qwen2_vl" \
            else (lambda: RMSNorm(c.hidden_size, c.norm_eps))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = _Attention(c)
        self.act = activation(c.hidden_act)
        self.gated = c.variant == "qwen2_5_vl"
        if self.gated:
            self.mlp = nn.ModuleDict({"gate_proj": nn.Linear(c.hidden_size, c.intermediate_size),
                                      "up_proj": nn.Linear(c.hidden_size, c.intermediate_size),
                                      "down_proj": nn.Linear(c.intermediate_size, c.hidden_size)})
        else:
            self.mlp = nn.ModuleDict({"fc1": nn.Linear(c.hidden_size, c.intermediate_size),
                                      "fc2": nn.Linear(c.intermediate_size, c.hidden_size)})

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Optional[torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seg)
        h = self.norm2(x)
        m = self.mlp
        if self.gated:
            h = m["down_proj"](self.act(m["gate_proj"](h)) * m["up_proj"](h))
        else:
            h = m["fc2"](self.act(m["fc1"](h)))
        return x + h


class QwenVisionEncoder(EncoderAnchor):
    """Qwen2-VL / Qwen2.5-VL vision transformer (the merger excluded: it is the projector).

    ``forward(features [sum t*h*w, C*T*P*P], sizes int64 [n, 3] = (t, h, w) per item)`` ->
    ``[sum t*h*w, hidden_size]``, in the input's merge-window order."""

    modality: ClassVar[str] = "image"
    Config: ClassVar[type] = QwenVisionConfig
    hf_model_types: ClassVar[Tuple[str, ...]] = VARIANTS
    # transformers >= 4.52 saves the tower under model.visual, older checkpoints under visual
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = ("model.visual.", "visual.", "")

    def __init__(self, config: QwenVisionConfig):
        super().__init__(config)
        c = config
        self.spatial_merge = c.spatial_merge
        self.output_dim = c.hidden_size
        self.patch_embed = nn.Linear(c.patch_dim, c.hidden_size, bias=False)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.num_hidden_layers))

    @classmethod
    def processor(cls, config: QwenVisionConfig) -> QwenVisionProcessor:
        return QwenVisionProcessor(cls.build_config(config))

    @classmethod
    def params_from_preprocessor_config(cls, pp_config: Dict[str, Any]) -> Dict[str, Any]:
        out = normalisation_params(pp_config)
        size = pp_config.get("size") or {}
        for ours, theirs in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            value = pp_config.get(ours, size.get(theirs))  # older files: min/max_pixels; newer: size
            if value is not None:
                out[ours] = int(value)
        return out

    # --- the model ---------------------------------------------------------------------------
    def forward(self, features: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        c = self.config
        grids = [tuple(int(v) for v in row) for row in sizes.tolist()]
        check_sizes(type(self).__name__, features, (t * h * w for t, h, w in grids))
        x = self.patch_embed(features.to(self.patch_embed.weight.dtype))
        if not grids:
            return x
        device = x.device
        pos = torch.cat([merge_order_positions(t, h, w, c.spatial_merge) for t, h, w in grids])
        order, frames, windows = window_order(grids, c)
        # Window order (each window's patches contiguous, frames too: windows lie inside frames),
        # as transformers' window_index: every layer then attends over contiguous segments whose
        # lengths the host knows, never over a dense mask or lengths read back. Host-built
        # indices move in one batched copy.
        back = None if order is None else torch.argsort(order)
        pos = pos if order is None else pos[order]
        pos, order_d, back_d = to_device([pos, order, back], device)
        if order_d is not None:
            x = x.index_select(0, order_d)
        # Computed per call, not a buffer: a few numbers, and nothing to materialise off meta.
        half = c.head_dim // 2
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, half, 2, device=device).float() / half)
        angles = torch.cat([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], dim=-1).float()
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        spec = {name: None if lengths is None else self._segments_spec(lengths, device)
                for name, lengths in (("frames", frames), ("windows", windows))}
        for i, block in enumerate(self.blocks):  # under parallel.encoder_activation_checkpoint
            x = recompute(block, x, cos, sin, spec["windows" if c.windowed(i) else "frames"],
                          mode=self.activation_checkpoint)
        return x if back_d is None else x.index_select(0, back_d)

    def _segments_spec(self, lengths: List[int], device: torch.device):
        """Attention within contiguous segments of ``lengths`` (host numbers): the varlen
        kernels' ``PackedSegments`` (``attn_backend``), or the PyTorch path's, which also takes
        the lengths from the host; None for a single segment on the PyTorch path (no mask)."""
        varlen = uses_varlen_kernels(self.attn_backend, device)
        if len(lengths) <= 1 and not varlen:
            return None
        return PackedSegments.from_lengths(lengths, device, causal=False,
                                           backend=self.attn_backend if varlen else "sdpa")

    # --- the planner's view --------------------------------------------------------------------
    def input_units(self, sizes: torch.Tensor) -> List[int]:
        return [int(t) * int(h) * int(w) for t, h, w in sizes.tolist()]

    def cost_coefficients(self) -> Tuple[float, float]:
        """Forward FLOPs of one frame of n patches ~ alpha*n^2 + beta*n: the full-attention
        layers' scores are quadratic; a window layer's are linear in n (each patch meets at most
        a window's patches), counted in beta; the gated MLP has three matmuls, the plain two."""
        c = self.config
        d, ffn = c.hidden_size, c.intermediate_size
        windowed = sum(1 for i in range(c.num_hidden_layers) if c.windowed(i))
        full = c.num_hidden_layers - windowed
        window_patches = (c.window_size // c.patch_size) ** 2 if windowed else 0
        mlp = (6 if c.variant == "qwen2_5_vl" else 4) * d * ffn
        per_layer = 8 * d * d + mlp
        beta = c.num_hidden_layers * per_layer + windowed * 4 * window_patches * d + 2 * c.patch_dim * d
        return float(4 * full * d), float(beta)

    # --- what the simulator asks (omni.sim.spec) ------------------------------------------------
    def attention_heads(self) -> int:
        return self.config.num_attention_heads

    def layer_modules(self) -> List[nn.Module]:
        """Every block runs once per call (the windowed ones too: their cost is in
        ``cost_coefficients``)."""
        return list(self.blocks)

    def feature_width(self) -> int:
        """One patch over its temporal patch: C x T x P x P values (a still image repeats its frame)."""
        return self.config.patch_dim

    def simulated_item(self, units: int) -> Tuple[int, int]:
        """An image of about ``units`` patches: whole merge groups, within the processor's
        pixel budget [min_pixels, max_pixels] (smart_resize scales it up or down into it)."""
        c = self.config
        k, area = self.tokens_per_row, c.patch_size ** 2
        least = -(-(-(-c.min_pixels // area)) // k) * k  # min_pixels' patches, rounded up to merge groups
        most = max(k, c.max_pixels // area // k * k)
        tokens = min(max(round(units / k) * k, least, k), most)
        return tokens, tokens // k

    def simulated_clip(self, frames: int, units: int) -> Tuple[int, int, int]:
        """A clip of ``frames`` frames as the processor samples it (a multiple of the temporal
        patch, within its frame limits), each frame within the clip's pixel budget
        (max_video_pixels): one simulated item per temporal patch, as attention stays inside
        each (the runtime keeps the clip one item; the simulator may place its temporal
        patches apart)."""
        proc = QwenVisionProcessor(self.config)
        t = proc.frames
        n = min(max(-(-frames // t) * t, proc.min_frames), proc.max_frames)
        k = self.tokens_per_row
        budget = max(k, proc.max_video_pixels // n // self.config.patch_size ** 2 // k * k)
        tokens, _ = self.simulated_item(units)
        tokens = min(tokens, budget)
        return n // t, tokens, tokens // k

    # --- checkpoints -------------------------------------------------------------------------
    @classmethod
    def params_from_hf_config(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        """A Qwen2(.5)-VL config.json (the whole model's: its ``vision_config``) -> params."""
        variant = hf_config.get("model_type")
        v = dict(hf_config.get("vision_config") or {})
        out: Dict[str, Any] = {"variant": variant, "num_hidden_layers": v.get("depth"),
                               "num_attention_heads": v.get("num_heads"), "in_channels": v.get("in_channels"),
                               "patch_size": v.get("patch_size"), "temporal_patch_size": v.get("temporal_patch_size"),
                               "spatial_merge": v.get("spatial_merge_size"), "hidden_act": v.get("hidden_act")}
        rope = v.get("rope_parameters") or {}
        out["rope_theta"] = rope.get("rope_theta", v.get("rope_theta"))
        if variant == "qwen2_vl":
            width = v.get("embed_dim")
            out.update(hidden_size=width, intermediate_size=None if width is None else int(width * v.get("mlp_ratio", 4)),
                       window_size=0, fullatt_block_indexes=[])
        else:
            out.update(hidden_size=v.get("hidden_size"), intermediate_size=v.get("intermediate_size"),
                       window_size=v.get("window_size"), fullatt_block_indexes=v.get("fullatt_block_indexes"),
                       tokens_per_second=v.get("tokens_per_second"))
        return {k: val for k, val in out.items() if val is not None}

    def convert_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name == "patch_embed.weight":  # Conv3d [D, C, T, P, P] with stride == kernel -> Linear
            return tensor.reshape(tensor.shape[0], -1)
        return tensor

    @classmethod
    def pretrained_projector(cls, path: str) -> Optional[PretrainedProjector]:
        """Qwen's patch merger (norm, then a two-layer GELU MLP over each merge group), which
        Omni's projector mirrors: LayerNorm in Qwen2-VL, RMSNorm in Qwen2.5-VL."""
        from omni.models.hf_checkpoint import CheckpointReader, read_hf_config

        hf = read_hf_config(path)
        params = cls.params_from_hf_config(hf)
        vision = hf.get("vision_config") or {}
        reader = CheckpointReader(path)
        prefix = next((p for p in cls.hf_weight_prefixes if p + "merger.mlp.0.weight" in reader), None)
        if prefix is None:
            return None
        layer = params["variant"] == "qwen2_vl"
        out = vision.get("hidden_size") if layer else vision.get("out_hidden_size")
        width = int(params["hidden_size"]) * int(params.get("spatial_merge", 2)) ** 2
        return PretrainedProjector(out_dim=int(out), hidden=width, activation="gelu", norm="layer" if layer else "rms",
                                   names=merger_names(params["variant"], prefix))

    def fresh_projector(self) -> Dict[str, Any]:
        """The patch merger's shape: the norm of the variant, an MLP as wide as its input."""
        return {"norm": "layer" if self.config.variant == "qwen2_vl" else "rms",
                "hidden": self.output_dim * self.tokens_per_row}

    # --- export (omni.models.families) ---------------------------------------------------------
    def to_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Our tensor ``name`` in the checkpoint's shape (``convert_hf_tensor``'s inverse)."""
        if name == "patch_embed.weight":
            c = self.config
            return tensor.reshape(tensor.shape[0], c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        return tensor

    def hf_vision_config(self, out_dim: int) -> Dict[str, Any]:
        """The checkpoint's ``vision_config`` of this tower, whose merger maps into ``out_dim``."""
        c = self.config
        common = {"depth": c.num_hidden_layers, "num_heads": c.num_attention_heads, "in_channels": c.in_channels,
                  "patch_size": c.patch_size, "temporal_patch_size": c.temporal_patch_size,
                  "spatial_merge_size": c.spatial_merge, "hidden_act": c.hidden_act,
                  "rope_parameters": {"rope_type": "axial", "rope_theta": c.rope_theta}}
        if c.variant == "qwen2_vl":
            if c.intermediate_size % c.hidden_size:
                raise ValueError(f"a Qwen2-VL tower's MLP is a whole multiple of its width (mlp_ratio); "
                                 f"{c.intermediate_size} / {c.hidden_size} is not")
            return {**common, "embed_dim": c.hidden_size, "mlp_ratio": c.intermediate_size // c.hidden_size,
                    "hidden_size": out_dim}
        return {**common, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                "out_hidden_size": out_dim, "window_size": c.window_size,
                "fullatt_block_indexes": list(c.fullatt_block_indexes), "tokens_per_second": c.tokens_per_second}

    @classmethod
    def hf_name(cls, name: str) -> str:
        """Our parameter name -> the checkpoint's (below the tower's prefix)."""
        if name == "patch_embed.weight":
            return "patch_embed.proj.weight"
        return name


def merger_names(variant: str, prefix: str) -> Dict[str, str]:
    """The projector's tensor names -> the checkpoint's merger names (below ``prefix``): its
    norm (LayerNorm with a bias in Qwen2-VL, RMSNorm in Qwen2.5-VL) and two linear layers."""
    names = {"fc1.weight": "merger.mlp.0.weight", "fc1.bias": "merger.mlp.0.bias",
             "fc2.weight": "merger.mlp.2.weight", "fc2.bias": "merger.mlp.2.bias", "norm.weight": "merger.ln_q.weight"}
    if variant == "qwen2_vl":
        names["norm.bias"] = "merger.ln_q.bias"
    return {k: prefix + v for k, v in names.items()}
