"""Model knobs: the LLM backbone (``model`` group) and the encoder slots (``encoders`` group)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omni.models.llm.config import DecoderConfig


@dataclass
class LoraConfig:
    """LoRA adapters (``omni.models.lora``, through peft) on linear layers of the LLM and the
    encoders. Their base weights are frozen; what is not adapted (projectors, an encoder left
    out) trains unless frozen."""

    # Rank of the adapters; 0: no LoRA.
    rank: int = 0
    # Scaling of the adapter's output: alpha / rank.
    alpha: float = 16.0
    dropout: float = 0.0
    # Which linear layers of each adapted part (peft's target_modules: a module's own name or
    # the end of its path); [all-linear]: every linear layer but the LM head.
    targets: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"])
    # Which parts get adapters: llm, encoders (every slot) or encoder.<slot> (model.freeze's names).
    modules: List[str] = field(default_factory=lambda: ["llm"])


@dataclass
class ModelConfig(DecoderConfig):
    # A local Hugging Face checkpoint directory (Llama, Qwen2, Mixtral, Qwen2-MoE). When set,
    # the architecture comes from its config.json and the fields above are ignored.
    pretrained: Optional[str] = None
    # Attention kernels of the backbone and the encoders (omni.kernels.varlen_attention):
    # auto (flash-attn if installed, else Triton, on CUDA; PyTorch SDPA on the CPU), triton,
    # flash or sdpa.
    attn_backend: str = "auto"
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Modules frozen for the whole run (no gradients, no optimizer state): llm, encoders,
    # projectors, encoder.<slot>, projector.<slot> (omni/models/freeze.py). An encoder slot's
    # own `freeze: true` means encoder.<slot>.
    freeze: List[str] = field(default_factory=list)
    # Start from the model weights of another run (its newest checkpoint) or of a checkpoint
    # folder: fresh optimizer, step 0, the lr schedule from its start. A run dir that has
    # checkpoints of its own resumes from them instead (checkpoint.resume=auto).
    init_from: Optional[str] = None


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
