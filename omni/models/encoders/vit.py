"""The vision transformer that the CLIP and SigLIP towers (``clip``, ``llava_next``, ``siglip``,
``siglip2``, ``llava_ov``) share: its layer, its embeddings, and what the towers built of it do alike.

Both towers run the same layer: LayerNorm, bidirectional multi-head attention (q/k/v/out
projections with biases, scores scaled by head_dim**-0.5), residual, LayerNorm, a two-layer
MLP, residual. They differ only in what surrounds the stack (embeddings, the norms before and
after it) and in the MLP's activation, which the config names. Parameter names are those of
transformers' ``CLIPEncoderLayer`` / ``SiglipEncoderLayer`` (``layer_norm1``, ``self_attn.q_proj``,
``mlp.fc1``, ...), so a checkpoint loads key by key.

The config passed in needs ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
``num_hidden_layers``, ``hidden_act`` and ``layer_norm_eps``.

Around the layers: ``PatchEmbeddings`` (a patch Linear and a square position table that starts
as ``sincos_2d``), and the plugin bases ``ViTTower`` (what every such tower answers alike: its
heads, the layers that run, the checkpoint's Conv2d patch embedding), ``PackedViT`` (SigLIP's
and SigLIP2's NaViT-packed images of their own grids, post-layernorm output) and
``FeatureLayerTower`` (CLIP's and LLaVA-OneVision's fixed squares, whose output is LLaVA's
``vision_feature_layer``: the layers after it frozen, the tower config written back on export).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Sequence, Tuple

import torch
from torch import nn

from omni.models.encoders.base import EncoderAnchor
from omni.models.encoders.blocks import (AttentionSpec, activation, packed_self_attention, transformer_activation_bytes,
                                         transformer_flops)

# The fields of a checkpoint's vision_config that a CLIP or SigLIP tower's config shares (read
# on load, written on export).
VISION_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                      "image_size", "patch_size", "layer_norm_eps", "hidden_act")
_PATCH = "embeddings.patch_embedding.weight"


class ViTMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.act = activation(config.hidden_act)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ViTAttention(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor, attention: AttentionSpec) -> torch.Tensor:
        return packed_self_attention(x, self.q_proj, self.k_proj, self.v_proj, self.out_proj, self.num_heads, attention)


class ViTLayer(nn.Module):
    """One pre-norm layer on packed tokens x [T, D]; ``attention`` keeps items apart."""

    def __init__(self, config: Any):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = ViTAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ViTMLP(config)

    def forward(self, x: torch.Tensor, attention: AttentionSpec) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), attention)
        return x + self.mlp(self.layer_norm2(x))


class ViTLayers(nn.Module):
    """``layers``: the stack, under the name transformers gives it (``encoder.layers.N``)."""

    def __init__(self, config: Any):
        super().__init__()
        self.layers = nn.ModuleList(ViTLayer(config) for _ in range(config.num_hidden_layers))


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


def square(value: Any, key: str, who: str) -> Any:
    """A size transformers may write as a pair (``image_size``, ``patch_size``) as one int;
    a ValueError naming ``who`` for a pair that is not square."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"{who} needs a square {key}, got {value}")
        return int(value[0])
    return value


@dataclass
class SiglipTowerFields:
    """The tower fields of the SigLIP and SigLIP2 configs, at transformers' defaults (its
    ``SiglipVisionConfig`` and ``Siglip2VisionConfig`` agree: google/siglip-base-patch16-224's
    sizes). A key a checkpoint's config.json leaves out means transformers' default, so ours
    must agree; ``__post_init__`` checks what both towers need of them."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    patch_size: int = 16
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        self.patch_size = square(self.patch_size, "patch_size", type(self).__name__.replace("Config", ""))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads}")


class PatchEmbeddings(nn.Module):
    """A patch embedding (a Linear with bias over each flattened patch, a checkpoint's stride ==
    kernel Conv2d) and a learned position table of ``side`` x ``side`` entries, under
    transformers' SigLIP names."""

    def __init__(self, channels: int, patch: int, side: int, dim: int):
        super().__init__()
        self.patch_embedding = nn.Linear(channels * patch * patch, dim)
        self.position_embedding = nn.Embedding(side * side, dim)
        # From scratch, start from a 2D sin-cos table (as MAE does) rather than noise: where a
        # patch sits is then readable from step 0, which a randomly initialised table takes
        # thousands of steps to learn. Loading a checkpoint overwrites it.
        with torch.no_grad():
            self.position_embedding.weight.copy_(sincos_2d(side, dim))


class ViTTower(EncoderAnchor):
    """An encoder plugin built of ``ViTLayers`` (``self.encoder``) and ``PatchEmbeddings``
    (``self.embeddings``, or a table of its own with its own ``init_rule``): its attention heads,
    the layers that run (``layers_run``: all of them unless a feature layer stops earlier), the
    position table's start, and the checkpoint's Conv2d patch embedding read as our Linear."""

    modality: ClassVar[str] = "image"

    @property
    def layers_run(self) -> int:
        return self.config.num_hidden_layers

    def attention_heads(self) -> int:
        return self.config.num_attention_heads

    def layer_modules(self) -> List[nn.Module]:
        """The layers that run (a feature layer's tower never runs those after it)."""
        return list(self.encoder.layers[:self.layers_run])

    def init_rule(self, owner: nn.Module, path: str, attr: str):
        """The position table starts as the 2D sin-cos table (see ``PatchEmbeddings``); the rest
        takes torch's defaults (``omni.models.materialize``)."""
        if path == "embeddings.position_embedding" and attr == "weight":
            from omni.models.materialize import Computed

            side = math.isqrt(self.embeddings.position_embedding.num_embeddings)
            d = self.config.hidden_size
            return Computed(lambda: sincos_2d(side, d))
        return None

    def convert_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name == _PATCH and tensor.dim() == 4:
            return tensor.reshape(tensor.shape[0], -1)  # Conv2d [D, C, p, p] -> Linear [D, C*p*p]
        return tensor


class PackedViT(ViTTower):
    """Images of their own patch grids packed back to back (NaViT style): the patch embedding
    plus each image's position table (``position_embeddings``, the plugin's resize of its
    square table), the layers with attention inside each image, the post-layernorm; one token
    per patch. Runs sequence-parallel."""

    supports_sequence_parallel: ClassVar[bool] = True
    #: the model_type of the whole (contrastive) model, whose config.json nests the tower's
    #: as its ``vision_config``
    hf_full_model_type: ClassVar[str]

    def __init__(self, config: Any, embeddings: PatchEmbeddings):
        super().__init__(config)
        self.output_dim = config.hidden_size
        self.embeddings = embeddings
        self.encoder = ViTLayers(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    @classmethod
    def params_from_hf_config(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        """The tower's config.json, or the whole model's (its ``vision_config``) -> params."""
        if hf_config.get("model_type") == cls.hf_full_model_type:
            hf_config = hf_config.get("vision_config") or {}
        return super().params_from_hf_config(hf_config)

    def position_embeddings(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """[grid_h*grid_w, D]: the position table for an image of that grid."""
        raise NotImplementedError

    def embedded(self, features: torch.Tensor, grids: Sequence[Tuple[int, int]]) -> torch.Tensor:
        """The patches' embeddings plus each image's position table (one resize per grid)."""
        x = self.embeddings.patch_embedding(features.to(self.embeddings.patch_embedding.weight.dtype))
        cache: Dict[Tuple[int, int], torch.Tensor] = {}
        for g in grids:
            if g not in cache:
                cache[g] = self.position_embeddings(*g)
        return x + torch.cat([cache[g] for g in grids], dim=0).to(x.dtype)

    def no_items(self, features: torch.Tensor) -> Tuple[torch.Tensor, List[int]]:
        """``embed_inputs`` of an empty micro-batch."""
        return features.new_zeros(0, self.output_dim, dtype=self.post_layernorm.weight.dtype), []

    def encode_tokens(self, x: torch.Tensor, attention: AttentionSpec) -> torch.Tensor:
        return self.run_layers(self.encoder.layers, x, attention)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(x)

    def input_units(self, sizes: torch.Tensor) -> List[int]:
        """One feature row (patch) per token: grid_h * grid_w per image."""
        return [int(h) * int(w) for h, w in sizes.tolist()]

    def activation_bytes(self, tokens: int, element_bytes: int = 4) -> float:
        c = self.config
        return transformer_activation_bytes(c.num_hidden_layers, c.hidden_size, c.intermediate_size, tokens,
                                            element_bytes, self.activation_checkpoint)

    def cost_coefficients(self) -> Tuple[float, float]:
        c = self.config
        alpha, beta = transformer_flops(c.num_hidden_layers, c.hidden_size, c.intermediate_size)
        beta += 2.0 * c.num_channels * c.patch_size**2 * c.hidden_size  # patch embedding
        return alpha, beta


def feature_layers_run(layer: int, num_layers: int) -> int:
    """Layers a tower runs before ``hidden_states[layer]`` (transformers' index: 0 the
    embedding, -1 the last layer's output); a ValueError for an index the tower does not have."""
    if not -(num_layers + 1) <= layer <= num_layers:
        raise ValueError(f"vision_feature_layer={layer} is not a hidden state of a tower of {num_layers} "
                         f"layers (use {-(num_layers + 1)}..{num_layers})")
    return layer if layer >= 0 else num_layers + 1 + layer


class FeatureLayerFields:
    """What the config of a tower on fixed squares whose feature is one hidden state
    (``vision_feature_layer``: LLaVA's CLIP, LLaVA-OneVision's SigLIP) derives alike from its
    ``image_size``, ``patch_size``, ``hidden_size``, ``num_attention_heads`` and
    ``num_hidden_layers``. A mixin of the dataclass configs (no fields of its own: each family
    keeps its checkpoints' defaults)."""

    def check_squares(self, who: str) -> None:
        """Square image and patch sizes (one number each) and heads that divide the width."""
        for key in ("image_size", "patch_size"):
            setattr(self, key, square(getattr(self, key), key, who))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads}")

    @property
    def side(self) -> int:
        """Patches per side of every image (or tile)."""
        return self.image_size // self.patch_size

    @property
    def layers_run(self) -> int:
        """Layers before the hidden state the projector takes."""
        return feature_layers_run(self.vision_feature_layer, self.num_hidden_layers)


class FeatureLayerTower(ViTTower):
    """A tower on fixed squares whose output is ``hidden_states[vision_feature_layer]`` (LLaVA's
    feature choice): the layers after it and the post-layernorm never run, and are kept, frozen,
    only so that the checkpoint loads and exports whole. ``vision_model_type``: its
    ``vision_config``'s model_type on export (``hf_vision_extra``: fields besides the shared
    ones)."""

    vision_model_type: ClassVar[str]
    hf_vision_extra: ClassVar[Dict[str, Any]] = {}
    plugin: ClassVar[str]  # the plugin's name and its tower's (``CLIP``), for messages
    tower_name: ClassVar[str]

    @property
    def layers_run(self) -> int:
        return self.config.layers_run

    def freeze_unused(self) -> None:
        """Never run: frozen, so that no optimizer step (weight decay on a zero gradient) moves
        weights that only travel with the checkpoint."""
        for unused in [*self.encoder.layers[self.layers_run:], self.post_layernorm]:
            unused.requires_grad_(False)

    @classmethod
    def vision_params(cls, vision: Any, kind: Any) -> Dict[str, Any]:
        """The shared fields of a checkpoint's (transformers') vision config, refused unless it
        is a ``vision_model_type`` tower (``kind``: the checkpoint's model_type, for the message)."""
        if vision.model_type != cls.vision_model_type:
            raise ValueError(f"this {kind} checkpoint's vision tower is {vision.model_type!r}; the {cls.plugin} encoder "
                             f"loads {cls.tower_name} towers ({cls.vision_model_type}) only")
        v = vision.to_dict()
        return {k: v[k] for k in VISION_CONFIG_KEYS}

    # --- export (omni.models.families) ---------------------------------------------------------
    def to_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Our tensor ``name`` in the checkpoint's shape (``convert_hf_tensor``'s inverse)."""
        if name == _PATCH:
            c = self.config
            return tensor.reshape(tensor.shape[0], c.num_channels, c.patch_size, c.patch_size)
        return tensor

    def hf_vision_config(self) -> Dict[str, Any]:
        """The checkpoint's ``vision_config`` of this tower."""
        c = self.config
        return {"model_type": self.vision_model_type, **{k: getattr(c, k) for k in VISION_CONFIG_KEYS},
                **self.hf_vision_extra}
