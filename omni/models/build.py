"""Build the multimodal model and its media processors from config."""
from __future__ import annotations

import warnings
from dataclasses import asdict, fields
from typing import Any, Mapping, Optional

import torch
from torch import nn

from dataloading.formats.media import MediaProcessor
from omni.errors import ConfigError
from omni.models.config import EncoderSlot, ModelConfig
from omni.models import lora
from omni.models.freeze import ModuleNames, freeze, frozen_units
from omni.kernels import BACKENDS
from omni.models.encoders.base import EncoderAnchor
from omni.models.encoders.registry import build_encoder
from omni.models.llm import Decoder, DecoderConfig
from omni.models.materialize import (SeededInit, Sources, TensorSource, WeightSource, default_device_is_meta,
                                     materialize)
from omni.models.multimodal import OmniModel
from omni.models.projector import Projector


def build_llm(cfg: ModelConfig) -> tuple[Decoder, Optional[WeightSource]]:
    """The backbone on the meta device, and the checkpoint its weights come from (None: a
    random initialisation)."""
    if cfg.pretrained:
        from omni.models.hf_io import pretrained_on_meta

        try:
            return pretrained_on_meta(cfg.pretrained)
        except ValueError as exc:  # unsupported model type, missing weights, shape mismatch
            raise ConfigError(f"model.pretrained={cfg.pretrained}: {exc}") from None
    decoder_fields = {f.name for f in fields(DecoderConfig)}
    with torch.device("meta"):
        return Decoder(DecoderConfig(**{k: v for k, v in asdict(cfg).items() if k in decoder_fields})), None


def build_encoders(slots: Mapping[str, EncoderSlot]) -> dict[str, tuple[str, EncoderAnchor, Optional[WeightSource]]]:
    """modality -> (slot name, encoder on the meta device, the checkpoint's weights or None).
    The slot name ("vision") is the user's label; the plugin's modality ("image") is what the
    data plane and placeholders speak."""
    by_modality: dict[str, tuple[str, EncoderAnchor, Optional[WeightSource]]] = {}
    for slot_name, slot in slots.items():
        plugin = slot._target_ or slot.name
        try:
            if slot.pretrained:  # encoders are small: read whole on the host, kept as the source
                with torch.device("cpu"):
                    enc = build_encoder(plugin, dict(slot.params), pretrained=slot.pretrained)
                weights = TensorSource.of(enc)
                enc.to("meta")
            else:
                with torch.device("meta"):
                    enc = build_encoder(plugin, dict(slot.params))
                weights = None
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"encoders.{slot_name}: {exc}") from None
        if enc.modality in by_modality:
            raise ConfigError(
                f"encoders.{slot_name} and encoders.{by_modality[enc.modality][0]} both encode "
                f"'{enc.modality}'; remove one (e.g. ~encoders.{slot_name})"
            )
        by_modality[enc.modality] = (slot_name, enc, weights)
    return by_modality


def build_model(cfg: ModelConfig, slots: Mapping[str, EncoderSlot], vocab_needed: int,
                seed: Optional[int] = None) -> OmniModel:
    """The whole model, materialised on the host, with the weights every layout starts from
    (``seed``; None: drawn from torch's global generator, so ``torch.manual_seed`` decides)."""
    model, weights = build_meta_model(cfg, slots, vocab_needed, seed)
    if not default_device_is_meta():  # under `with torch.device("meta")`: the structure only
        materialize([model], weights, torch.device("cpu"))
    return model


def build_meta_model(cfg: ModelConfig, slots: Mapping[str, EncoderSlot], vocab_needed: int,
                     seed: Optional[int] = None) -> tuple[OmniModel, WeightSource]:
    """The model on the meta device (no storage: any size builds anywhere) and where its
    weights come from: the checkpoints, else an initialisation from ``seed`` that depends only
    on (seed, tensor name, shape). ``omni.runtime.parallelize`` splits and shards the model on
    meta and then materialises each rank's part from the source."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), device="cpu"))
    llm, llm_weights = build_llm(cfg)
    have = llm.config.vocab_size
    if have < vocab_needed and cfg.pretrained and vocab_needed - have <= len(slots):
        # The tokenizer appended the placeholders of the configured modalities (one per encoder
        # slot, dataloading/formats/tokenizer.py) to the checkpoint's vocabulary.
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
    encoders = {m: enc for m, (_, enc, _) in built.items()}
    projectors, projector_weights = {}, []
    for m, (name, enc, _) in built.items():
        projectors[m], source = build_projector(name, slots[name], enc, llm.config.hidden_size)
        if source is not None:
            projector_weights.append((f"projectors.{m}.", source))
    if cfg.attn_backend not in BACKENDS:
        raise ConfigError(f"model.attn_backend={cfg.attn_backend!r} is not one of {', '.join(BACKENDS)}")
    model = OmniModel(llm, encoders, projectors)
    model.set_attn_backend(cfg.attn_backend)
    # LoRA adapters (model.lora) now, before freezing and parallelism: both act on the adapted
    # model's parameters.
    lora.inject(model, cfg.lora, {name: m for m, (name, _, _) in built.items()})
    # Freezing (model.freeze, encoders.<slot>.freeze) last: after the adapters, before parallelism.
    names = ModuleNames({name: m for m, (name, _, _) in built.items()})
    try:
        freeze(model, names, frozen_units(names, cfg.freeze, slots))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    prefixed = [("llm.", llm_weights)] if llm_weights is not None else []
    prefixed += [(f"encoders.{m}.", w) for m, (_, _, w) in built.items() if w is not None]
    weights = Sources(prefixed + projector_weights, SeededInit(seed))
    return model, lora.LoraWeights(weights, seed) if cfg.lora.rank else weights


def build_projector(slot_name: str, slot: EncoderSlot, enc: EncoderAnchor,
                    llm_width: int) -> tuple[Projector, Optional[WeightSource]]:
    """The slot's projector on the meta device, and its weights: those the encoder's checkpoint
    holds beside it (``EncoderAnchor.pretrained_projector``, e.g. Qwen-VL's merger) when
    ``projector.pretrained`` allows and it maps into this LLM's width, else None (a fresh
    one, shaped by ``projector.hidden_mult`` and ``activation``)."""
    try:
        held = type(enc).pretrained_projector(slot.pretrained) if slot.pretrained and slot.projector.pretrained else None
    except ValueError as exc:  # a checkpoint projector Omni's cannot hold (the message names the fix)
        raise ConfigError(f"encoders.{slot_name}: {exc}") from None
    if held is not None and held.out_dim != llm_width:
        warnings.warn(f"encoders.{slot_name}: the projector in {slot.pretrained} maps to width {held.out_dim}, this "
                      f"LLM takes {llm_width}: the projector starts fresh", stacklevel=2)
        held = None
    if held is None:
        with torch.device("meta"):
            return enc.new_projector(llm_width, **{**_projector_kwargs(slot), **enc.fresh_projector()}), None
    from omni.models.hf_checkpoint import CheckpointReader

    with torch.device("cpu"):
        proj = enc.new_projector(llm_width, activation=held.activation, norm=held.norm, hidden=held.hidden)
    raw = CheckpointReader(slot.pretrained).tensors(held.names.values())
    try:
        proj.load_state_dict({ours: raw[theirs].to(torch.get_default_dtype()) for ours, theirs in held.names.items()},
                             strict=True)
    except RuntimeError as exc:  # a checkpoint whose merger does not match its own config
        raise ConfigError(f"encoders.{slot_name}: the projector in {slot.pretrained} does not load: "
                          f"{str(exc).splitlines()[0]}") from None
    weights = TensorSource.of(proj)
    proj.to("meta")
    return proj, weights


def grow_vocab(llm: Decoder, vocab_size: int) -> None:
    """Give the embedding (and an untied LM head) of a decoder on the meta device ``vocab_size``
    rows; the checkpoint source fills the new rows with the mean of the existing ones
    (``hf_io.CheckpointSource``), so the new tokens begin as an "average" token."""
    for module in (llm.embed_tokens, llm.lm_head):
        if module is None:
            continue  # tied head: reads the embedding
        w = module.weight
        module.weight = nn.Parameter(torch.empty(vocab_size, *w.shape[1:], dtype=w.dtype, device="meta"))
    llm.embed_tokens.num_embeddings = vocab_size
    if llm.lm_head is not None:
        llm.lm_head.out_features = vocab_size
    llm.config.vocab_size = vocab_size


def _projector_kwargs(slot: EncoderSlot) -> dict[str, Any]:
    return {"hidden_mult": slot.projector.hidden_mult, "activation": slot.projector.activation}


def media_processors(model: OmniModel) -> dict[str, MediaProcessor]:
    """The weight-free preprocessing of each encoder, handed to the data plane."""
    return {m: type(enc).processor(enc.config) for m, enc in model.encoders.items()}
