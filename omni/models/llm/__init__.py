"""Native Llama / Qwen2 family decoder (dense and MoE) for packed variable-length input."""
from .config import DecoderConfig
from .decoder import Decoder, DecoderOutput
from .kv_cache import KVCache

__all__ = ["DecoderConfig", "Decoder", "DecoderOutput", "KVCache"]
