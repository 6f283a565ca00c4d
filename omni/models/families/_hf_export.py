"""What the vision-language families' exporters share: writing a model back as its Hugging Face
directory (the rooms ``qwen_vl``, ``llava``, ``llava_next``, ``llava_onevision`` each write
their own transformers class with these).

The config is written by transformers' own config classes, so every field a reader expects is
there. ``token_ids`` are the tokenizer's ids of the config's fields (``video_token_id``,
``vision_start_token_id``..., and ``bos/eos/pad_token_id``, which go in ``text_config``): a
field left out keeps transformers' default, another vocabulary's id. Given ``processor_tokens``
(the processor's ``image_token``, ``video_token``: the tokenizer's placeholders), a LLaVA
family's exporter also writes the processor's processor_config.json, which transformers 5's
``AutoProcessor`` reads (``write_processor_config``).
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

import torch
from torch import nn

from omni.models.encoders.llava_projector import LLAVA_ACTIVATIONS, llava_projector_names
from omni.models.hf_io import native_state_dict_to_hf, write_safetensors
from omni.models.multimodal import OmniModel

# The ids a VLM's config classes keep in ``text_config`` (the language model's), not at the top.
TEXT_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def export_anyres(model: OmniModel, enc: Any, path: str, config_cls: type, architecture: str, tower_prefix: str,
                   ids: dict, max_shard_bytes: Optional[int]) -> None:
    """The weights and config.json of a LLaVA family with an anyres layout (NeXT, OneVision):
    the tower under ``tower_prefix``, LLaVA's MLP and the image newline, the language model; the
    layout's fields from the tower (``hf_layout_config``); ``ids``: the config's token ids
    (``TEXT_IDS`` among them go in ``text_config``)."""
    llm = model.llm.config
    if llm.mrope_section is not None:
        raise ValueError(f"a {architecture} checkpoint's language model has 1-D RoPE; this backbone rotates by M-RoPE "
                         f"(mrope_section={llm.mrope_section})")
    proj = model.projectors["image"]
    act = llava_projector_act(proj, enc.output_dim, llm.hidden_size)
    top, text_ids = split_ids(ids)
    config = config_cls(
        text_config={**llm.to_hf(text_of_vlm=True), **text_ids}, vision_config=enc.hf_vision_config(),
        projector_hidden_act=act, multimodal_projector_bias=True, tie_word_embeddings=llm.tie_word_embeddings, **top,
        **enc.hf_layout_config())
    sd = {tower_prefix + enc.hf_name(name): enc.to_hf_tensor(name, t) for name, t in enc.state_dict().items()}
    names = {**llava_projector_names("multi_modal_projector."), "image_newline": "image_newline"}
    sd.update({names[name]: t for name, t in proj.state_dict().items()})
    sd.update(language_model(model, "language_model.model.", "language_model.lm_head.weight"))
    write_checkpoint(config, architecture, sd, path, max_shard_bytes)
    # The processor's settings are the tower's input contract: the caller writes them beside it.


def split_ids(token_ids: Mapping[str, Any]) -> tuple[dict, dict]:
    """``token_ids`` as (the config's top-level fields, ``text_config``'s: ``TEXT_IDS``)."""
    return ({k: v for k, v in token_ids.items() if k not in TEXT_IDS},
            {k: v for k, v in token_ids.items() if k in TEXT_IDS})


def write_processor_config(path: str, processor: str, image_processor: Any, **settings: Any) -> None:
    """processor_config.json as transformers 5's ``processor.save_pretrained`` writes it (its
    ``to_json_string``): the processor's own settings, its ``__init__`` arguments (how many
    placeholders an image becomes: without them its first call fails), and the image
    processor's, nested. Written here, not by the processor class: LLaVA-OneVision's cannot be
    built without its video processor, which needs torchvision; the tokenizer (and its chat
    template) ``omni export`` writes itself."""
    config = {"processor_class": processor, "image_processor": json.loads(image_processor.to_json_string()), **settings}
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_class_token_processor_config(path: str, processor: str, image_processor: Any,
                                       processor_tokens: Mapping[str, str], config: Any) -> None:
    """``write_processor_config`` for a CLIP tower's processor (``config``: the tower's): its
    class token is one token more than its patches, which the processor counts."""
    write_processor_config(path, processor, image_processor, **processor_tokens, patch_size=config.patch_size,
                           num_additional_image_tokens=1,
                           vision_feature_select_strategy=config.vision_feature_select_strategy)


def llava_projector_act(proj: nn.Module, in_dim: int, width: int) -> str:
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


def only_image_encoder(model: OmniModel, cls: type, fn: str, plugin: str, what: str) -> Any:
    """The model's image encoder, refused unless it is a ``cls`` and the only encoder."""
    enc = model.encoders["image"] if "image" in model.encoders else None
    if not isinstance(enc, cls):
        raise ValueError(f"{fn} needs the {plugin} image encoder (encoders.vision.name={plugin})")
    if set(model.encoders) != {"image"}:
        raise ValueError(f"{what} checkpoint holds an image encoder only; this model also has "
                         f"{sorted(set(model.encoders) - {'image'})}")
    return enc


def language_model(model: OmniModel, prefix: str, head: str, experts: str = "per_expert") -> dict[str, torch.Tensor]:
    """The backbone's tensors under the checkpoint's names: ``prefix`` for the decoder (in place
    of a causal LM's ``model.``), ``head`` for an untied LM head, MoE experts in the ``experts``
    layout (``hf_io.EXPERT_LAYOUTS``)."""
    out = {}
    for name, t in native_state_dict_to_hf(model.llm.state_dict(), model.llm.config, experts=experts).items():
        out[head if name == "lm_head.weight" else prefix + name[len("model."):]] = t
    return out


def write_checkpoint(config: Any, architecture: str, sd: dict[str, torch.Tensor], path: str,
           max_shard_bytes: Optional[int]) -> None:
    config.architectures = [architecture]
    os.makedirs(path, exist_ok=True)
    config.dtype = str(next(iter(sd.values())).dtype).replace("torch.", "")
    config.save_pretrained(path)
    write_safetensors(sd, path, max_shard_bytes)
