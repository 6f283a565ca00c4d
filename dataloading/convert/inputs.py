"""The inputs ``omni data convert`` reads: a JSON or JSONL file, parquet files, a ``datasets`` folder.

Each is opened up front (a missing file, an unreadable container or a missing extra is one
``DataError`` line before any work) and then read sequentially, in input order, as
``(record, default id)`` pairs: decoding records is cheap next to reading and checking their media,
which the convert workers do. A record the container cannot decode (a bad JSONL line) comes as a
``RecordProblem`` in its place, so it is reported like any other bad record.
"""
from __future__ import annotations

import glob
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dataloading.convert.records import FORMATS, RecordProblem
from dataloading.errors import DataError

_EXTRA = "pip install 'omni-mm[convert]'"
_BATCH_ROWS = 256  # parquet / arrow rows decoded at a time


@dataclass
class InputRecords:
    """``total`` records, read by ``read()`` as (record, default id) in input order. The default id
    is ``<file stem>-<position in that file, from 0>``."""

    describe: str
    total: int
    read: Callable[[], Iterator[tuple[Any, str]]]


def _need(module: str, fmt: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"--from {fmt} needs {module.split('.')[0]}, which is not installed; run {_EXTRA}",
                        kind="config") from None


def _first_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        while chunk := f.read(4096):
            chunk = chunk.removeprefix(b"\xef\xbb\xbf").lstrip()
            if chunk:
                return chunk[:1]
    return b""


def _json_list(path: Path, fmt: str) -> InputRecords:
    try:
        records = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 ({e.reason} at byte {e.start}); re-encode it", kind="config") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); fix it, or write "
                        "it as JSONL (one record per line) so that a bad record is skipped and reported",
                        kind="config") from None
    if not isinstance(records, list):
        raise DataError(f"{path} holds a JSON {type(records).__name__}; --from {fmt} reads a list of records or "
                        "JSONL", kind="config")
    return InputRecords(str(path), len(records), lambda: ((r, f"{path.stem}-{i}") for i, r in enumerate(records)))


def _jsonl_records(path: Path) -> Iterator[tuple[Any, str]]:
    with open(path, "rb") as f:
        lines = (line for line in f if line.strip())
        for i, line in enumerate(lines):
            try:
                record = json.loads(line.decode("utf-8").removeprefix("\ufeff"))
            except (UnicodeDecodeError, ValueError) as e:
                record = RecordProblem("bad_record", f"record {i} is not valid JSON ({e})")
            yield record, f"{path.stem}-{i}"


def _json_file(spec: str, fmt: str) -> InputRecords:
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"INPUT {spec} is not a file; --from {fmt} reads a JSON or JSONL file", kind="config")
    if _first_byte(path) == b"[":
        return _json_list(path, fmt)
    with open(path, "rb") as f:
        total = sum(1 for line in f if line.strip())
    return InputRecords(str(path), total, lambda: _jsonl_records(path))


def parquet_files(spec: str) -> list[Path]:
    """A parquet file, every ``*.parquet`` below a folder, or a glob's files; sorted."""
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*.parquet") if p.is_file())
    return sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())


def _parquet(spec: str, fmt: str) -> InputRecords:
    files = parquet_files(spec)
    if not files:
        raise DataError(f"INPUT {spec} names no parquet file (a file, a folder of *.parquet or a quoted glob)",
                        kind="config")
    pq = _need("pyarrow.parquet", fmt)
    total = 0
    for f in files:
        try:
            total += pq.ParquetFile(f).metadata.num_rows
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError on a file that is not parquet
            raise DataError(f"{f} is not a readable parquet file ({type(e).__name__}: {e})", kind="config") from None

    def read() -> Iterator[tuple[Any, str]]:
        for f in files:
            rows = (r for b in pq.ParquetFile(f).iter_batches(batch_size=_BATCH_ROWS) for r in b.to_pylist())
            yield from ((r, f"{f.stem}-{i}") for i, r in enumerate(rows))

    return InputRecords(f"{len(files)} parquet file(s) of {spec}", total, read)


def _hf_dataset(spec: str, fmt: str, split: str | None) -> InputRecords:
    if not Path(spec).is_dir():
        raise DataError(f"INPUT {spec} is not a folder; --from hf-dataset reads a folder written by "
                        "datasets' save_to_disk", kind="config")
    datasets = _need("datasets", fmt)
    try:
        ds = datasets.load_from_disk(spec)
    except FileNotFoundError as e:
        raise DataError(f"INPUT {spec} is not a saved dataset ({e}); write it with Dataset.save_to_disk",
                        kind="config") from None
    describe = f"dataset {spec}"
    if isinstance(ds, datasets.DatasetDict):
        name = split or "train"
        describe += f" (split {name})"
        if name not in ds:
            raise DataError(f"INPUT {spec} has no split {name!r} (it has {', '.join(ds)}); choose one with --split",
                            kind="config")
        ds = ds[name]
    elif split is not None:
        raise DataError(f"INPUT {spec} is one dataset, not a DatasetDict with splits; drop --split", kind="config")
    stem = Path(spec).name
    # Arrow rows keep media as stored ({"bytes", "path"} for an Image feature): nothing is decoded,
    # and an image keeps its file's bytes.
    table = ds.with_format("arrow")

    def read() -> Iterator[tuple[Any, str]]:
        rows = (r for t in table.iter(batch_size=_BATCH_ROWS) for r in t.to_pylist())
        yield from ((r, f"{stem}-{i}") for i, r in enumerate(rows))

    return InputRecords(describe, len(ds), read)


def open_input(fmt: str, spec: str, split: str | None = None) -> InputRecords:
    """INPUT of ``--from fmt``, checked and ready to read; a DataError line names what is wrong."""
    if fmt not in FORMATS:
        raise DataError(f"--from {fmt!r} is not a format; use one of {', '.join(FORMATS)}", kind="config")
    if split is not None and fmt != "hf-dataset":
        raise DataError(f"--split applies to --from hf-dataset only (got --from {fmt})", kind="config")
    if fmt == "parquet":
        return _parquet(spec, fmt)
    if fmt == "hf-dataset":
        return _hf_dataset(spec, fmt, split)
    return _json_file(spec, fmt)


def batches(records: InputRecords, size: int) -> Iterator[list[tuple[Any, str]]]:
    """The records in consecutive lists of ``size`` (the last may be shorter)."""
    it = records.read()
    while batch := list(itertools.islice(it, size)):
        yield batch
