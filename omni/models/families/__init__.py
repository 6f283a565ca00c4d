"""Model families: the Hugging Face checkpoints Omni loads and writes as whole multimodal models.

A family is what a ``config.json``'s ``model_type`` names: the LLM (read by ``hf_io``), the
encoder plugin of its vision tower (which also loads the tower's projector, e.g. Qwen2-VL's
patch merger), how its vocabulary writes a media placeholder, and the function that writes a
model back in the family's own transformers class. Each family is a room, one module here that
declares its entries (``FAMILIES``) and holds its tokens and exporter: ``llm`` (the LLM-only
families), ``qwen_vl``, ``qwen3_vl``, ``llava``, ``llava_onevision``, ``llava_next``, ``qwen_omni``, ``qwen3_omni``; what the exporters share
is ``_hf_export``, the ``Family`` entry ``family``. Adding a family is its room (and its encoder
plugin if new, and its config presets) plus its name in ``_ROOMS``.

``load_pretrained(dir)`` builds the whole model of a family's directory; ``family_of_model``
finds the family a built (or trained) model can be written as, for ``omni export``, which writes
the tokenizer first: the exporter names its ids (``config_ids``) and ``write_generation_config``
says where transformers' ``generate`` stops.
"""
from __future__ import annotations

import os
from types import MappingProxyType
from typing import Iterable, Mapping

from dataloading.formats.tokenizer import Tokenizer, load_tokenizer
from omni.errors import ConfigError
from omni.models.config import EncoderSlot, ModelConfig
from omni.models.families import llava, llava_next, llava_onevision, llm, qwen3_omni, qwen3_vl, qwen_omni, qwen_vl
from omni.models.families.family import Family, config_ids, exported_tokenizer, towers, write_generation_config
from omni.models.hf_checkpoint import read_hf_config
from omni.models.multimodal import OmniModel

__all__ = ["FAMILIES", "Family", "config_ids", "encoder_slots", "exported_tokenizer", "family_of", "family_of_model",
           "load_pretrained", "pretrained_tokenizer", "write_generation_config"]

# The rooms, in the order ``family_of_model`` tries them (and error messages list them).
_ROOMS = (llm, qwen_omni, qwen3_omni, qwen_vl, qwen3_vl, llava, llava_onevision, llava_next)


def _joined(rooms: Iterable) -> Mapping[str, Family]:
    """The rooms' ``FAMILIES`` in one read-only map; a model_type two rooms declare is an error."""
    out: dict[str, Family] = {}
    for room in rooms:
        for name, family in room.FAMILIES.items():
            if name in out:
                raise ValueError(f"family {name!r} is declared twice (again in {room.__name__})")
            out[name] = family
    return MappingProxyType(out)


FAMILIES: Mapping[str, Family] = _joined(_ROOMS)


def family_of(path: str) -> tuple[str, Family]:
    """The family of a checkpoint directory, from its config.json; one line when unsupported."""
    model_type = read_hf_config(path).get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"{path}: config.json model_type={model_type!r} is not a family Omni loads; "
                          f"supported: {', '.join(FAMILIES)}")
    return model_type, FAMILIES[model_type]


def encoder_slots(path: str) -> dict[str, EncoderSlot]:
    """The encoder slots of a family's directory: its vision (and audio) tower, each with its
    projector, loaded from the same directory."""
    _, family = family_of(path)
    return {slot: EncoderSlot(name=plugin, pretrained=path) for slot, plugin in towers(family).items()}


def _modalities(slots: Iterable[str]) -> list[str]:
    """The placeholders of a family's towers: ``<image>`` for a vision tower, ``<audio>`` for an audio one."""
    return [{"vision": "image", "audio": "audio"}[slot] for slot in slots]


def pretrained_tokenizer(path: str, modalities=None) -> Tokenizer:
    """The directory's own tokenizer, its placeholders written the family's way."""
    _, family = family_of(path)
    if modalities is None:
        modalities = _modalities(towers(family))
    return load_tokenizer(path, modalities=modalities, family_tokens=family.family_tokens)


def load_pretrained(path: str, attn_backend: str = "auto") -> OmniModel:
    """The whole multimodal model of a family's directory (LLM, vision tower, projector), on
    the host in the checkpoint's weights. The vocabulary is the tokenizer's when that adds
    placeholders the checkpoint lacks (``pretrained_tokenizer``)."""
    from omni.models.build import build_model

    slots = encoder_slots(path)
    has_tokenizer = any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    # Without a tokenizer beside the weights, the checkpoint's own vocabulary.
    vocab = pretrained_tokenizer(path, modalities=_modalities(slots)).vocab_size if has_tokenizer else 0
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
