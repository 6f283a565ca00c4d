"""Encoder plugins: the EncoderAnchor protocol, the registry and the built-in encoders
(``siglip``: SigLIP-compatible vision, ``whisper``: Whisper-encoder-compatible audio, ``qwen_vl``:
the Qwen2-VL / Qwen2.5-VL tower, ``clip``: CLIP's tower as LLaVA uses it, ``siglip2``: SigLIP2's NaFlex tower).

The built-in modules are imported on demand by the registry, so importing this package stays
light (no transformers import).
"""
from omni.models.encoders.base import EncoderAnchor
from omni.models.encoders.registry import available_encoders, build_encoder, get_encoder_class

__all__ = ["EncoderAnchor", "available_encoders", "build_encoder", "get_encoder_class"]
