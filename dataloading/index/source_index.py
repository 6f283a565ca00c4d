"""The metadata index of a source's shards, so planning never opens a tar.

A source is a folder, a glob, a brace list or a URL (``dataloading.index.sources``). The index of a
folder is ``FOLDER/omni_index.jsonl``; of a glob or list ``BASE/omni_index.<hash>.jsonl``; of
a URL ``$OMNI_CACHE/index/<hash>/omni_index.jsonl``. Line 1 is a header (format
version, every shard's size and sample count, problems met), then one JSON object per
sample::

    {"key": "000123", "shard": "shapes-000000.tar", "pos": 123, "text_bytes": 27,
     "response_bytes": 28, "media": [["image", {"height": 48, "width": 64}]]}

``response_bytes`` is null when the sample has no ``response.txt``. A conversation
(``messages.json``) has ``"chat": 1``, its turns' contents in ``text_bytes`` and its last answer
in ``response_bytes``; its rendered length depends on the tokenizer's chat template, so
planning counts it exactly per tokenizer (``dataloading.plan.token_counts``). Media metadata is read
from file headers only (PIL / soundfile / PyAV), never by decoding pixels, samples or frames;
a video's is ``{"width", "height", "frames", "fps", "duration"}`` (``dataloading.formats.video``).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dataloading.errors import ON_ERROR_POLICIES, DataError
from dataloading.formats.chat import last_answer
from dataloading.formats.sample import parse_fields, read_meta
from dataloading.index.shards import Shard, SourceReader
from dataloading.index.sources import INDEX_NAME, ShardSet, resolve_source
from dataloading.processes import imap_in_workers

log = logging.getLogger("omni.data")

INDEX_FORMAT, INDEX_VERSION = "omni-index", 1


@dataclass(slots=True)
class SampleMeta:
    key: str
    shard: str  # shard name relative to the source's base folder or URL
    pos: int  # position of the sample in its shard
    text_bytes: int
    response_bytes: int | None  # None: no response.txt (language modelling sample)
    media: list[tuple[str, dict]]  # (modality, header metadata), placeholder order
    chat: bool = False  # a conversation (messages.json)


class KeyLocator:
    """key -> (shard, position in the shard) for one source, in a few flat arrays.

    A dict of tuples costs ~150 bytes per sample in every rank and DataLoader worker (and
    reference counting dirties its pages in forked workers); sorted key bytes plus two int32
    columns cost the key's length + 8 bytes, stay shared after a fork, and answer with one
    binary search.
    """

    def __init__(self, keys: list[str], shards: list[str], positions: list[int]):
        names = sorted(set(shards))
        shard_id = {n: i for i, n in enumerate(names)}
        encoded = np.array([k.encode("utf-8") for k in keys], dtype=bytes)
        order = np.argsort(encoded, kind="stable")
        self._keys = encoded[order]
        self._shard = np.array([shard_id[s] for s in shards], dtype=np.int32)[order]
        self._pos = np.array(positions, dtype=np.int32)[order]
        self._names = names

    def _find(self, key: str) -> int:
        k = key.encode("utf-8")
        i = int(np.searchsorted(self._keys, k))
        if i == len(self._keys) or self._keys[i] != k:
            raise KeyError(key)
        return i

    def __getitem__(self, key: str) -> tuple[str, int]:
        i = self._find(key)
        return self._names[self._shard[i]], int(self._pos[i])

    def __contains__(self, key: object) -> bool:
        try:
            self._find(str(key))
        except KeyError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self):
        return (k.decode("utf-8") for k in self._keys)


class SourceIndex:
    """The samples of one indexed source (one mixture source, or an eval folder).

    ``folder`` may be a plain folder or a ``ShardSet``; ``self.folder`` names the source in
    messages (the folder, or the spec of a glob, list or URL source).
    """

    def __init__(self, folder: str | Path | ShardSet, samples: list[SampleMeta], header: dict | None = None):
        self.source = folder if isinstance(folder, ShardSet) else None
        self.folder: Path | str = Path(folder) if self.source is None else \
            (self.source.target if self.source.remote or self.source.pattern else Path(self.source.base))
        self.samples = samples
        self.header = header or {}
        self._locate: KeyLocator | None = None
        self._released: int | None = None

    @property
    def problems(self) -> dict[str, int]:
        return dict(self.header.get("problems", {}))

    @property
    def bad_shards(self) -> dict[str, str]:
        return dict(self.header.get("bad_shards", {}))

    def __len__(self) -> int:
        return len(self.samples) if self.samples or self._released is None else self._released

    def release_samples(self) -> None:
        """Keep the key locator, the header and the count; free the per-sample objects (the
        planner has made its compact table of them)."""
        self.locate  # noqa: B018 - build it while the samples are here
        self._released = len(self.samples)
        self.samples = []

    def __getitem__(self, i: int) -> SampleMeta:
        return self.samples[i]

    @property
    def locate(self) -> KeyLocator:
        if self._locate is None:
            self._locate = KeyLocator([s.key for s in self.samples], [s.shard for s in self.samples],
                                      [s.pos for s in self.samples])
        return self._locate

    def reader(self, name: str) -> SourceReader:
        return SourceReader(name, self.source or self.folder, self.locate)

    def summary(self) -> str:
        """One line for the CLI: what was indexed and what was left out (by name)."""
        shards = self.header.get("shards", {})
        where = self.source.index_path if self.source else Path(self.folder) / INDEX_NAME
        line = f"{len(self)} samples in {len(shards)} shards indexed in {where}"
        if self.problems:
            line += f"; left out {self.problems}"
            if self.bad_shards:
                line += f", bad shards: {', '.join(sorted(self.bad_shards))}"
        return line


def _as_source(source: str | Path | ShardSet) -> ShardSet:
    return source if isinstance(source, ShardSet) else resolve_source(source)


def _scan_shard(job: tuple[ShardSet, str]) -> dict:
    """Index one shard (runs in a pool worker): samples, sample problems, or a shard error."""
    source, rel = job
    # The recorded size is what the staleness check will compare with: the listed size of a
    # remote shard (None if the filesystem gives none), the file's size for a local one.
    out = {"shard": rel, "bytes": source.size(rel), "samples": [], "problems": [], "error": None}
    try:
        shard = Shard(source.open_path(rel), label=source.url(rel), reindex=source.index_command())
    except DataError as e:  # a remote shard that cannot be fetched is a bad shard too
        out["error"] = str(e)
        return out
    try:
        for pos, (key, fields) in enumerate(shard):
            try:
                raw = parse_fields(f"{key} (shard {rel})", fields)
                media = read_meta(raw)
            except DataError as e:
                if e.kind == "config":  # e.g. the video decoder is not installed: no sample's fault
                    raise
                out["problems"].append((e.kind, str(e)))
                continue
            response = raw.response if raw.messages is None else last_answer(raw.messages)[1]
            sample = {"key": key, "shard": rel, "pos": pos, "text_bytes": len(raw.text.encode("utf-8")),
                      "response_bytes": None if response is None else len(response.encode("utf-8")),
                      "media": [[m, meta] for m, meta in media]}
            if raw.messages is not None:
                sample["chat"] = 1
            out["samples"].append(sample)
    except DataError as e:
        if e.kind == "config":
            raise
        out["error"] = str(e)
    finally:
        shard.close()
    return out


def build_index(source: str | Path | ShardSet, workers: int | None = None, progress: bool = True,
                on_error: str = "skip") -> SourceIndex:
    """Scan every shard of ``source`` (a folder, a spec for ``resolve_source``, or a ShardSet)
    and write its index (``FOLDER/omni_index.jsonl`` for a folder). Remote shards are
    downloaded into the cache on the way.

    Bad shards and bad samples are left out of the index, counted in its header and logged
    with their names; with ``on_error="stop"`` the first one raises a DataError instead.
    """
    from tqdm import tqdm

    if on_error not in ON_ERROR_POLICIES:
        raise DataError(f"on_error={on_error!r} is not a policy; use one of {ON_ERROR_POLICIES}", kind="config")
    source = _as_source(source)
    rels = source.shards
    workers = max(1, min(workers or os.cpu_count() or 1, len(rels)))
    # Each job carries a one-shard copy of the source: the full shard list would be pickled
    # once per job, quadratic in the number of shards.
    jobs = [(replace(source, shards=(r,), sizes=(source.size(r),) if source.remote else ()), r) for r in rels]
    bar = tqdm(total=len(rels), desc=f"index {source.target}", unit="shard", disable=not progress)
    results = []
    try:
        for res in imap_in_workers(_scan_shard, jobs, workers):
            results.append(res)
            bar.update()
    finally:
        bar.close()  # also on an error (a missing decoder): its message then starts a line of its own

    samples: list[dict] = []
    shards, bad_shards, problems, examples, first = {}, {}, {}, {}, None
    seen_keys: dict[str, str] = {}

    def problem(kind: str, msg: str) -> None:
        nonlocal first
        problems[kind] = problems.get(kind, 0) + 1
        examples.setdefault(kind, msg)
        first = first or DataError(msg, kind=kind)

    for res in results:
        shards[res["shard"]] = {"bytes": res["bytes"], "samples": len(res["samples"])}
        if res["error"]:
            bad_shards[res["shard"]] = res["error"]
            problem("corrupt_shard", res["error"])
        for kind, msg in res["problems"]:
            problem(kind, msg)
        for s in res["samples"]:
            # Sample ids are "<source>/<key>", so a key must be unique in its folder.
            other = seen_keys.get(s["key"])
            if other is not None:
                problem("duplicate_key", f"sample key {s['key']!r} is in shards {other} and {s['shard']}; keys "
                                         f"must be unique per source (e.g. prefix them with the shard name)")
                continue
            seen_keys[s["key"]] = s["shard"]
            samples.append(s)
    if first is not None and on_error == "stop":
        raise first
    for kind, n in problems.items():
        log.warning("index %s: left out %d sample(s)/shard(s) with %s, e.g. %s", source.target, n, kind,
                    examples[kind])

    header = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "num_samples": len(samples), "shards": shards,
              "bad_shards": bad_shards, "problems": problems, "examples": examples}
    path = source.index_path
    path.parent.mkdir(parents=True, exist_ok=True)  # a remote source's index folder in the cache
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(json.dumps(header) + "\n")
        for s in samples:
            f.write(json.dumps(s, separators=(",", ":")) + "\n")
    os.replace(tmp, path)  # atomic: readers never see half an index
    return SourceIndex(source, [_meta(s) for s in samples], header)


def _meta(d: dict) -> SampleMeta:
    return SampleMeta(d["key"], d["shard"], d["pos"], d["text_bytes"], d["response_bytes"],
                      [(m, meta) for m, meta in d["media"]], bool(d.get("chat")))


def _stale_reason(source: ShardSet, header: dict) -> str | None:
    recorded = header.get("shards", {})
    current = set(source.shards)
    for rel in sorted(set(recorded) | current):
        if rel not in current:
            return f"shard {rel} was removed"
        if rel not in recorded:
            return f"shard {rel} is new"
        # Local shards: the file's size now. Remote shards: the size fsspec listed; where a
        # filesystem reports none (or none was recorded) the size check is skipped.
        size, was = source.size(rel), recorded[rel]["bytes"]
        if size is not None and was is not None and size != was:
            return f"shard {rel} changed size"
    return None


def load_index(source: str | Path | ShardSet, build_if_missing: bool = False, progress: bool = True) -> SourceIndex:
    """Load the index of ``source`` (a folder, a spec for ``resolve_source``, or a ShardSet);
    a missing or stale one is built (if asked) or a DataError."""
    source = _as_source(source)
    path = source.index_path
    fix = f"build it with `{source.index_command()}`"
    if not path.exists():
        if build_if_missing:
            return build_index(source, progress=progress)
        raise DataError(f"{source.describe()} has no index ({path}); {fix}", kind="missing_index")
    with open(path) as f:
        try:
            header = json.loads(f.readline())
            samples = [_meta(json.loads(line)) for line in f if line.strip()]
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"index {path} is unreadable ({e}); re{fix[1:]}", kind="bad_index") from None
    if header.get("format") != INDEX_FORMAT or header.get("version") != INDEX_VERSION:
        raise DataError(f"index {path} has format {header.get('format')} v{header.get('version')}, expected "
                        f"{INDEX_FORMAT} v{INDEX_VERSION}; re{fix[1:]}", kind="bad_index")
    stale = _stale_reason(source, header)
    if stale:
        if build_if_missing:
            log.warning("index %s is stale (%s): rebuilding", path, stale)
            return build_index(source, progress=progress)
        raise DataError(f"index {path} is stale ({stale}); re{fix[1:]}", kind="stale_index")
    if header.get("problems"):
        log.warning("index %s: %d sample(s)/shard(s) were left out when it was built: %s; bad shards: %s",
                    path, sum(header["problems"].values()), header["problems"], sorted(header.get("bad_shards", {})))
    return SourceIndex(source, samples, header)
