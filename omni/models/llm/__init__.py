"""Native Llama / Qwen2 family decoder (dense and MoE) for packed variable-length input."""
from .config import DecoderConfig
from .decoder import Decoder, DecoderOutput

__all__ = ["DecoderConfig", "Decoder", "DecoderOutput"]
