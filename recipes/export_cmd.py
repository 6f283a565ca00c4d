"""``omni export``: a run's checkpoint (any layout) or a Hugging Face directory -> a Hugging Face
directory in the model family's own class (``omni.models.families``: the model and its image
processor's config), with the tokenizer the run trained with (its chat template included)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from omni.errors import ConfigError

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def export_main(model: str, out: str, step: Optional[int] = None, dtype: Optional[str] = None,
                force: bool = False, progress: bool = True) -> int:
    import torch
    from tqdm import tqdm

    from omni.models.families import family_of_model
    from recipes.model_source import load_model, locate

    if dtype is not None and dtype not in _DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(sorted(set(_DTYPES)))}")
    target = Path(out).expanduser()
    if target.exists() and any(target.iterdir()) and not force:
        raise ConfigError(f"--out {out} exists and is not empty; choose a new folder or pass --force")
    where = locate(model, step)  # a wrong --model or --step fails here, before the progress bar
    stages = ["read the weights", "check the family", "write the model", "write tokenizer and processor"]
    bar = tqdm(total=len(stages), desc="omni export", unit="stage", disable=not progress, file=sys.stderr)
    bar.set_postfix_str(stages[0])
    loaded = load_model(where)
    bar.update()
    bar.set_postfix_str(stages[1])
    name, family = family_of_model(loaded.model)
    if dtype is not None:
        loaded.model.to(getattr(torch, _DTYPES[dtype]))
    bar.update()
    bar.set_postfix_str(stages[2])
    target.mkdir(parents=True, exist_ok=True)
    family.export(loaded.model, str(target), loaded.tokenizer)
    bar.update()
    bar.set_postfix_str(stages[3])
    loaded.tokenizer.save(target)
    if hasattr(loaded.tokenizer, "save_hf"):  # Omni's byte tokenizer: also as transformers files
        loaded.tokenizer.save_hf(target)
    bar.update()
    bar.close()
    print(f"omni: exported {loaded.weights} as {name} to {target}", flush=True)
    return 0
