"""Qwen3-VL, dense and MoE: the ``qwen3_vl`` tower with its mergers (the last layer's and
DeepStack's) as the projector, and a Qwen3 (or Qwen3-MoE) backbone with interleaved M-RoPE that
adds the DeepStack features after its first layers (``Decoder.split_deepstack``).

``export_qwen3_vl``: such a model becomes a Qwen3-VL (or Qwen3-VL-MoE) directory (config.json and
safetensors, the names and shapes transformers saves and the released checkpoints hold: the MoE
experts of a layer fused, hidden first), which ``Qwen3VLForConditionalGeneration`` /
``Qwen3VLMoeForConditionalGeneration`` (and ``AutoModelForImageTextToText``) load, and which Omni
loads back bit-exactly. Its vocabulary frames images as Qwen2-VL's does (``qwen_vl.TOKENS``).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from dataloading.formats.tokenizer import Tokenizer
from omni.models.encoders.qwen3_vl import DeepStackProjector, Qwen3VisionEncoder, deepstack_names
from omni.models.families._hf_export import language_model, only_image_encoder, split_ids, write_checkpoint
from omni.models.families.family import Family, config_ids, image_encoder
from omni.models.families.qwen_vl import TOKENS, image_processor_settings
from omni.models.multimodal import OmniModel

# backbone family -> (config class, architecture, text model_type, experts' layout in the files)
_TEXT = {"qwen3": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "qwen3_vl_text", "per_expert"),
         "qwen3_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe_text", "hidden_first")}
_IDS = {"video_token_id": TOKENS["video"].token, "vision_start_token_id": TOKENS["image"].before,
        "vision_end_token_id": TOKENS["image"].after}


def export_qwen3_vl(model: OmniModel, path: str, image_token_id: int, max_shard_bytes: Optional[int] = None,
                    token_ids: Optional[Mapping[str, Any]] = None) -> None:
    """Write ``model`` (host tensors) to ``path`` as a Qwen3-VL checkpoint, or a Qwen3-VL-MoE one
    for a Qwen3-MoE backbone. Refused, naming the part, for a model that is not one: another
    tower or projector, a backbone that is not a Qwen3 (MoE) with interleaved M-RoPE, other
    modalities, a router that does not renormalise its top-k weights (Qwen3-VL-MoE's always does)."""
    import transformers

    enc = only_image_encoder(model, Qwen3VisionEncoder, "export_qwen3_vl", "qwen3_vl", "a Qwen3-VL")
    llm = model.llm.config
    if llm.family not in _TEXT or llm.mrope_section is None or not llm.mrope_interleaved:
        raise ValueError(f"a Qwen3-VL checkpoint's language model is a Qwen3 or Qwen3-MoE with interleaved M-RoPE; "
                         f"this backbone is family={llm.family!r} with mrope_section={llm.mrope_section}, "
                         f"mrope_interleaved={llm.mrope_interleaved}")
    if llm.family == "qwen3_moe" and not llm.norm_topk_prob:
        raise ValueError("a Qwen3-VL-MoE router renormalises its top-k weights; this backbone has "
                         "model.norm_topk_prob=false")
    proj = model.projectors["image"]
    if not isinstance(proj, DeepStackProjector):
        raise ValueError(f"the image projector is {type(proj).__name__}, not Qwen3-VL's mergers (DeepStackProjector)")
    config_cls, architecture, text_type, experts = _TEXT[llm.family]
    top, text_ids = split_ids(token_ids or {})
    text = {**llm.to_hf(text_of_vlm=True), **text_ids, "model_type": text_type}
    config = getattr(transformers, config_cls)(text_config=text, vision_config=enc.hf_vision_config(llm.hidden_size),
                                               image_token_id=int(image_token_id),
                                               tie_word_embeddings=llm.tie_word_embeddings, **top)
    sd = {"model.visual." + enc.hf_name(name): enc.to_hf_tensor(name, t) for name, t in enc.state_dict().items()}
    names = deepstack_names(proj.deepstack_layers, "model.visual.")
    sd.update({names[name]: t for name, t in proj.state_dict().items()})
    sd.update(language_model(model, "model.language_model.", "lm_head.weight", experts=experts))
    write_checkpoint(config, architecture, sd, path, max_shard_bytes)


def _export(model: OmniModel, path: str, tokenizer: Tokenizer, vocab: Any) -> None:
    """The model, and its image processor's settings (Qwen2-VL's processor class, which
    Qwen3-VL's checkpoints name too)."""
    import transformers

    export_qwen3_vl(model, path, image_token_id=tokenizer.placeholder_ids["image"], token_ids=config_ids(vocab, _IDS))
    transformers.Qwen2VLImageProcessorPil(**image_processor_settings(model.encoders["image"])).save_pretrained(path)


def _matches(moe: bool):
    def matches(model: OmniModel) -> bool:
        return isinstance(image_encoder(model), Qwen3VisionEncoder) and (model.llm.config.num_experts > 0) == moe

    return matches


FAMILIES: dict[str, Family] = {
    "qwen3_vl": Family(vision="qwen3_vl", family_tokens=TOKENS, export=_export, matches=_matches(moe=False)),
    "qwen3_vl_moe": Family(vision="qwen3_vl", family_tokens=TOKENS, export=_export, matches=_matches(moe=True)),
}
