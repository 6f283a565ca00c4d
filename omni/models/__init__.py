"""Models: the native decoder backbone, encoder plugins, projectors, the multimodal model."""
from omni.models.hf_io import export_pretrained, load_pretrained
from omni.models.llm import Decoder, DecoderConfig, DecoderOutput

__all__ = ["Decoder", "DecoderConfig", "DecoderOutput", "load_pretrained", "export_pretrained"]
