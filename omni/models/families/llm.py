"""The LLM-only families (``omni.models.llm.config.FAMILIES``: Llama, Qwen2, Mixtral,
Qwen2-MoE): a causal LM directory, which ``hf_io`` reads and writes (its decoder key maps
serve every family's language model, the vision-language ones' too).
"""
from __future__ import annotations

import json
import os
from typing import Any

from dataloading.formats.tokenizer import Tokenizer
from omni.models.families.family import Family, config_ids
from omni.models.hf_io import export_pretrained
from omni.models.llm.config import FAMILIES as LLM_FAMILIES
from omni.models.multimodal import OmniModel


def _export_llm(model: OmniModel, path: str, tokenizer: Tokenizer, vocab: Any) -> None:
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


FAMILIES: dict[str, Family] = {t: Family(export=_export_llm, matches=_is_llm) for t in LLM_FAMILIES}
