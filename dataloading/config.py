"""Data knobs (the ``data`` config group)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class DataConfig:
    # Mixture YAML (see docs/data.md). None: the demo dataset, generated on first use.
    mixture: Optional[str] = None
    # Held-out evaluation folder of shards with `response.txt` targets. None: the demo's eval split.
    eval_dir: Optional[str] = None
    # Samples per optimizer step, over all data-parallel ranks.
    global_batch_size: int = 16
    # Packing budget: tokens (text + media placeholders) per micro-batch row.
    micro_batch_tokens: int = 1024
    # "byte" (ships with Omni) or a local Hugging Face tokenizer directory.
    tokenizer: str = "byte"
    # Steps built ahead of the trainer by a background thread.
    prefetch: int = 2
    # What to do with a bad sample (corrupt media, placeholder mismatch): "skip" or "stop".
    on_error: str = "skip"
    # Skipping more than this fraction of samples stops the run.
    max_skip_fraction: float = 0.01
    # Demo dataset size multiplier (only used when `mixture` is None).
    demo_scale: float = 1.0
