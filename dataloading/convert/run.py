"""``omni data convert``: conversations in another format -> an indexed Omni source (docs/data.md,
"Converting datasets").

The input is read in order and cut into batches of ``shard_size`` records; batch ``j`` becomes
``OUT/shard-{j:06d}.tar`` holding its convertible records (keys: each record's position in the
input), so the output is the same whatever the number of worker processes. A worker turns each
record into a conversation (``dataloading.convert.records``), reads its media (paths under
``--media-root``, or the bytes the record holds), checks them as the training reader will
(``dataloading.formats.sample``: numbered fields against placeholders, header metadata, decoding) and
writes the sample:

- ``messages.json``: ``[{"role", "content"}]``, media placeholders in the content strings;
- ``0.jpg``, ``1.wav``, ...: the media in placeholder order, the original files' bytes;
- ``json``: ``{"id": ..., <the record's other scalar fields>}``.

A record that cannot be converted is never dropped silently: it is counted by kind and listed
in ``OUT/convert_report.jsonl`` as ``{"id", "reason": "<kind>: <detail>"}``, in input order.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dataloading.convert.inputs import batches, open_input
from dataloading.convert.records import Conversation, MediaRef, RecordProblem, record_id, to_conversation
from dataloading.errors import DataError
from dataloading.formats.chat import MESSAGES_FIELD, parse_messages, prompt_text
from dataloading.formats.media import MEDIA_PLACEHOLDERS
from dataloading.formats.modality import MODALITIES
from dataloading.formats.sample import media_fields, media_meta, parse_fields, placeholder_modalities
from dataloading.processes import worker_pool

REPORT_NAME = "convert_report.jsonl"
SHARD_NAME = "shard-{:06d}.tar"
DEFAULT_SHARD_SIZE = 1000
#: What the report calls the training reader's problem kinds (dataloading.formats.sample, dataloading.formats.chat);
#: kinds not named here keep their name (no_assistant_turn, placeholder_mismatch).
_READER_KINDS = {"bad_messages": "bad_record", "bad_fields": "bad_record"}


@dataclass(frozen=True)
class _Job:
    """What a worker needs besides the records (picklable)."""

    fmt: str
    media_root: str
    out: str | None  # None: a dry run


@dataclass
class ConvertSummary:
    input: str
    out: Path
    dry_run: bool
    total: int = 0
    converted: int = 0
    skipped: Counter = field(default_factory=Counter)
    shards: list[str] = field(default_factory=list)
    index_line: str | None = None  # dataloading.index.source_index.SourceIndex.summary() of the written source

    @property
    def report(self) -> Path:
        return self.out / REPORT_NAME

    def lines(self) -> list[str]:
        """What the command prints."""
        verb = "would convert" if self.dry_run else "converted"
        where = "would be written to" if self.dry_run else "written to"
        out = [f"{verb} {self.converted} of {self.total} records of {self.input}; "
               f"{len(self.shards)} shard(s) {where} {self.out}"]
        if self.skipped:
            kinds = ", ".join(f"{k}={n}" for k, n in sorted(self.skipped.items()))
            listed = "would be listed in" if self.dry_run else "listed in"
            out.append(f"skipped {sum(self.skipped.values())}: {kinds}; {listed} {self.report}")
        if self.dry_run:
            out.append("dry run: nothing was written")
        elif self.index_line:
            out.append(self.index_line)
        return out


# ---- one record -----------------------------------------------------------------------------
def resolve_media(path: str, media_root: Path) -> Path:
    """A record's media path: absolute as given, relative under ``media_root``. A relative path
    may not climb out of the media root (``../../etc/passwd``): a dataset names its own files."""
    p = Path(path)
    if p.is_absolute():
        return p
    full = Path(os.path.normpath(media_root / p))
    if not full.is_relative_to(media_root):
        raise RecordProblem("bad_record", f"media path {path!r} leads out of --media-root {media_root}; give a path "
                                          "inside it (or an absolute path)")
    return full


def _sniff_ext(kind: str, data: bytes) -> str | None:
    """The field extension of media bytes that come without a file name (its declaration's ``sniff``)."""
    try:
        return MODALITIES[kind].sniff(data)
    except Exception:  # PIL and soundfile raise many types on bytes they cannot read
        return None


def _label(ref: MediaRef) -> str:
    return repr(ref.path) if ref.path is not None else f"{ref.kind} bytes"


def _read_media(ref: MediaRef, media_root: Path) -> tuple[str, bytes]:
    """(field extension, bytes) of one item."""
    data = ref.data
    if data is None:
        full = resolve_media(ref.path, media_root)
        if not full.is_file():
            raise RecordProblem("missing_media", f"{ref.kind} {ref.path!r} not found (looked for {full})")
        try:
            data = full.read_bytes()
        except OSError as e:
            raise RecordProblem("unreadable_media", f"{ref.kind} {ref.path!r} cannot be read ({e})") from None
    ext = Path(ref.path).suffix[1:].lower() if ref.path is not None else ""
    ext = ext or ref.ext or _sniff_ext(ref.kind, data)
    if not ext:
        raise RecordProblem("unreadable_media", f"{_label(ref)}: not a readable {ref.kind} file")
    return ext, data


def _reader_checks(fields: dict[str, bytes], sample_id: str, conv: Conversation) -> None:
    """The sample as the training reader checks it (``dataloading.formats.sample``): its turns, media types
    and placeholders, each item's header, and (images, audio) its decoding. Videos are checked by
    their header alone: decoding every frame would cost more than the whole conversion. The reader
    decides; the report says it in the record's terms (its paths, not the fields written). Which
    kinds decode lazily is their declaration's (``Modality.decodes_lazily``)."""
    media = conv.media
    try:
        media_fields(sample_id, fields)  # first, to tell an unsupported file type from other field problems
    except DataError as e:
        raise RecordProblem("unsupported_media", str(e)) from None
    try:
        raw = parse_fields(sample_id, fields)
    except DataError as e:
        if e.kind == "placeholder_mismatch":
            wanted = [MEDIA_PLACEHOLDERS[k] for k in placeholder_modalities(prompt_text(conv.messages))]
            given = [f"{_label(ref)} ({kind})" for (kind, _), ref in zip(media_fields(sample_id, fields), media)]
            raise RecordProblem(e.kind, f"the turns hold {len(wanted)} placeholder(s) ({' '.join(wanted) or 'none'}) "
                                        f"but the record gives {len(given)} media item(s) ({', '.join(given) or 'none'});"
                                        " the i-th placeholder takes the i-th item, of its kind") from None
        raise RecordProblem(_READER_KINDS.get(e.kind, e.kind), str(e)) from None
    for (kind, _, data), ref in zip(raw.media, media):
        try:
            media_meta(kind, data)  # what the index reads
            if not MODALITIES[kind].decodes_lazily:  # what training decodes
                MODALITIES[kind].decode(data)
        except DataError:
            raise  # a decoder extra is missing (video): not this record's fault, the run stops
        except Exception as e:  # PIL, soundfile and PyAV raise many types on bad bytes
            raise RecordProblem("unreadable_media", f"{_label(ref)} cannot be read as {kind} "
                                                    f"({type(e).__name__}: {e})") from None


def to_sample(record: Any, default_id: str, position: int, job: _Job) -> dict[str, Any]:
    """One input record -> the fields of its webdataset sample, or a RecordProblem."""
    conv = to_conversation(record, job.fmt, default_id)
    sample_id = f"{conv.id!r} (record {position})"
    messages = json.dumps(conv.messages, ensure_ascii=False).encode("utf-8")
    try:
        parse_messages(sample_id, messages)  # the turns first: no media is read for a record that fails here
    except DataError as e:
        raise RecordProblem(_READER_KINDS.get(e.kind, e.kind), str(e)) from None
    fields = {MESSAGES_FIELD: messages}
    for i, ref in enumerate(conv.media):
        ext, data = _read_media(ref, Path(job.media_root))
        fields[f"{i}.{ext}"] = data
    fields["json"] = json.dumps({"id": conv.id, **conv.meta}, ensure_ascii=False).encode("utf-8")
    _reader_checks(fields, sample_id, conv)
    return {"__key__": f"{position:09d}", **fields}  # positions are unique and sortable; ids need be neither


# ---- one batch (a worker's job) -------------------------------------------------------------
def _write_shard(out: Path, name: str, samples: list[dict]) -> None:
    import webdataset as wds

    tmp = out / f".{name}.tmp"  # renamed when complete: an interrupted run leaves no short shard
    sink = wds.TarWriter(str(tmp), encoder=False, mtime=0)  # mtime fixed: same input, same bytes
    for s in samples:
        sink.write(s)
    sink.close()
    os.replace(tmp, out / name)


def _convert_batch(args: tuple[int, int, list[tuple[Any, str]], _Job]) -> dict:
    number, first, batch, job = args
    samples, problems = [], []
    for k, (record, default_id) in enumerate(batch):
        try:
            samples.append(to_sample(record, default_id, first + k, job))
        except RecordProblem as p:
            problems.append((p.kind, {"id": record_id(record, default_id), "reason": p.reason}))
    name = SHARD_NAME.format(number) if samples else None
    if name and job.out is not None:
        _write_shard(Path(job.out), name, samples)
    return {"records": len(batch), "converted": len(samples), "problems": problems, "shard": name}


# ---- the command ----------------------------------------------------------------------------
def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out} is not an empty folder; give a new or empty folder (conversion never "
                        "overwrites)", kind="config")


def _media_root(media_root: str | Path | None, input_spec: str) -> Path:
    if media_root is None:  # relative media paths start beside the input file (or in its folder)
        root = Path(input_spec) if Path(input_spec).is_dir() else Path(input_spec).parent
    else:
        root = Path(media_root)
        if not root.is_dir():
            raise DataError(f"--media-root {media_root} is not a folder; give the folder the media paths of "
                            "the records start from", kind="config")
    return Path(os.path.normpath(root.absolute()))


def _remove_partial(out: Path, created: bool) -> None:
    """After a failed run, remove what it wrote (OUT was new or empty when it started)."""
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for p in [*out.glob("shard-*.tar"), *out.glob(".shard-*.tmp"), out / REPORT_NAME]:
        p.unlink(missing_ok=True)


def _results(jobs, workers: int):
    """Each batch's result, in input order; at most 2 x workers batches are read ahead, so a
    large input never waits in memory."""
    if workers == 1:
        yield from map(_convert_batch, jobs)
        return
    slots, stop = threading.BoundedSemaphore(2 * workers), threading.Event()

    def bounded():
        for job in jobs:
            while not slots.acquire(timeout=0.1):
                if stop.is_set():  # the consumer is gone: let the pool's feeder thread end
                    return
            yield job

    with worker_pool(workers) as pool:
        try:
            for res in pool.imap(_convert_batch, bounded()):
                slots.release()
                yield res
        finally:
            stop.set()


def convert(fmt: str, input_spec: str, out: str | Path, media_root: str | Path | None = None, *,
            dry_run: bool = False, workers: int | None = None, shard_size: int = DEFAULT_SHARD_SIZE,
            split: str | None = None, progress: bool = True) -> ConvertSummary:
    """Convert INPUT (``--from fmt``) into webdataset shards, their index and the report in ``out``
    (or, ``dry_run``, check every record and write nothing). Problems with the arguments or the
    input as a whole are a DataError before any work; bad records are counted and reported."""
    from tqdm import tqdm

    out = Path(out)
    if shard_size < 1:
        raise DataError(f"--shard-size {shard_size} must be at least 1", kind="config")
    if workers is not None and workers < 1:
        raise DataError(f"--workers {workers} must be at least 1", kind="config")
    _check_out(out)
    root = _media_root(media_root, str(input_spec))
    records = open_input(fmt, str(input_spec), split)  # last: a JSON list is parsed whole here
    if records.total == 0:
        raise DataError(f"INPUT {records.describe} holds no records", kind="config")
    summary = ConvertSummary(records.describe, out, dry_run, total=records.total)
    workers = max(1, min(workers or os.cpu_count() or 1, math.ceil(records.total / shard_size)))
    created = not out.exists()
    job = _Job(fmt, str(root), None if dry_run else str(out))
    jobs = ((n, n * shard_size, batch, job) for n, batch in enumerate(batches(records, shard_size)))
    if not dry_run:
        out.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=records.total, desc=f"convert {input_spec}", unit="record", disable=not progress)
    try:
        with contextlib.ExitStack() as stack:
            report = None if dry_run else stack.enter_context(open(out / REPORT_NAME, "w", encoding="utf-8"))
            # closing: on an error or Ctrl-C the pool is stopped here, before the cleanup below
            for res in stack.enter_context(contextlib.closing(_results(jobs, workers))):
                summary.converted += res["converted"]
                for kind, line in res["problems"]:
                    summary.skipped[kind] += 1
                    if report is not None:
                        report.write(json.dumps(line, ensure_ascii=False) + "\n")
                if res["shard"]:
                    summary.shards.append(res["shard"])
                bar.update(res["records"])
    except BaseException:
        if not dry_run:
            _remove_partial(out, created)
        raise
    finally:
        bar.close()
    if summary.converted == 0:
        kinds = ", ".join(f"{k}={n}" for k, n in sorted(summary.skipped.items()))
        where = "" if dry_run else f"; see {summary.report}"
        raise DataError(f"no record of {records.describe} could be converted ({kinds}){where}", kind="config")
    if not dry_run:
        from dataloading.index.source_index import build_index

        summary.index_line = build_index(out, workers=workers, progress=progress).summary()
    return summary
