"""``omni export``: a run's checkpoint (any layout) or a Hugging Face directory -> a Hugging Face
directory in the model family's own class (``omni.models.families``: the model and its image
processor's config), with the tokenizer the run trained with (its chat template included), whose
ids the config names, and a generation_config.json that stops where ``omni generate`` stops.
A run trained with LoRA is written with its adapters merged, or (``--adapter``) without them
plus a peft adapter folder ``OUT/adapter``."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from omni.errors import ConfigError

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def export_main(model: str, out: str, step: Optional[int] = None, dtype: Optional[str] = None,
                force: bool = False, progress: bool = True, adapter: bool = False) -> int:
    """``adapter``: for a run trained with LoRA, write the model without its adapters merged
    and the adapters as a peft adapter folder in ``OUT/adapter`` (default: merged)."""
    import torch
    from tqdm import tqdm

    from omni.models.families import exported_tokenizer, family_of_model, write_generation_config
    from recipes.generate_cmd import eos_ids
    from recipes.model_source import load_model, locate

    if dtype is not None and dtype not in _DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(sorted(set(_DTYPES)))}")
    target = Path(out).expanduser()
    if target.exists() and any(target.iterdir()) and not force:
        raise ConfigError(f"--out {out} exists and is not empty; choose a new folder or pass --force")
    where = locate(model, step)  # a wrong --model or --step fails here, before the progress bar
    if adapter:
        _check_adapter_export(model, where)
    stages = ["read the weights", "check the family", "write the tokenizer", "write the model and its configs"]
    bar = tqdm(total=len(stages), desc="omni export", unit="stage", disable=not progress, file=sys.stderr)
    try:  # a refusal on the way prints on its own line, after the bar
        bar.set_postfix_str(stages[0])
        loaded = load_model(where, merge_adapters=not adapter)
        bar.update()
        bar.set_postfix_str(stages[1])
        name, family = family_of_model(loaded.model)
        if family.export is None:
            raise ConfigError(f"the {name} family loads, trains and generates, but Omni cannot write it back yet; "
                              f"omni export has no exporter for it")
        if dtype is not None:
            loaded.model.to(getattr(torch, _DTYPES[dtype]))
        bar.update()
        bar.set_postfix_str(stages[2])
        target.mkdir(parents=True, exist_ok=True)
        # The tokenizer first: the config names its ids, the processor config is built with it.
        loaded.tokenizer.save(target)
        if hasattr(loaded.tokenizer, "save_hf"):  # Omni's byte tokenizer: also as transformers files
            loaded.tokenizer.save_hf(target)
        vocab = exported_tokenizer(str(target))
        bar.update()
        bar.set_postfix_str(stages[3])
        adapters = {}
        if adapter:
            from omni.models import lora

            adapters = lora.adapter_tensors(loaded.model)
            lora.unload(loaded.model)  # the base model, written as the family's class
        family.export(loaded.model, str(target), loaded.tokenizer, vocab)
        write_generation_config(str(target), vocab, eos_ids(loaded))
        if adapter:
            lora.write_peft_adapter(adapters, loaded.cfg.model.lora, target, target / "adapter")
        bar.update()
    finally:
        bar.close()
    also = f", its LoRA adapter to {target / 'adapter'}" if adapter else ""
    print(f"omni: exported {loaded.weights} as {name} to {target}{also}", flush=True)
    return 0


def _check_adapter_export(model: str, where) -> None:
    """``--adapter`` is for a run whose LLM alone was trained with LoRA: one line otherwise."""
    from recipes.model_source import run_config

    if where.run is None:
        raise ConfigError(f"--adapter: {model} is a Hugging Face directory, not a run trained with LoRA")
    cfg = run_config(where.run).model.lora
    if cfg.rank == 0:
        raise ConfigError(f"--adapter: the run {where.run} was trained without LoRA (model.lora.rank=0); "
                          "export it without --adapter")
    if list(cfg.modules) != ["llm"]:
        raise ConfigError(f"--adapter writes the LLM's adapters; the run {where.run} also adapts "
                          f"model.lora.modules={list(cfg.modules)}: export it merged (without --adapter)")
