"""Which model a checkpoint holds: every parameter's name, global shape and dtype, hashed, with
a short readable summary (parameter count, vocabulary and hidden size, layers, experts,
encoders). Resume compares it with the model the config builds before any weight is read.

Only names, shapes and dtypes enter, never values: it is the same for a model on the meta
device, and for DTensor / FSDP-sharded parameters (a DTensor's shape is the global one). The
names are the unsplit model's (those the checkpoint is saved under), so every layout of one
model gives the same fingerprint; a rank contributes the parameters it holds and the union of
all ranks' is the full model (``merge``).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Iterable

from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

Entries = dict[str, tuple[list[int], str]]  # name -> (global shape, dtype)

_LAYER = re.compile(r"^llm\.layers\.(\d+)\.")
_ENCODER = re.compile(r"^encoders\.([^.]+)\.")


def local_entries(parts: Iterable[nn.Module]) -> Entries:
    """The state-dict entries of the parts this rank holds, under the names the checkpoint uses."""
    out: Entries = {}
    for part in parts:
        for name, t in get_model_state_dict(part).items():
            out[name] = (list(t.shape), str(t.dtype).removeprefix("torch."))
    return out


def merge(per_rank: Iterable[Entries]) -> Entries:
    """The full model's entries from every rank's (replicas and tied copies hold the same names)."""
    out: Entries = {}
    for entries in per_rank:
        out.update(entries)
    return out


def fingerprint(entries: Entries) -> dict:
    """``{"sha256": ..., "summary": {...}}`` of the model described by ``entries``."""
    canonical = json.dumps(sorted([name, list(shape), dtype] for name, (shape, dtype) in entries.items()),
                           separators=(",", ":"))
    return {"sha256": hashlib.sha256(canonical.encode()).hexdigest(), "summary": summarise(entries)}


def summarise(entries: Entries) -> dict:
    summary: dict = {"parameters": sum(math.prod(shape) for shape, _ in entries.values())}
    embed = entries.get("llm.embed_tokens.weight") or entries.get("llm.lm_head.weight")
    if embed is not None and len(embed[0]) == 2:
        summary["vocab"], summary["hidden"] = embed[0]
    summary["layers"] = len({m.group(1) for m in map(_LAYER.match, entries) if m})
    experts = [shape[0] for name, (shape, _) in entries.items() if ".mlp.experts." in name and shape]
    if experts:
        summary["experts"] = max(experts)
    summary["encoders"] = sorted({m.group(1) for m in map(_ENCODER.match, entries) if m})
    summary["dtypes"] = sorted({dtype for _, dtype in entries.values()})
    return summary


def describe(fp: dict) -> str:
    """e.g. "1.30M parameters: vocab 272, hidden 128, 4 layers, encoders audio+image, float32"."""
    s = fp.get("summary", {})
    n = int(s.get("parameters", 0))
    text = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e4 else str(n)
    parts = [f"vocab {s['vocab']}", f"hidden {s['hidden']}"] if "vocab" in s else []
    parts.append(f"{s.get('layers', 0)} layers")
    if s.get("experts"):
        parts.append(f"{s['experts']} experts")
    parts.append("encoders " + "+".join(s["encoders"]) if s.get("encoders") else "no encoders")
    parts.append("/".join(s.get("dtypes", [])) or "no dtype")
    return f"{text} parameters: " + ", ".join(parts)
