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
    # The chat template conversations (messages.json samples) are rendered with. None: the
    # tokenizer's own; or a built-in name ("plain": text markers, for a tokenizer without one,
    # e.g. "byte"), a .jinja file, or the Jinja template itself. Saved with the run's tokenizer.
    chat_template: Optional[str] = None
    # Constructor worker processes (fetch, decode, tokenize, pack); 0 builds in the training process.
    num_workers: int = 1
    # Steps each worker builds ahead of the trainer.
    prefetch: int = 2
    # Stop (naming the sample a worker is on) if no step arrives for this long; 0: wait forever.
    worker_timeout_s: float = 600.0
    # Shards each constructor keeps open, over all sources (each holds 2 file descriptors).
    max_open_shards: int = 256
    # How a step's samples are arranged over DP ranks and micro-batches (dataloading/plan/balance.py):
    # balanced (LPT or Karmarkar-Karp + refinement on the cost model), lpt, kk, sorted_greedy, packed
    # (ranks in plain order, micro-batches packed largest first: Megatron-Energon style), none.
    balance: str = "balanced"
    # DP ranks balanced together (0: all). Smaller groups plan faster, balance slightly worse.
    balance_group: int = 0
    # A sample longer than micro_batch_tokens: error, truncate, split (pieces of the budget), skip.
    # A mixture source may override it (`over_budget:`).
    over_budget: str = "error"
    # Cost model file from `omni data calibrate`; None: FLOP-based defaults from the model config.
    cost_file: Optional[str] = None
    # inline (planner in the training job, constructors in worker processes) or ray (actors).
    backend: str = "inline"
    # backend=ray: the cluster to join (None: a running local Ray, else one started here).
    ray_address: Optional[str] = None
    # backend=ray, a Ray started here: the address it listens on. "127.0.0.1": this machine only.
    # For actors on other nodes: this host's IP on their network, or "0.0.0.0" (Ray's choice: the
    # host's routable address, all interfaces). Not used when joining a cluster (ray_address).
    ray_bind: str = "127.0.0.1"
    # What to do with a bad sample (corrupt media, placeholder mismatch): "skip" or "stop".
    on_error: str = "skip"
    # Skipping more than this fraction of samples stops the run.
    max_skip_fraction: float = 0.01
    # Demo dataset size multiplier (only used when `mixture` is None).
    demo_scale: float = 1.0
    # Which of the demo's mixtures (only used when `mixture` is None): "mixture" (shapes, tones,
    # text) or "vision" (shapes and text, for a model without an audio encoder).
    demo_mixture: str = "mixture"
