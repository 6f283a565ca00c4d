"""Exact text-token counts of a source's conversations, for planning.

A prompt-and-response sample's length is estimated from its byte counts in the index (exact for
the byte tokenizer). A conversation's is not a function of its bytes: the chat template adds
its own markers, system prompt and end-of-turn tokens, different for every tokenizer. So its
rendered text is counted here, once per (source index, tokenizer), by the same code that builds
the sample (``dataloading.formats.sample.text_segments``), and kept beside the index in
``omni_tokens.<digest>.json``; a changed index or tokenizer gives another digest, so a stale
count is never read.

The count is of text tokens, every media placeholder id counted once: the planner adds each
item's encoder tokens from the index, as for any sample.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dataloading.errors import DataError
from dataloading.plan.mixture import SourceOptions
from dataloading.processes import imap_in_workers

COUNTS_PREFIX = "omni_tokens."


def _index_path(index) -> Path:
    from dataloading.index.sources import INDEX_NAME

    return index.source.index_path if index.source is not None else Path(index.folder) / INDEX_NAME


def _cache_path(index, tokenizer) -> Path:
    path = _index_path(index)
    fingerprint = getattr(tokenizer, "fingerprint", None)
    if fingerprint is None:
        raise DataError(f"tokenizer {tokenizer!r} has no `fingerprint`, which counting conversations needs; "
                        "add a property that changes whenever its ids would", kind="config")
    digest = hashlib.sha256(json.dumps([index.header, fingerprint], sort_keys=True).encode()).hexdigest()[:16]
    return path.with_name(f"{COUNTS_PREFIX}{digest}.json")


def count_text_tokens(tokenizer, options: SourceOptions, sample_id: str, fields: dict) -> int:
    """Text tokens of one sample as the constructor builds it: BOS and EOS included, media
    placeholder ids not (each becomes its item's encoder tokens, which the planner adds)."""
    from dataloading.formats.media import as_encoder_placeholders
    from dataloading.formats.sample import DecodedSample, parse_fields, text_segments

    raw = parse_fields(sample_id, fields)
    sample = DecodedSample(sample_id, raw.text, raw.response, [], raw.meta, raw.messages)
    pieces, eos = text_segments(tokenizer, sample, options)
    placeholders = set(tokenizer.placeholder_ids.values())
    n = (tokenizer.bos_id is not None) + int(eos)
    for text, _ in pieces:
        n += sum(1 for t in tokenizer.encode(as_encoder_placeholders(text)) if t not in placeholders)
    return n


# A counting worker's tokenizer, source options and reader: set once per forked worker by
# ``_init`` (a process-local of the pool's own processes, not state of the caller's).
_worker: dict = {}


def _init(tokenizer, options: SourceOptions, reader, name: str) -> None:
    _worker.update(tokenizer=tokenizer, options=options, reader=reader, name=name)


def _count_keys(keys: list[str]) -> list[tuple[str, int | None]]:
    tok, options, reader, name = _worker["tokenizer"], _worker["options"], _worker["reader"], _worker["name"]
    out = []
    for key in keys:
        try:
            out.append((key, count_text_tokens(tok, options, f"{name}/{key}", reader.get(key))))
        except DataError as e:
            if e.kind == "config":
                raise
            out.append((key, None))  # the sample fails when built too; the planner keeps its estimate
    return out


def chat_token_counts(name: str, index, tokenizer, options: SourceOptions | None = None, workers: int | None = None,
                      progress: bool = True) -> dict[str, int]:
    """key -> exact text tokens of every conversation of ``index`` (a SourceIndex), read from
    the cache beside the index or counted (in worker processes, behind a progress bar) and
    cached."""
    from tqdm import tqdm

    keys = [m.key for m in index.samples if m.chat]
    if not keys:
        return {}
    cache = _cache_path(index, tokenizer)
    if cache.is_file():
        try:
            return {k: int(v) for k, v in json.loads(cache.read_text()).items()}
        except (ValueError, AttributeError):
            pass  # unreadable (an interrupted write cannot be: writes are atomic); count again
    reader = index.reader(name)
    by_shard: dict[str, list[str]] = {}
    for m in index.samples:
        if m.chat:
            by_shard.setdefault(m.shard, []).append(m.key)
    jobs = list(by_shard.values())
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    counts: dict[str, int] = {}
    bar = tqdm(total=len(keys), desc=f"count conversation tokens {name}", unit="sample", disable=not progress)
    try:
        init_args = (tokenizer, options or SourceOptions(), reader, name)
        for res in imap_in_workers(_count_keys, jobs, workers, _init, init_args):
            counts.update((k, n) for k, n in res if n is not None)
            bar.update(len(res))
    finally:
        bar.close()
        reader.close()
    tmp = cache.with_name(f".{cache.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(counts))
        os.replace(tmp, cache)  # atomic: ranks counting at once each write a whole file
    except OSError:
        pass  # a read-only dataset folder: counted again next time
    return counts
