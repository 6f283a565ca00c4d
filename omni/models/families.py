"""Model families: the Hugging Face checkpoints Omni loads and writes as whole multimodal models.

A family is what a ``config.json``'s ``model_type`` names: the LLM (read by ``hf_io``), the
encoder plugin of its vision tower (which also loads the tower's projector, e.g. Qwen2-VL's
patch merger), how its vocabulary writes a media placeholder, and the function that writes a
model back in the family's own transformers class. Adding a family is one module (the tower
plugin and the exporter) plus an entry in ``FAMILIES``.

``load_pretrained(dir)`` builds the whole model of a family's directory; ``family_of_model``
finds the family a built (or trained) model can be written as, for ``omni export``, which writes
the tokenizer first: the exporter names its ids (``config_ids``) and ``write_generation_config``
says where transformers' ``generate`` stops.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

from dataloading.formats.tokenizer import PlaceholderTokens, Tokenizer, load_tokenizer
from omni.errors import ConfigError
from omni.models.config import EncoderSlot, ModelConfig
from omni.models.hf_checkpoint import read_hf_config
from omni.models.llm.config import FAMILIES as LLM_FAMILIES
from omni.models.multimodal import OmniModel

# Qwen2-VL's vocabulary frames each image (video) with vision start/end tokens around the
# placeholder it repeats once per merged patch.
_QWEN_VL_TOKENS = {"image": PlaceholderTokens("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"),
                   "video": PlaceholderTokens("<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
# The config.json fields of those tokens, besides the image placeholder (the tokenizer's own).
_QWEN_VL_IDS = {"video_token_id": _QWEN_VL_TOKENS["video"].token,
                "vision_start_token_id": _QWEN_VL_TOKENS["image"].before,
                "vision_end_token_id": _QWEN_VL_TOKENS["image"].after}


@dataclass(frozen=True)
class Family:
    """One kind of checkpoint directory. ``vision``: the encoder plugin of its vision tower
    (None: an LLM alone). ``export``: ``(model, path, tokenizer, vocab)`` writing a model in the
    family's transformers class, ``vocab`` being the tokenizer already written to ``path`` as
    transformers loads it (``exported_tokenizer``); ``matches``: whether a built model has the
    family's parts."""

    vision: Optional[str] = None
    family_tokens: Mapping[str, PlaceholderTokens] = field(default_factory=dict)
    export: Optional[Callable[[OmniModel, str, Tokenizer, Any], None]] = None
    matches: Optional[Callable[[OmniModel], bool]] = None


def exported_tokenizer(path: str) -> Any:
    """The tokenizer ``omni export`` wrote to ``path``, as transformers loads it: the one whose ids
    the exported config names (a user of the export gets that one)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def config_ids(vocab: Any, tokens: Mapping[str, str]) -> dict[str, Optional[int]]:
    """The ids a family's config.json names, from ``vocab`` (``exported_tokenizer``): ``tokens``
    (field -> token; -1 for a token the vocabulary lacks, an id no input holds, where
    transformers' default would be another vocabulary's) and its bos/eos/pad (None where it
    has none)."""
    known = vocab.get_vocab()
    out: dict[str, Optional[int]] = {f: int(known.get(t, -1)) for f, t in tokens.items()}
    out.update(bos_token_id=vocab.bos_token_id, eos_token_id=vocab.eos_token_id, pad_token_id=vocab.pad_token_id)
    return out


def write_generation_config(path: str, vocab: Any, stop_ids: Iterable[int]) -> None:
    """generation_config.json: transformers' ``generate`` stops at ``stop_ids`` (where ``omni
    generate`` stops: the tokenizer's eos first, then those a chat model adds, e.g. Qwen's
    ``<|endoftext|>`` beside ``<|im_end|>``) and takes bos and pad from ``vocab``. Without it,
    generate would take the ids of the config class's defaults (another vocabulary's)."""
    import transformers

    eos = [int(vocab.eos_token_id)] + sorted({int(i) for i in stop_ids} - {int(vocab.eos_token_id)})
    ids = {"bos_token_id": vocab.bos_token_id, "pad_token_id": vocab.pad_token_id,
           "eos_token_id": eos[0] if len(eos) == 1 else eos}
    transformers.GenerationConfig(**{k: v for k, v in ids.items() if v is not None}).save_pretrained(path)


def _export_llm(model: OmniModel, path: str, tokenizer: Tokenizer, vocab: Any) -> None:
    from omni.models.hf_io import export_pretrained

    export_pretrained(model.llm, path)
    # hf_io writes the architecture; the ids are the tokenizer's (transformers would take its
    # class defaults otherwise: Llama's 1 and 2), in hf_io's layout
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = {**json.load(f), **config_ids(vocab, {})}
    with open(file, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _is_llm(model: OmniModel) -> bool:
    return not model.encoders


def _export_qwen_vl(model: OmniModel, path: str, tokenizer: Tokenizer, vocab: Any) -> None:
    """The model, and the image processor's settings as transformers' Qwen2-VL image processor
    reads them (its PIL variant: the default one needs torchvision, and both write the same file).
    Its processor has no settings of its own: no processor_config.json."""
    import transformers

    from omni.models.hf_vlm import export_qwen_vl

    export_qwen_vl(model, path, image_token_id=tokenizer.placeholder_ids["image"],
                   token_ids=config_ids(vocab, _QWEN_VL_IDS))
    proc = type(model.encoders["image"]).processor(model.encoders["image"].config)
    transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": proc.min_pixels, "longest_edge": proc.max_pixels}, patch_size=proc.patch,
        temporal_patch_size=proc.frames, merge_size=proc.merge, image_mean=[float(v) for v in proc.mean],
        image_std=[float(v) for v in proc.std]).save_pretrained(path)


def _is_qwen_vl(variant: str) -> Callable[[OmniModel], bool]:
    def matches(model: OmniModel) -> bool:
        from omni.models.encoders.qwen_vl import QwenVisionEncoder

        enc = model.encoders["image"] if "image" in model.encoders else None
        return isinstance(enc, QwenVisionEncoder) and enc.config.variant == variant
    return matches


def _export_llava(model: OmniModel, path: str, tokenizer: Tokenizer, vocab: Any) -> None:
    """The model and its processor's settings (``export_llava`` writes both)."""
    from omni.models.hf_vlm import export_llava

    image = tokenizer.placeholder_ids["image"]
    export_llava(model, path, image_token_id=image, token_ids=config_ids(vocab, {}),
                 processor_tokens={"image_token": vocab.convert_ids_to_tokens(image)})


def _is_llava(model: OmniModel) -> bool:
    from omni.models.encoders.clip import ClipEncoder

    return isinstance(model.encoders["image"] if "image" in model.encoders else None, ClipEncoder)


def _export_llava_onevision(model: OmniModel, path: str, tokenizer: Tokenizer, vocab: Any) -> None:
    """The model and its processor's settings; the video placeholder is the vocabulary's
    ``<video>`` (-1 without one: Omni itself writes a video's rows at image placeholders,
    ``dataloading.formats.media.as_encoder_placeholders``)."""
    from omni.models.hf_vlm import export_llava_onevision

    image = tokenizer.placeholder_ids["image"]
    ids = config_ids(vocab, {"video_token_index": "<video>"})
    video = ids.pop("video_token_index")
    tokens = {"image_token": vocab.convert_ids_to_tokens(image), **({"video_token": "<video>"} if video >= 0 else {})}
    export_llava_onevision(model, path, image_token_id=image, video_token_id=video, token_ids=ids,
                           processor_tokens=tokens)


def _is_llava_onevision(model: OmniModel) -> bool:
    from omni.models.encoders.llava_ov import LlavaOvEncoder

    return isinstance(model.encoders["image"] if "image" in model.encoders else None, LlavaOvEncoder)


def _export_llava_next(model: OmniModel, path: str, tokenizer: Tokenizer, vocab: Any) -> None:
    """The model and its processor's settings (``export_llava_next`` writes both)."""
    from omni.models.hf_vlm import export_llava_next

    image = tokenizer.placeholder_ids["image"]
    export_llava_next(model, path, image_token_id=image, token_ids=config_ids(vocab, {}),
                      processor_tokens={"image_token": vocab.convert_ids_to_tokens(image)})


def _is_llava_next(model: OmniModel) -> bool:
    from omni.models.encoders.llava_next import LlavaNextEncoder

    return isinstance(model.encoders["image"] if "image" in model.encoders else None, LlavaNextEncoder)


FAMILIES: dict[str, Family] = {
    **{t: Family(export=_export_llm, matches=_is_llm) for t in LLM_FAMILIES},
    "qwen2_vl": Family(vision="qwen_vl", family_tokens=_QWEN_VL_TOKENS, export=_export_qwen_vl,
                       matches=_is_qwen_vl("qwen2_vl")),
    "qwen2_5_vl": Family(vision="qwen_vl", family_tokens=_QWEN_VL_TOKENS, export=_export_qwen_vl,
                         matches=_is_qwen_vl("qwen2_5_vl")),
    # LLaVA's vocabulary has the placeholder Omni writes, <image>, once per image token.
    "llava": Family(vision="clip", export=_export_llava, matches=_is_llava),
    # LLaVA-OneVision's too (<image>, and <video>, which Omni writes as <image>).
    "llava_onevision": Family(vision="llava_ov", export=_export_llava_onevision, matches=_is_llava_onevision),
    # LLaVA-NeXT's too (<image>).
    "llava_next": Family(vision="llava_next", export=_export_llava_next, matches=_is_llava_next),
}


def family_of(path: str) -> tuple[str, Family]:
    """The family of a checkpoint directory, from its config.json; one line when unsupported."""
    model_type = read_hf_config(path).get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"{path}: config.json model_type={model_type!r} is not a family Omni loads; "
                          f"supported: {', '.join(FAMILIES)}")
    return model_type, FAMILIES[model_type]


def encoder_slots(path: str) -> dict[str, EncoderSlot]:
    """The encoder slots of a family's directory: its vision tower (and the tower's projector)
    loaded from the same directory."""
    _, family = family_of(path)
    return {"vision": EncoderSlot(name=family.vision, pretrained=path)} if family.vision else {}


def pretrained_tokenizer(path: str, modalities=None) -> Tokenizer:
    """The directory's own tokenizer, its placeholders written the family's way."""
    _, family = family_of(path)
    if modalities is None:
        modalities = ["image"] if family.vision else []
    return load_tokenizer(path, modalities=modalities, family_tokens=family.family_tokens)


def load_pretrained(path: str, attn_backend: str = "auto") -> OmniModel:
    """The whole multimodal model of a family's directory (LLM, vision tower, projector), on
    the host in the checkpoint's weights. The vocabulary is the tokenizer's when that adds
    placeholders the checkpoint lacks (``pretrained_tokenizer``)."""
    from omni.models.build import build_model

    slots = encoder_slots(path)
    has_tokenizer = any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    # Without a tokenizer beside the weights, the checkpoint's own vocabulary.
    vocab = pretrained_tokenizer(path, modalities=["image"] if slots else []).vocab_size if has_tokenizer else 0
    return build_model(ModelConfig(pretrained=path, attn_backend=attn_backend), slots, vocab_needed=vocab, seed=0)


def family_of_model(model: OmniModel) -> tuple[str, Family]:
    """The family whose transformers class can hold ``model``; one line naming what does not fit."""
    for name, family in FAMILIES.items():
        if family.matches is not None and family.matches(model):
            return name, family
    parts = ", ".join(f"{m}={type(e).__name__}" for m, e in model.encoders.items())
    raise ConfigError(f"no Hugging Face family holds this model (encoders: {parts}); exportable: an LLM alone, "
                      f"or {', '.join(n for n, f in FAMILIES.items() if f.vision)} "
                      f"(encoders.vision.name={', '.join(sorted({f.vision for f in FAMILIES.values() if f.vision}))})")
