"""Build the multimodal model and its media processors from config."""
from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, Mapping

import torch
from torch import nn

from dataloading.media import MediaProcessor
from omni.errors import ConfigError
from omni.models.config import EncoderSlot, ModelConfig
from omni.kernels import BACKENDS
from omni.models.encoders.base import EncoderAnchor
from omni.models.encoders.registry import build_encoder
from omni.models.llm import Decoder, DecoderConfig
from omni.models.multimodal import OmniModel
from omni.models.projector import Projector


def build_llm(cfg: ModelConfig) -> Decoder:
    if cfg.pretrained:
        from omni.models.hf_io import load_pretrained

        try:
            return load_pretrained(cfg.pretrained)
        except ValueError as exc:  # unsupported model type, missing weights, shape mismatch
            raise ConfigError(f"model.pretrained={cfg.pretrained}: {exc}") from None
    decoder_fields = {f.name for f in fields(DecoderConfig)}
    return Decoder(DecoderConfig(**{k: v for k, v in asdict(cfg).items() if k in decoder_fields}))


def build_encoders(slots: Mapping[str, EncoderSlot]) -> dict[str, tuple[str, EncoderAnchor]]:
    """modality -> (slot name, encoder). The slot name ("vision") is the user's label; the
    plugin's modality ("image") is what the data plane and placeholders speak."""
    by_modality: dict[str, tuple[str, EncoderAnchor]] = {}
    for slot_name, slot in slots.items():
        plugin = slot._target_ or slot.name
        try:
            enc = build_encoder(plugin, dict(slot.params), pretrained=slot.pretrained)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"encoders.{slot_name}: {exc}") from None
        if enc.modality in by_modality:
            raise ConfigError(
                f"encoders.{slot_name} and encoders.{by_modality[enc.modality][0]} both encode "
                f"'{enc.modality}'; remove one (e.g. ~encoders.{slot_name})"
            )
        by_modality[enc.modality] = (slot_name, enc)
    return by_modality


def build_model(cfg: ModelConfig, slots: Mapping[str, EncoderSlot], vocab_needed: int) -> OmniModel:
    llm = build_llm(cfg)
    have = llm.config.vocab_size
    if have < vocab_needed and cfg.pretrained and vocab_needed - have <= len(slots):
        # The tokenizer appended the placeholders of the configured modalities (one per encoder
        # slot, dataloading/tokenizer.py) to the checkpoint's vocabulary.
        grow_vocab(llm, vocab_needed)
    elif have < vocab_needed and cfg.pretrained:
        raise ConfigError(
            f"the tokenizer has {vocab_needed} tokens but the checkpoint model.pretrained={cfg.pretrained} "
            f"has model.vocab_size={have}; use the checkpoint's own tokenizer (data.tokenizer={cfg.pretrained})"
        )
    elif have < vocab_needed:
        raise ConfigError(
            f"the tokenizer has {vocab_needed} tokens but model.vocab_size={have}; "
            f"set model.vocab_size={vocab_needed} or larger"
        )
    built = build_encoders(slots)
    encoders = {m: enc for m, (_, enc) in built.items()}
    projectors = {
        m: Projector(enc.output_dim, llm.config.hidden_size, **_projector_kwargs(slots[name]))
        for m, (name, enc) in built.items()
    }
    frozen = {m for m, (name, _) in built.items() if slots[name].freeze}
    if cfg.attn_backend not in BACKENDS:
        raise ConfigError(f"model.attn_backend={cfg.attn_backend!r} is not one of {', '.join(BACKENDS)}")
    model = OmniModel(llm, encoders, projectors, frozen=frozen)
    model.set_attn_backend(cfg.attn_backend)
    return model


@torch.no_grad()
def grow_vocab(llm: Decoder, vocab_size: int) -> None:
    """Append embedding (and untied LM-head) rows up to ``vocab_size``; new rows start at the
    mean of the existing ones, so the new tokens begin as an "average" token."""
    extra = vocab_size - llm.config.vocab_size
    for module in (llm.embed_tokens, llm.lm_head):
        if module is None:
            continue  # tied head: reads the embedding
        w = module.weight
        module.weight = nn.Parameter(torch.cat([w, w.mean(0, keepdim=True).expand(extra, -1)]))
    llm.embed_tokens.num_embeddings = vocab_size
    if llm.lm_head is not None:
        llm.lm_head.out_features = vocab_size
    llm.config.vocab_size = vocab_size


def _projector_kwargs(slot: EncoderSlot) -> dict[str, Any]:
    return {"hidden_mult": slot.projector.hidden_mult, "activation": slot.projector.activation}


def media_processors(model: OmniModel) -> dict[str, MediaProcessor]:
    """The weight-free preprocessing of each encoder, handed to the data plane."""
    return {m: type(enc).processor(enc.config) for m, enc in model.encoders.items()}
