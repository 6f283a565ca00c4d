"""LLaVA-OneVision: the ``llava_ov`` tower (SigLIP on anyres tiles and video frames), its
projector (LLaVA's MLP and the image newline) and a backbone with 1-D RoPE. Its vocabulary has
``<image>`` (and ``<video>``, which Omni writes as ``<image>``).

``export_llava_onevision``: such a model becomes a LLaVA-OneVision directory, with the image
processor's preprocessor_config.json. ``token_ids``, ``processor_tokens``: see
``omni.models.families._hf_export``.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from dataloading.formats.tokenizer import Tokenizer
from omni.models.encoders.llava_ov import LlavaOvEncoder
from omni.models.families._hf_export import export_anyres, only_image_encoder, write_processor_config
from omni.models.families.family import Family, config_ids, image_encoder
from omni.models.multimodal import OmniModel


def export_llava_onevision(model: OmniModel, path: str, image_token_id: int, video_token_id: Optional[int] = None,
                           max_shard_bytes: Optional[int] = None, token_ids: Optional[Mapping[str, Any]] = None,
                           processor_tokens: Optional[Mapping[str, str]] = None) -> None:
    """Write ``model`` (host tensors) to ``path`` as a LLaVA-OneVision checkpoint
    (``LlavaOnevisionForConditionalGeneration``), with its image processor's
    preprocessor_config.json. ``image_token_id`` / ``video_token_id``: the tokenizer's
    placeholders (None: transformers' default video id; -1: the vocabulary has no video token);
    ``token_ids``, ``processor_tokens``: the module doc.

    The weights are named as transformers' ``save_pretrained`` names them (``vision_tower.*``,
    ``multi_modal_projector.linear_{1,2}.*``, ``image_newline``, ``language_model.model.*``,
    ``language_model.lm_head.weight``). Refused, naming the part, for a model that is not one:
    another image encoder, a projector that is not LLaVA's MLP, a backbone with M-RoPE, other
    modalities."""
    import transformers

    enc = only_image_encoder(model, LlavaOvEncoder, "export_llava_onevision", "llava_ov", "a LLaVA-OneVision")
    ids = {"image_token_index": int(image_token_id)}
    if video_token_id is not None:
        ids["video_token_index"] = int(video_token_id)
    export_anyres(model, enc, path, transformers.LlavaOnevisionConfig, "LlavaOnevisionForConditionalGeneration",
                   "vision_tower.", {**(token_ids or {}), **ids}, max_shard_bytes)
    c = enc.config
    image_processor = transformers.LlavaOnevisionImageProcessorPil(
        size={"height": c.image_size, "width": c.image_size}, image_grid_pinpoints=[list(p) for p in c.image_grid_pinpoints],
        image_mean=list(c.image_mean), image_std=list(c.image_std))
    image_processor.save_pretrained(path)
    if processor_tokens is not None:
        # a SigLIP tower has no class token: a tile is its patches; the video processor (it needs
        # torchvision) is left to transformers, which reads it from preprocessor_config.json
        write_processor_config(path, "LlavaOnevisionProcessor", image_processor, **processor_tokens,
                                num_image_tokens=(c.image_size // c.patch_size) ** 2,
                                vision_feature_select_strategy=c.vision_feature_select_strategy,
                                vision_aspect_ratio=c.vision_aspect_ratio)


def _export(model: OmniModel, path: str, tokenizer: Tokenizer, vocab: Any) -> None:
    """The model and its processor's settings; the video placeholder is the vocabulary's
    ``<video>`` (-1 without one: Omni itself writes a video's rows at image placeholders,
    ``dataloading.formats.media.as_encoder_placeholders``)."""
    image = tokenizer.placeholder_ids["image"]
    ids = config_ids(vocab, {"video_token_index": "<video>"})
    video = ids.pop("video_token_index")
    tokens = {"image_token": vocab.convert_ids_to_tokens(image), **({"video_token": "<video>"} if video >= 0 else {})}
    export_llava_onevision(model, path, image_token_id=image, video_token_id=video, token_ids=ids,
                           processor_tokens=tokens)


def _matches(model: OmniModel) -> bool:
    return isinstance(image_encoder(model), LlavaOvEncoder)


FAMILIES: dict[str, Family] = {"llava_onevision": Family(vision="llava_ov", export=_export, matches=_matches)}
