"""What a simulated workload assumes, said once: the encoder settings it brings
(``data.encoder_params``: applied where the chosen tower has them, one line each where it has
not) and the figures the reports' headers print (global batch, row length, sample lengths, the
media items per sample and their sizes in the tower's own terms)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from omni.errors import ConfigError
from omni.sim.work import StepWork, step_media_share


def command_line_keys(overrides: list[str]) -> set[str]:
    """The config keys a list of Hydra overrides sets (``+key=v``, ``++key=v`` and ``key=v``)."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}


def apply_encoder_params(cfg, overrides: list[str]) -> list[str]:
    """``data.encoder_params`` into the encoder slots' params: a value goes where the slot's
    tower has the param and the command line leaves it alone (the workload's value wins over the
    tower preset's, as the workload's other settings do; the user's over both). Returns one line
    per value skipped (no such slot, or a tower without the param: it sizes the workload's media
    in its own terms, ``EncoderAnchor.simulated_item``)."""
    from omni.models.encoders.registry import get_encoder_class

    given = command_line_keys(overrides)
    notes = []
    for slot, params in cfg.data.encoder_params.items():
        if slot not in cfg.encoders:
            notes.append(f"data.encoder_params.{slot} skipped: the model has no encoders.{slot}")
            continue
        s = cfg.encoders[slot]
        try:
            cls = get_encoder_class(s._target_ or s.name)
        except ValueError as exc:
            raise ConfigError(f"encoders.{slot}: {exc}") from None
        names = {f.name for f in dataclasses.fields(cls.Config)}
        for key, value in params.items():
            if key not in names:
                notes.append(f"{cfg.name}'s encoders.{slot}.params.{key}={value} skipped: {cls.__name__} has no "
                             f"{key}; the workload's {slot} media are sized in the tower's own terms")
            elif f"encoders.{slot}.params.{key}" not in given:
                s.params[key] = value
    return notes


def describe_workload(cfg, steps: list[StepWork]) -> dict[str, Any]:
    """The drawn steps' workload as the header prints it: the configured batch and lengths, and
    what the steps hold (means over the steps); per modality the items' encoder tokens and LLM
    rows (min, mean, max), which are the tower's own (anyres tiles, a fixed square, a budget)."""
    d = cfg.data
    out: dict[str, Any] = {
        "source": d.source, "global_batch_size": d.global_batch_size, "micro_batch_tokens": d.micro_batch_tokens,
        "sample_tokens": d.sample_tokens, "sample_tokens_sigma": d.sample_tokens_sigma,
        "media_text_tokens": d.media_text_tokens,
        "image_ratio": d.image_ratio if d.image_ratio_schedule is None else None,
        "media_share": float(np.mean([step_media_share(s) for s in steps])) if steps else 0.0,
        "tokens_per_step": float(np.mean([s.tokens() for s in steps])) if steps else 0.0,
        "samples": float(np.mean([s.samples for s in steps])) if steps else 0.0,
        "media_samples": float(np.mean([s.media_samples for s in steps])) if steps else 0.0,
        "media": {}}
    items = [it for s in steps for it in s.media()]
    media_samples = sum(s.media_samples for s in steps)
    out["items_per_media_sample"] = len(items) / media_samples if media_samples else 0.0
    for modality in sorted({m for m, _, _ in items}):
        tokens = np.asarray([n for m, n, _ in items if m == modality])
        rows = np.asarray([r for m, _, r in items if m == modality])
        out["media"][modality] = {
            "items_per_step": len(tokens) / len(steps),
            "tokens": [int(tokens.min()), float(tokens.mean()), int(tokens.max())],
            "rows": [int(rows.min()), float(rows.mean()), int(rows.max())]}
    return out


def workload_lines(w: dict[str, Any]) -> list[str]:
    """The header's lines for ``describe_workload``'s figures and the skipped settings."""
    if w["source"] == "mixture":
        lengths = "samples from data.mixture"
    else:
        lengths = (f"text-only samples ~{w['sample_tokens']} tokens (sigma {w['sample_tokens_sigma']}), "
                   f"~{w['media_text_tokens']} text tokens around media")
    ratio = "" if w["image_ratio"] is None else f"image ratio {w['image_ratio']:g}, "
    lines = [f"workload: global batch {w['global_batch_size']} samples in rows of {w['micro_batch_tokens']} tokens; "
             f"{lengths}; {ratio}media {100 * w['media_share']:.0f}% of {w['tokens_per_step'] / 1e6:.2f}M LLM tokens "
             f"per step"]
    if w["media"]:
        per = "; ".join(f"{m} {v['items_per_step']:.0f} items per step of {_span(v['tokens'])} encoder tokens "
                        f"-> {_span(v['rows'])} LLM rows" for m, v in w["media"].items())
        lines.append(f"media: {w['media_samples']:.0f} of {w['samples']:.0f} samples, "
                     f"{w['items_per_media_sample']:.1f} items each; {per}")
    lines += [f"note: {n}" for n in w.get("notes", [])]
    return lines


def _span(v: list) -> str:
    lo, mean, hi = v
    return f"{lo}" if lo == hi else f"{lo}-{hi} (mean {mean:.0f})"
