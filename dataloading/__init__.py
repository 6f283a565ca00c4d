"""Omni's data plane: metadata index -> planner (central state) -> constructors -> batches.

Never imports ``omni``, ``parallel`` or ``torch.distributed``: it must run in plain worker
processes. Names are re-exported lazily so ``import dataloading`` stays cheap (PIL,
soundfile, webdataset and wids load only when used).
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "IGNORE_INDEX": "batch", "MediaInputs": "batch", "MicroBatch": "batch", "StepBatch": "batch",
    "MediaItem": "media", "MediaProcessor": "media", "MODALITY_EXTENSIONS": "media", "PLACEHOLDERS": "media",
    "DataError": "errors", "ProblemCounter": "errors",
    "Tokenizer": "tokenizer", "ByteTokenizer": "tokenizer", "HFTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "SampleMeta": "index", "SourceIndex": "index", "build_index": "index", "load_index": "index",
    "SourceReader": "shards", "write_shards": "shards",
    "Mixture": "mixture", "SourceSpec": "mixture", "load_mixture": "mixture",
    "Planner": "planner", "estimate_tokens": "planner",
    "SampleConstructor": "constructor", "EvalSet": "constructor", "dummy_micro_batch": "constructor",
    "StepLoader": "loader", "build_loader": "loader", "RayStepLoader": "ray_backend",
    "write_demo_dataset": "demo", "ensure_demo_dataset": "demo",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dataloading' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dataloading.{module}"), name)
    globals()[name] = value
    return value
