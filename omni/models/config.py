"""Model knobs: the LLM backbone (``model`` group) and the encoder slots (``encoders`` group)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omni.models.llm.config import DecoderConfig


@dataclass
class ModelConfig(DecoderConfig):
    # A local Hugging Face checkpoint directory (Llama, Qwen2, Mixtral, Qwen2-MoE). When set,
    # the architecture comes from its config.json and the fields above are ignored.
    pretrained: Optional[str] = None
    # Attention kernels of the backbone and the encoders (omni.kernels.varlen_attention):
    # auto (flash-attn if installed, else Triton, on CUDA; PyTorch SDPA on the CPU), triton,
    # flash or sdpa.
    attn_backend: str = "auto"


@dataclass
class ProjectorConfig:
    # Two-layer MLP from the encoder width to the LLM width; hidden = mult * LLM width.
    hidden_mult: float = 1.0
    activation: str = "gelu"
    # Load the projector the encoder's checkpoint holds beside it (Qwen-VL's patch merger) when
    # the encoder is `pretrained` and the projector maps into the LLM's width; false: start fresh.
    pretrained: bool = True


@dataclass
class EncoderSlot:
    """One encoder in the model. Which plugin runs it: `name` from the registry
    (`omni plugins` lists them) or a Hydra-style `_target_` dotted class path."""

    name: str = "siglip"
    _target_: Optional[str] = None
    # Plugin-specific options, checked by the plugin's own config dataclass.
    params: Dict[str, Any] = field(default_factory=dict)
    # A local Hugging Face checkpoint directory for the encoder weights.
    pretrained: Optional[str] = None
    freeze: bool = False
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
