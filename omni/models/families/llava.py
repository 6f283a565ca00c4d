"""LLaVA (1.5): the ``clip`` tower, LLaVA's two-layer MLP as the projector
(``multi_modal_projector``, Omni's default projector without a merge) and a backbone with 1-D
RoPE. LLaVA's vocabulary has the placeholder Omni writes, ``<image>``, once per image token.

``export_llava``: such a model becomes a LLaVA directory that ``LlavaForConditionalGeneration``
loads, and Omni loads back bit-exactly (``model.pretrained`` plus the ``clip`` slot's
``pretrained``), with the processor's preprocessor_config.json. ``token_ids``,
``processor_tokens``: see ``omni.models.families._hf_export``.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

from omni.models.encoders.clip import ClipEncoder
from omni.models.encoders.llava_projector import llava_projector_names
from omni.models.encoders.siglip import SiglipEncoder
from omni.models.families._hf_export import (language_model, llava_projector_act, only_image_encoder, split_ids,
                                             write_checkpoint, write_class_token_processor_config)
from omni.models.families.family import Family, image_family
from omni.models.multimodal import OmniModel


def export_llava(model: OmniModel, path: str, image_token_id: int, max_shard_bytes: Optional[int] = None,
                 token_ids: Optional[Mapping[str, Any]] = None, processor_tokens: Optional[Mapping[str, str]] = None
                 ) -> None:
    """Write ``model`` (host tensors) to ``path`` as a LLaVA checkpoint
    (``LlavaForConditionalGeneration``). ``image_token_id``: the tokenizer's image placeholder;
    ``token_ids``, ``processor_tokens``: its other ids, the processor's tokens (the module doc).

    The weights are named as LLaVA-1.5's files name them (``language_model.model.*``,
    ``language_model.lm_head.weight``, ``multi_modal_projector.linear_{1,2}.*``,
    ``vision_tower.vision_model.*``), which transformers 4.x reads as they are and transformers
    5 maps to its own layout on load. Refused, naming the part, for a model that is not one:
    another image encoder (a ``siglip`` tower's output is its post-layernorm state, which LLaVA
    does not compute), a projector that is not LLaVA's MLP, a backbone with M-RoPE, other
    modalities."""
    import transformers

    enc = model.encoders["image"] if "image" in model.encoders else None
    if isinstance(enc, SiglipEncoder):
        raise ValueError("a siglip tower does not export as LLaVA: its output is the post-layernorm state of its last "
                         "layer (and NaViT-sized grids), while LlavaForConditionalGeneration projects a tower's "
                         "hidden_states[vision_feature_layer], taken before that norm, of fixed-size images; train "
                         "with the clip encoder (encoders/vision=clip_tiny or clip) to export as LLaVA")
    enc = only_image_encoder(model, ClipEncoder, "export_llava", "clip", "a LLaVA")
    llm = model.llm.config
    if llm.mrope_section is not None:
        raise ValueError(f"a LLaVA checkpoint's language model has 1-D RoPE; this backbone rotates by M-RoPE "
                         f"(mrope_section={llm.mrope_section}), which only a Qwen2-VL checkpoint holds")
    act = llava_projector_act(model.projectors["image"], enc.output_dim, llm.hidden_size)
    c = enc.config
    top, text_ids = split_ids(token_ids or {})
    config = transformers.LlavaConfig(
        text_config={**llm.to_hf(text_of_vlm=True), **text_ids}, vision_config=enc.hf_vision_config(),
        image_token_id=int(image_token_id), **top,
        image_seq_length=c.tokens_per_image, projector_hidden_act=act, vision_feature_layer=c.vision_feature_layer,
        vision_feature_select_strategy=c.vision_feature_select_strategy, multimodal_projector_bias=True,
        tie_word_embeddings=llm.tie_word_embeddings)
    sd = {"vision_tower.vision_model." + enc.hf_name(name): enc.to_hf_tensor(name, t)
          for name, t in enc.state_dict().items()}
    names = llava_projector_names("multi_modal_projector.")
    sd.update({names[name]: t for name, t in model.projectors["image"].state_dict().items()})
    sd.update(language_model(model, "language_model.model.", "language_model.lm_head.weight"))
    write_checkpoint(config, "LlavaForConditionalGeneration", sd, path, max_shard_bytes)
    # The processor's settings (resize, crop, padding, normalisation) are the tower's input
    # contract: written beside it, so the directory loads back with the same preprocessing.
    pp = enc.hf_preprocessor_config()
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(pp, f, indent=2)
    if processor_tokens is not None:
        # the same settings in their transformers class (its PIL variant: the default needs torchvision)
        image_processor = getattr(transformers, pp["image_processor_type"] + "Pil")(
            **{k: v for k, v in pp.items() if k != "image_processor_type"})
        write_class_token_processor_config(path, "LlavaProcessor", image_processor, processor_tokens, c)


FAMILIES: dict[str, Family] = {"llava": image_family("clip", ClipEncoder, export_llava)}
