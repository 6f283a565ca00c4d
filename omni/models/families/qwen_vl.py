"""Qwen2-VL and Qwen2.5-VL: the ``qwen_vl`` tower with its patch merger as the projector, and a
Qwen2 backbone with M-RoPE.

``export_qwen_vl``: such a model becomes a Qwen2-VL or Qwen2.5-VL directory (config.json and
safetensors, the names and shapes transformers saves), which
``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` (and
``AutoModelForImageTextToText``) load, and which Omni loads back bit-exactly
(``model.pretrained`` plus the ``qwen_vl`` slot's ``pretrained``). ``token_ids``: see
``omni.models.families._hf_export``.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from torch import nn

from dataloading.formats.tokenizer import PlaceholderTokens, Tokenizer
from omni.models.encoders.qwen_vl import VARIANTS, QwenVisionEncoder, merger_names
from omni.models.families._hf_export import language_model, only_image_encoder, split_ids, write_checkpoint
from omni.models.families.family import Family, config_ids, image_encoder
from omni.models.multimodal import OmniModel

# Qwen2-VL's vocabulary frames each image (video) with vision start/end tokens around the
# placeholder it repeats once per merged patch.
TOKENS = {"image": PlaceholderTokens("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"),
          "video": PlaceholderTokens("<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
# The config.json fields of those tokens, besides the image placeholder (the tokenizer's own).
_IDS = {"video_token_id": TOKENS["video"].token, "vision_start_token_id": TOKENS["image"].before,
        "vision_end_token_id": TOKENS["image"].after}
_CLASSES = {"qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
            "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration")}


def export_qwen_vl(model: OmniModel, path: str, image_token_id: int, max_shard_bytes: Optional[int] = None,
                   token_ids: Optional[Mapping[str, Any]] = None) -> None:
    """Write ``model`` (host tensors) to ``path`` as a Qwen2-VL / Qwen2.5-VL checkpoint.
    ``image_token_id``: the tokenizer's image placeholder (config.json's ``image_token_id``);
    ``token_ids``: its other ids (the module doc). Refused, naming the part, for a model that is
    not one: another image encoder, a projector that is not the tower's merger, a backbone
    without M-RoPE, other modalities."""
    import transformers

    enc = only_image_encoder(model, QwenVisionEncoder, "export_qwen_vl", "qwen_vl", "a Qwen2-VL")
    llm = model.llm.config
    if llm.family != "qwen2" or llm.mrope_section is None:
        raise ValueError(f"a Qwen2-VL checkpoint's language model is a Qwen2 with M-RoPE; this backbone is "
                         f"family={llm.family!r} with mrope_section={llm.mrope_section}")
    variant = enc.config.variant
    proj = model.projectors["image"]
    norm = nn.LayerNorm if variant == "qwen2_vl" else nn.RMSNorm
    expected = (enc.output_dim * enc.tokens_per_row, enc.tokens_per_row, llm.hidden_size)
    if (proj.fc1.out_features, proj.merge, proj.fc2.out_features) != expected or \
            not isinstance(getattr(proj, "norm", None), norm) or not isinstance(proj.act, nn.GELU):
        raise ValueError(f"the image projector is not {variant}'s patch merger ({norm.__name__}, a GELU MLP of "
                         f"width {expected[0]} over {expected[1]} patches)")
    config_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[variant])
    top, text_ids = split_ids(token_ids or {})
    text = {**llm.to_hf(text_of_vlm=True), **text_ids, "model_type": f"{variant}_text"}
    config = config_cls(text_config=text, vision_config=enc.hf_vision_config(llm.hidden_size),
                        image_token_id=int(image_token_id), tie_word_embeddings=llm.tie_word_embeddings, **top)
    sd = {"model.visual." + enc.hf_name(name): enc.to_hf_tensor(name, t) for name, t in enc.state_dict().items()}
    merger = merger_names(variant, "model.visual.")
    sd.update({merger[name]: t for name, t in proj.state_dict().items()})
    sd.update(language_model(model, "model.language_model.", "lm_head.weight"))
    write_checkpoint(config, model_cls.__name__, sd, path, max_shard_bytes)


def _export(model: OmniModel, path: str, tokenizer: Tokenizer, vocab: Any) -> None:
    """The model, and the image processor's settings as transformers' Qwen2-VL image processor
    reads them (its PIL variant: the default one needs torchvision, and both write the same file).
    Its processor has no settings of its own: no processor_config.json."""
    import transformers

    export_qwen_vl(model, path, image_token_id=tokenizer.placeholder_ids["image"], token_ids=config_ids(vocab, _IDS))
    transformers.Qwen2VLImageProcessorPil(**image_processor_settings(model.encoders["image"])).save_pretrained(path)


def image_processor_settings(enc: Any) -> dict:
    """A Qwen tower's preprocessing as transformers' Qwen2-VL image processor takes it (the
    Qwen-VL families' processors share that class)."""
    proc = type(enc).processor(enc.config)
    return dict(size={"shortest_edge": proc.min_pixels, "longest_edge": proc.max_pixels}, patch_size=proc.patch,
                temporal_patch_size=proc.frames, merge_size=proc.merge, image_mean=[float(v) for v in proc.mean],
                image_std=[float(v) for v in proc.std])


def _is_variant(variant: str) -> Callable[[OmniModel], bool]:
    def matches(model: OmniModel) -> bool:
        enc = image_encoder(model)
        return isinstance(enc, QwenVisionEncoder) and enc.config.variant == variant
    return matches


FAMILIES: dict[str, Family] = {
    variant: Family(vision="qwen_vl", family_tokens=TOKENS, export=_export, matches=_is_variant(variant))
    for variant in VARIANTS
}
