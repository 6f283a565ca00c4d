"""Write a multimodal model back as a Hugging Face vision-language checkpoint directory.

``export_qwen_vl``: a model whose image encoder is the ``qwen_vl`` tower, whose image projector
is its patch merger and whose backbone is a Qwen2 with M-RoPE becomes a Qwen2-VL or
Qwen2.5-VL directory (config.json and safetensors, the names and shapes transformers saves),
which ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` (and
``AutoModelForImageTextToText``) load, and which Omni loads back bit-exactly
(``model.pretrained`` plus the ``qwen_vl`` slot's ``pretrained``). The config is written by
transformers' own config classes, so every field a reader expects is there.
"""
from __future__ import annotations

import os
from typing import Optional

from torch import nn

from omni.models.encoders.qwen_vl import QwenVisionEncoder, merger_names
from omni.models.hf_io import native_state_dict_to_hf, write_safetensors
from omni.models.multimodal import OmniModel

_CLASSES = {"qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
            "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration")}


def export_qwen_vl(model: OmniModel, path: str, image_token_id: int, max_shard_bytes: Optional[int] = None) -> None:
    """Write ``model`` (host tensors) to ``path`` as a Qwen2-VL / Qwen2.5-VL checkpoint.
    ``image_token_id``: the tokenizer's image placeholder (config.json's ``image_token_id``).
    Refused, naming the part, for a model that is not one: another image encoder, a projector
    that is not the tower's merger, a backbone without M-RoPE, other modalities."""
    import transformers

    enc = model.encoders["image"] if "image" in model.encoders else None
    if not isinstance(enc, QwenVisionEncoder):
        raise ValueError("export_qwen_vl needs the qwen_vl image encoder (encoders.vision.name=qwen_vl)")
    if set(model.encoders) != {"image"}:
        raise ValueError(f"a Qwen2-VL checkpoint holds an image encoder only; this model also has "
                         f"{sorted(set(model.encoders) - {'image'})}")
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
    text = llm.to_hf(text_of_vlm=True)
    text["model_type"] = f"{variant}_text"
    config = config_cls(text_config=text, vision_config=enc.hf_vision_config(llm.hidden_size),
                        image_token_id=int(image_token_id), tie_word_embeddings=llm.tie_word_embeddings)
    config.architectures = [model_cls.__name__]
    sd = {}
    for name, t in enc.state_dict().items():
        sd["model.visual." + enc.hf_name(name)] = enc.to_hf_tensor(name, t)
    merger = merger_names(variant, "model.visual.")
    sd.update({merger[name]: t for name, t in proj.state_dict().items()})
    for name, t in native_state_dict_to_hf(model.llm.state_dict(), llm).items():
        sd[name if name == "lm_head.weight" else "model.language_model." + name[len("model."):]] = t
    os.makedirs(path, exist_ok=True)
    config.dtype = str(next(iter(sd.values())).dtype).replace("torch.", "")
    config.save_pretrained(path)
    write_safetensors(sd, path, max_shard_bytes)
