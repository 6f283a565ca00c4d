"""Models: the native decoder backbone, encoder plugins, projectors, the multimodal model.

``load_pretrained(dir)``: the whole model of a Hugging Face directory of a supported family
(``omni.models.families``); ``hf_io.load_pretrained_llm``: its language model alone."""
from omni.models.hf_io import export_pretrained
from omni.models.llm import Decoder, DecoderConfig, DecoderOutput


def load_pretrained(path: str, attn_backend: str = "auto"):
    """See ``omni.models.families.load_pretrained`` (imported lazily: it pulls in the encoders)."""
    from omni.models.families import load_pretrained as load

    return load(path, attn_backend=attn_backend)


__all__ = ["Decoder", "DecoderConfig", "DecoderOutput", "load_pretrained", "export_pretrained"]
