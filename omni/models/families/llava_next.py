"""LLaVA-NeXT: the ``llava_next`` tower (CLIP on anyres tiles), its projector (LLaVA's MLP and
the image newline) and a backbone with 1-D RoPE. Its vocabulary has ``<image>``.

``export_llava_next``: such a model becomes a LLaVA-NeXT directory, with the image processor's
preprocessor_config.json. ``token_ids``, ``processor_tokens``: see
``omni.models.families._hf_export``.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from omni.models.encoders.llava_next import LlavaNextEncoder
from omni.models.families._hf_export import export_anyres, only_image_encoder, write_class_token_processor_config
from omni.models.families.family import Family, image_family
from omni.models.multimodal import OmniModel


def export_llava_next(model: OmniModel, path: str, image_token_id: int, max_shard_bytes: Optional[int] = None,
                      token_ids: Optional[Mapping[str, Any]] = None,
                      processor_tokens: Optional[Mapping[str, str]] = None) -> None:
    """Write ``model`` (host tensors) to ``path`` as a LLaVA-NeXT checkpoint
    (``LlavaNextForConditionalGeneration``), with its image processor's preprocessor_config.json.
    ``image_token_id``: the tokenizer's image placeholder; ``token_ids``, ``processor_tokens``:
    the module doc.

    The weights are named as LLaVA-1.5's and OneVision's (``vision_tower.vision_model.*``, as
    ``export_llava``; ``multi_modal_projector.linear_{1,2}.*``, ``image_newline``,
    ``language_model.model.*``, ``language_model.lm_head.weight``). Refused, naming the part,
    for a model that is not one (as ``export_llava_onevision``)."""
    import transformers

    enc = only_image_encoder(model, LlavaNextEncoder, "export_llava_next", "llava_next", "a LLaVA-NeXT")
    export_anyres(model, enc, path, transformers.LlavaNextConfig, "LlavaNextForConditionalGeneration",
                   "vision_tower.vision_model.", {**(token_ids or {}), "image_token_index": int(image_token_id)},
                   max_shard_bytes)
    image_processor = enc.hf_image_processor()
    image_processor.save_pretrained(path)
    if processor_tokens is not None:  # a CLIP tower, as in export_llava
        write_class_token_processor_config(path, "LlavaNextProcessor", image_processor, processor_tokens, enc.config)


FAMILIES: dict[str, Family] = {"llava_next": image_family("llava_next", LlavaNextEncoder, export_llava_next)}
