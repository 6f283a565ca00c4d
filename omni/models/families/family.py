"""What every family room declares and uses: the ``Family`` entry, and the ids and files of
the tokenizer ``omni export`` wrote, which a room's exporter names in its config.json.

Kept apart from the package's ``__init__`` (which joins the rooms), so that a room imports
this module and never the package that imports it (no import circle).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

from dataloading.formats.tokenizer import PlaceholderTokens, Tokenizer
from omni.models.multimodal import OmniModel


@dataclass(frozen=True)
class Family:
    """One kind of checkpoint directory. ``vision``, ``audio``: the encoder plugins of its vision
    and audio towers (None: the family has none; neither: an LLM alone). ``export``: ``(model, path, tokenizer, vocab)`` writing a model in the
    family's transformers class, ``vocab`` being the tokenizer already written to ``path`` as
    transformers loads it (``exported_tokenizer``); ``matches``: whether a built model has the
    family's parts."""

    vision: Optional[str] = None
    audio: Optional[str] = None
    family_tokens: Mapping[str, PlaceholderTokens] = field(default_factory=dict)
    export: Optional[Callable[[OmniModel, str, Tokenizer, Any], None]] = None
    matches: Optional[Callable[[OmniModel], bool]] = None


def towers(family: "Family") -> dict[str, str]:
    """Encoder slot -> plugin of the family's towers (``vision``, ``audio``)."""
    return {slot: plugin for slot, plugin in (("vision", family.vision), ("audio", family.audio)) if plugin}


def image_encoder(model: OmniModel) -> Any:
    """The model's image encoder, or None (what a room's ``matches`` looks at)."""
    return model.encoders["image"] if "image" in model.encoders else None


def image_family(vision: str, encoder: type, export: Callable[..., None]) -> Family:
    """The entry of a family whose vocabulary has one placeholder, ``<image>``, and whose
    ``vision`` tower is an ``encoder``: its ``export(model, path, image_token_id=, token_ids=,
    processor_tokens=)`` writes the model and its processor's settings."""

    def export_family(model: OmniModel, path: str, tokenizer: Tokenizer, vocab: Any) -> None:
        image = tokenizer.placeholder_ids["image"]
        export(model, path, image_token_id=image, token_ids=config_ids(vocab, {}),
               processor_tokens={"image_token": vocab.convert_ids_to_tokens(image)})

    def matches(model: OmniModel) -> bool:
        return isinstance(image_encoder(model), encoder)

    return Family(vision=vision, export=export_family, matches=matches)


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
