"""Write a multimodal model back as a Hugging Face vision-language checkpoint directory.

``export_qwen_vl``: a model whose image encoder is the ``qwen_vl`` tower, whose image projector
is its patch merger and whose backbone is a Qwen2 with M-RoPE becomes a Qwen2-VL or
Qwen2.5-VL directory (config.json and safetensors, the names and shapes transformers saves),
which ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` (and
``AutoModelForImageTextToText``) load, and which Omni loads back bit-exactly
(``model.pretrained`` plus the ``qwen_vl`` slot's ``pretrained``).

``export_llava``: a model whose image encoder is the ``clip`` tower, whose image projector is
a two-layer MLP as wide as the LLM without a merge (LLaVA's ``multi_modal_projector``, and
Omni's default projector) and whose backbone has 1-D RoPE becomes a LLaVA directory that
``LlavaForConditionalGeneration`` loads, and Omni loads back bit-exactly (``model.pretrained``
plus the ``clip`` slot's ``pretrained``), with the processor's preprocessor_config.json.

``export_llava_onevision`` / ``export_llava_next``: the ``llava_ov`` (``llava_next``) tower,
its projector (LLaVA's MLP and the image newline) and a backbone with 1-D RoPE become a
LLaVA-OneVision (LLaVA-NeXT) directory, with the image processor's preprocessor_config.json.

The config is written by transformers' own config classes, so every field a reader expects is
there. ``token_ids`` are the tokenizer's ids of the config's fields (``video_token_id``,
``vision_start_token_id``..., and ``bos/eos/pad_token_id``, which go in ``text_config``): a
field left out keeps transformers' default, another vocabulary's id. Given ``processor_tokens``
(the processor's ``image_token``, ``video_token``: the tokenizer's placeholders), a LLaVA
family's exporter also writes the processor's processor_config.json, which transformers 5's
``AutoProcessor`` reads (``_write_processor_config``).
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

import torch
from torch import nn

from omni.models.encoders.clip import LLAVA_ACTIVATIONS, ClipEncoder, llava_projector_names
from omni.models.encoders.qwen_vl import QwenVisionEncoder, merger_names
from omni.models.encoders.siglip import SiglipEncoder
from omni.models.hf_io import native_state_dict_to_hf, write_safetensors
from omni.models.multimodal import OmniModel

_CLASSES = {"qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
            "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration")}
# The ids a VLM's config classes keep in ``text_config`` (the language model's), not at the top.
_TEXT_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def export_qwen_vl(model: OmniModel, path: str, image_token_id: int, max_shard_bytes: Optional[int] = None,
                   token_ids: Optional[Mapping[str, Any]] = None) -> None:
    """Write ``model`` (host tensors) to ``path`` as a Qwen2-VL / Qwen2.5-VL checkpoint.
    ``image_token_id``: the tokenizer's image placeholder (config.json's ``image_token_id``);
    ``token_ids``: its other ids (the module doc). Refused, naming the part, for a model that is
    not one: another image encoder, a projector that is not the tower's merger, a backbone
    without M-RoPE, other modalities."""
    import transformers

    enc = _image_encoder(model, QwenVisionEncoder, "export_qwen_vl", "qwen_vl", "a Qwen2-VL")
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
    top, text_ids = _split_ids(token_ids or {})
    text = {**llm.to_hf(text_of_vlm=True), **text_ids, "model_type": f"{variant}_text"}
    config = config_cls(text_config=text, vision_config=enc.hf_vision_config(llm.hidden_size),
                        image_token_id=int(image_token_id), tie_word_embeddings=llm.tie_word_embeddings, **top)
    sd = {"model.visual." + enc.hf_name(name): enc.to_hf_tensor(name, t) for name, t in enc.state_dict().items()}
    merger = merger_names(variant, "model.visual.")
    sd.update({merger[name]: t for name, t in proj.state_dict().items()})
    sd.update(_language_model(model, "model.language_model.", "lm_head.weight"))
    _write(config, model_cls.__name__, sd, path, max_shard_bytes)


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
    enc = _image_encoder(model, ClipEncoder, "export_llava", "clip", "a LLaVA")
    llm = model.llm.config
    if llm.mrope_section is not None:
        raise ValueError(f"a LLaVA checkpoint's language model has 1-D RoPE; this backbone rotates by M-RoPE "
                         f"(mrope_section={llm.mrope_section}), which only a Qwen2-VL checkpoint holds")
    act = _llava_projector(model.projectors["image"], enc.output_dim, llm.hidden_size)
    c = enc.config
    top, text_ids = _split_ids(token_ids or {})
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
    sd.update(_language_model(model, "language_model.model.", "language_model.lm_head.weight"))
    _write(config, "LlavaForConditionalGeneration", sd, path, max_shard_bytes)
    # The processor's settings (resize, crop, padding, normalisation) are the tower's input
    # contract: written beside it, so the directory loads back with the same preprocessing.
    pp = enc.hf_preprocessor_config()
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(pp, f, indent=2)
    if processor_tokens is not None:
        # the same settings in their transformers class (its PIL variant: the default needs torchvision);
        # a CLIP tower's class token is one token more than its patches, which the processor counts
        image_processor = getattr(transformers, pp["image_processor_type"] + "Pil")(
            **{k: v for k, v in pp.items() if k != "image_processor_type"})
        _write_processor_config(path, "LlavaProcessor", image_processor, **processor_tokens, patch_size=c.patch_size,
                                num_additional_image_tokens=1,
                                vision_feature_select_strategy=c.vision_feature_select_strategy)


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

    from omni.models.encoders.llava_ov import LlavaOvEncoder

    enc = _image_encoder(model, LlavaOvEncoder, "export_llava_onevision", "llava_ov", "a LLaVA-OneVision")
    ids = {"image_token_index": int(image_token_id)}
    if video_token_id is not None:
        ids["video_token_index"] = int(video_token_id)
    _export_anyres(model, enc, path, transformers.LlavaOnevisionConfig, "LlavaOnevisionForConditionalGeneration",
                   "vision_tower.", {**(token_ids or {}), **ids}, max_shard_bytes)
    c = enc.config
    image_processor = transformers.LlavaOnevisionImageProcessorPil(
        size={"height": c.image_size, "width": c.image_size}, image_grid_pinpoints=[list(p) for p in c.image_grid_pinpoints],
        image_mean=list(c.image_mean), image_std=list(c.image_std))
    image_processor.save_pretrained(path)
    if processor_tokens is not None:
        # a SigLIP tower has no class token: a tile is its patches; the video processor (it needs
        # torchvision) is left to transformers, which reads it from preprocessor_config.json
        _write_processor_config(path, "LlavaOnevisionProcessor", image_processor, **processor_tokens,
                                num_image_tokens=(c.image_size // c.patch_size) ** 2,
                                vision_feature_select_strategy=c.vision_feature_select_strategy,
                                vision_aspect_ratio=c.vision_aspect_ratio)


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

    from omni.models.encoders.llava_next import LlavaNextEncoder

    enc = _image_encoder(model, LlavaNextEncoder, "export_llava_next", "llava_next", "a LLaVA-NeXT")
    _export_anyres(model, enc, path, transformers.LlavaNextConfig, "LlavaNextForConditionalGeneration",
                   "vision_tower.vision_model.", {**(token_ids or {}), "image_token_index": int(image_token_id)},
                   max_shard_bytes)
    image_processor = enc.hf_image_processor()
    image_processor.save_pretrained(path)
    if processor_tokens is not None:
        c = enc.config  # a CLIP tower: the processor counts its class token, as in export_llava
        _write_processor_config(path, "LlavaNextProcessor", image_processor, **processor_tokens,
                                patch_size=c.patch_size, num_additional_image_tokens=1,
                                vision_feature_select_strategy=c.vision_feature_select_strategy)


def _export_anyres(model: OmniModel, enc: Any, path: str, config_cls: type, architecture: str, tower_prefix: str,
                   ids: dict, max_shard_bytes: Optional[int]) -> None:
    """The weights and config.json of a LLaVA family with an anyres layout (NeXT, OneVision):
    the tower under ``tower_prefix``, LLaVA's MLP and the image newline, the language model; the
    layout's fields from the tower (``hf_layout_config``); ``ids``: the config's token ids
    (``_TEXT_IDS`` among them go in ``text_config``)."""
    llm = model.llm.config
    if llm.mrope_section is not None:
        raise ValueError(f"a {architecture} checkpoint's language model has 1-D RoPE; this backbone rotates by M-RoPE "
                         f"(mrope_section={llm.mrope_section})")
    proj = model.projectors["image"]
    act = _llava_projector(proj, enc.output_dim, llm.hidden_size)
    top, text_ids = _split_ids(ids)
    config = config_cls(
        text_config={**llm.to_hf(text_of_vlm=True), **text_ids}, vision_config=enc.hf_vision_config(),
        projector_hidden_act=act, multimodal_projector_bias=True, tie_word_embeddings=llm.tie_word_embeddings, **top,
        **enc.hf_layout_config())
    sd = {tower_prefix + enc.hf_name(name): enc.to_hf_tensor(name, t) for name, t in enc.state_dict().items()}
    names = {**llava_projector_names("multi_modal_projector."), "image_newline": "image_newline"}
    sd.update({names[name]: t for name, t in proj.state_dict().items()})
    sd.update(_language_model(model, "language_model.model.", "language_model.lm_head.weight"))
    _write(config, architecture, sd, path, max_shard_bytes)
    # The processor's settings are the tower's input contract: the caller writes them beside it.


def _split_ids(token_ids: Mapping[str, Any]) -> tuple[dict, dict]:
    """``token_ids`` as (the config's top-level fields, ``text_config``'s: ``_TEXT_IDS``)."""
    return ({k: v for k, v in token_ids.items() if k not in _TEXT_IDS},
            {k: v for k, v in token_ids.items() if k in _TEXT_IDS})


def _write_processor_config(path: str, processor: str, image_processor: Any, **settings: Any) -> None:
    """processor_config.json as transformers 5's ``processor.save_pretrained`` writes it (its
    ``to_json_string``): the processor's own settings, its ``__init__`` arguments (how many
    placeholders an image becomes: without them its first call fails), and the image
    processor's, nested. Written here, not by the processor class: LLaVA-OneVision's cannot be
    built without its video processor, which needs torchvision; the tokenizer (and its chat
    template) ``omni export`` writes itself."""
    config = {"processor_class": processor, "image_processor": json.loads(image_processor.to_json_string()), **settings}
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _llava_projector(proj: nn.Module, in_dim: int, width: int) -> str:
    """LLaVA's ``projector_hidden_act`` for an Omni projector that is LLaVA's MLP (linear_1 from
    the tower's width to the LLM's, the activation, linear_2 from the LLM's width to itself);
    a ValueError naming the difference otherwise."""
    merge = getattr(proj, "merge", 1)
    if merge != 1:
        raise ValueError(f"the image projector merges {merge} tower tokens per LLM token (spatial_merge), with a norm; "
                         f"LLaVA's projector maps each token alone, without one")
    shape = (proj.fc1.in_features, proj.fc1.out_features, proj.fc2.out_features)
    if shape != (in_dim, width, width) or proj.fc1.bias is None or proj.fc2.bias is None:
        raise ValueError(f"the image projector is {shape[0]} -> {shape[1]} -> {shape[2]}; LLaVA's is {in_dim} -> "
                         f"{width} -> {width} with biases (its hidden width is the LLM's: projector.hidden_mult=1)")
    by_module = {nn.GELU: "gelu", nn.SiLU: "silu", nn.ReLU: "relu"}
    act = by_module.get(type(proj.act))
    if act is None or act not in LLAVA_ACTIVATIONS or (act == "gelu" and proj.act.approximate != "none"):
        raise ValueError(f"the image projector's activation {proj.act} has no LLaVA projector_hidden_act "
                         f"(supported: exact {', '.join(LLAVA_ACTIVATIONS)})")
    return act


def _image_encoder(model: OmniModel, cls: type, fn: str, plugin: str, what: str) -> Any:
    """The model's image encoder, refused unless it is a ``cls`` and the only encoder."""
    enc = model.encoders["image"] if "image" in model.encoders else None
    if not isinstance(enc, cls):
        raise ValueError(f"{fn} needs the {plugin} image encoder (encoders.vision.name={plugin})")
    if set(model.encoders) != {"image"}:
        raise ValueError(f"{what} checkpoint holds an image encoder only; this model also has "
                         f"{sorted(set(model.encoders) - {'image'})}")
    return enc


def _language_model(model: OmniModel, prefix: str, head: str) -> dict[str, torch.Tensor]:
    """The backbone's tensors under the checkpoint's names: ``prefix`` for the decoder (in place
    of a causal LM's ``model.``), ``head`` for an untied LM head."""
    out = {}
    for name, t in native_state_dict_to_hf(model.llm.state_dict(), model.llm.config).items():
        out[head if name == "lm_head.weight" else prefix + name[len("model."):]] = t
    return out


def _write(config: Any, architecture: str, sd: dict[str, torch.Tensor], path: str,
           max_shard_bytes: Optional[int]) -> None:
    config.architectures = [architecture]
    os.makedirs(path, exist_ok=True)
    config.dtype = str(next(iter(sd.values())).dtype).replace("torch.", "")
    config.save_pretrained(path)
    write_safetensors(sd, path, max_shard_bytes)
