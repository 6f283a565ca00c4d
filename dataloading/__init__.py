"""Omni's data plane: metadata index -> planner (central state) -> constructors -> batches.

Never imports ``omni``, ``parallel`` or ``torch.distributed``: it must run in plain worker
processes. Its sub-packages run one way, each importing only those before it (checked by
tests/test_import_graph.py): ``formats`` (sample schema, media kinds, chat, tokenizer) -> ``index``
(sources, shards, metadata index) -> ``convert`` (``omni data convert``) -> ``plan`` (mixture,
cost, balance, planner) -> ``construct`` (constructors, batches, held-out sets) -> ``serve``
(inline and Ray loaders); ``errors``, ``config`` and ``processes`` sit below them all, ``demo``
above. The public names are re-exported here lazily so ``import dataloading`` stays cheap (PIL,
soundfile, webdataset and wids load only when used).
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "IGNORE_INDEX": "construct.batch", "MediaInputs": "construct.batch", "MicroBatch": "construct.batch",
    "StepBatch": "construct.batch",
    "MediaItem": "formats.media", "MediaProcessor": "formats.media", "MODALITY_EXTENSIONS": "formats.media",
    "PLACEHOLDERS": "formats.media", "MODALITIES": "formats.modality", "Modality": "formats.modality",
    "DataError": "errors", "ProblemCounter": "errors",
    "Tokenizer": "formats.tokenizer", "ByteTokenizer": "formats.tokenizer", "HFTokenizer": "formats.tokenizer",
    "load_tokenizer": "formats.tokenizer",
    "SampleMeta": "index.source_index", "SourceIndex": "index.source_index", "build_index": "index.source_index",
    "load_index": "index.source_index",
    "SourceReader": "index.shards", "write_shards": "index.shards",
    "Mixture": "plan.mixture", "SourceSpec": "plan.mixture", "load_mixture": "plan.mixture",
    "Planner": "plan.planner", "estimate_tokens": "plan.sample_length",
    "SampleConstructor": "construct.constructor", "dummy_micro_batch": "construct.constructor",
    "EvalSet": "construct.held_out",
    "StepLoader": "serve.loader", "build_loader": "serve.loader", "RayStepLoader": "serve.ray_backend",
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
