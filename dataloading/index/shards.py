"""Webdataset shards: writing (webdataset.ShardWriter) and random access by key (wids).

Reading goes through ``wids.wids.IndexedTarSamples`` (mmap-backed, no hand-written tar
parsing). wids does not notice a truncated shard (it hands back short bytes), so every
shard is checked once on open: each member must end inside the file.
"""
from __future__ import annotations

import mmap
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from dataloading.errors import DataError

SHARD_GLOB = "*.tar"


def list_shards(folder: str | Path) -> list[Path]:
    """All ``*.tar`` files under ``folder`` (recursive), sorted for a stable order."""
    return sorted(p for p in Path(folder).rglob(SHARD_GLOB) if p.is_file())


def write_shards(samples: Iterable[dict], folder: str | Path, prefix: str, samples_per_shard: int) -> list[Path]:
    """Write ``{"__key__": str, field: bytes | str}`` dicts into ``folder/prefix-%06d.tar``.

    ``mtime`` is fixed so the same samples give byte-identical shards (reproducible data).
    """
    import webdataset as wds

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    pattern = str(folder / f"{prefix}-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=samples_per_shard, verbose=0, encoder=False, mtime=0,
                         post=written.append) as sink:
        for sample in samples:
            sink.write({k: v.encode("utf-8") if isinstance(v, str) and k != "__key__" else v
                        for k, v in sample.items()})
    return [Path(p) for p in written]  # ``post`` runs as each shard is closed


class Shard:
    """One open shard: samples by position and by key, as ``{field: bytes}`` dicts.

    ``label`` names the shard in messages (default: its path; a remote shard's URL rather
    than its cached copy) and ``reindex`` is the command that rebuilds its index.
    """

    def __init__(self, path: str | Path, label: str | None = None, reindex: str | None = None):
        from wids.wids import IndexedTarSamples

        self.path = Path(path)
        self.label = label or str(self.path)
        self.reindex = reindex or f"omni data index {self.path.parent}"
        if self.path.is_file() and self.path.stat().st_size % 512:
            # tar files are made of 512-byte blocks: anything else was cut short
            raise self._corrupt(f"truncated (size {self.path.stat().st_size} is not a multiple of 512)")
        try:
            self._tar = IndexedTarSamples(path=str(self.path))
        except FileNotFoundError:
            raise DataError(f"shard {self.label}: file not found; restore it or rebuild the index with "
                            f"`{self.reindex}`", kind="missing_shard") from None
        except Exception as e:  # wids raises struct/assert/value errors on garbage headers
            raise self._corrupt(f"unreadable tar ({type(e).__name__}: {e})") from None
        self._check_complete()
        self._keys: dict[str, int] | None = None
        self._release(0, None)  # opening read every member header: hand those pages back

    def _release(self, start: int, end: int | None) -> None:
        """Drop this process's resident pages of bytes [start, end) of the memory map.

        Sample bytes are copied out when read, so the mapped pages are not needed afterwards;
        left mapped they stay resident and count as this process's memory (a rank that touched
        every shard would hold them all). The page cache keeps them for the next reader.
        """
        mm = getattr(self._tar.reader, "mmapped_file", None)
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        lo = start // page * page
        hi = len(mm) if end is None else min(len(mm), -(-end // page) * page)
        if hi > lo:
            try:
                mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (OSError, ValueError):
                pass  # only a memory hint

    def _corrupt(self, why: str) -> DataError:
        return DataError(f"shard {self.label}: {why}; re-create or remove the shard, then rebuild the index with "
                         f"`{self.reindex}`", kind="corrupt_shard")

    def _check_complete(self) -> None:
        reader = self._tar.reader
        mm = getattr(reader, "mmapped_file", None)
        if mm is None:  # another wids reader: nothing more to check cheaply
            return
        if len(getattr(reader, "by_name", ())) != len(getattr(reader, "by_index", ())):
            self.close()  # wids maps names to positions: a repeated member name shifts every sample
            raise self._corrupt("repeats a member name (same key and field twice)")
        end, size = 0, len(mm)
        for name, offset, length in getattr(reader, "by_index", ()):
            end = offset + 512 + (length + 511) // 512 * 512
            if offset + 512 + length > size:
                self.close()
                raise self._corrupt(f"truncated (member {name!r} needs {offset + 512 + length} bytes, "
                                          f"file has {size})")
        # A complete tar ends with two zero blocks; without them the file was cut between
        # members and would silently lose its last samples.
        if mm[end:end + 1024] != bytes(1024):
            self.close()
            raise self._corrupt(f"truncated (no end-of-archive blocks after byte {end}, file has {size})")

    def __len__(self) -> int:
        return len(self._tar)

    def _fields(self, i: int) -> tuple[str, dict[str, bytes]]:
        try:
            raw = self._tar[i]
        except Exception as e:
            raise self._corrupt(f"sample #{i} unreadable ({type(e).__name__}: {e})") from None
        key = raw.pop("__key__")
        # wids names fields with a leading dot (".txt"); the data format does not.
        fields = {name[1:] if name.startswith(".") else name: data.getvalue() for name, data in raw.items()}
        members = getattr(self._tar.reader, "by_index", None)
        if members is not None:
            spans = [members[m] for m in self._tar.samples[i]]
            self._release(min(o for _, o, _ in spans), max(o + 512 + n for _, o, n in spans))
        return key, fields

    def __iter__(self) -> Iterator[tuple[str, dict[str, bytes]]]:
        for i in range(len(self)):
            yield self._fields(i)

    def get(self, key: str, position: int | None = None) -> dict[str, bytes]:
        """Fields of sample ``key``; ``position`` (from the index) avoids building a key map."""
        if position is not None and 0 <= position < len(self):
            k, fields = self._fields(position)
            if k == key:
                return fields
        if self._keys is None:
            reader = self._tar.reader
            names = [n for n, _, _ in reader.by_index] if hasattr(reader, "by_index") else list(reader.names())
            self._keys = {}
            for i, members in enumerate(self._tar.samples):
                self._keys.setdefault(_key_of(names[members[0]]), i)
        if key not in self._keys:
            raise DataError(f"shard {self.label}: no sample with key {key!r}; the index is stale, rebuild it "
                            f"with `{self.reindex}`", kind="missing_sample")
        return self._fields(self._keys[key])[1]

    def close(self) -> None:
        try:
            self._tar.close()
        except Exception:
            pass


def _key_of(member_name: str) -> str:
    # Same rule as webdataset: the key is everything before the first dot of the basename.
    head, _, base = member_name.rpartition("/")
    return (head + "/" if head else "") + base.split(".", 1)[0]


class ShardPool:
    """One cap on the shards a process keeps open, across all its sources (least recently
    used closed first). Every open shard holds two file descriptors; with hundreds of sources
    per-source caps alone would exhaust the descriptor limit. Picklable: open shards stay behind.
    """

    def __init__(self, max_open: int = 256):
        if max_open < 1:
            raise DataError(f"data.max_open_shards={max_open} must be >= 1", kind="config")
        self.max_open = max_open
        self._open: OrderedDict[tuple[str, str], Shard] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str], opener) -> Shard:
        with self._lock:
            shard = self._open.pop(key, None)
            if shard is not None:
                self._open[key] = shard  # most recently used last
                return shard
        opened = opener()  # outside the lock: a remote shard may be downloaded first
        with self._lock:
            shard = self._open.pop(key, None)  # another thread may have opened it meanwhile
            if shard is None:
                shard = opened
            else:
                opened.close()
            self._open[key] = shard
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)[1].close()
            return shard

    def __len__(self) -> int:
        return len(self._open)

    def close(self) -> None:
        with self._lock:
            for shard in self._open.values():
                shard.close()
            self._open.clear()

    def __getstate__(self) -> dict:
        return {"max_open": self.max_open}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["max_open"])


class SourceReader:
    """Random access to the samples of one source by key, keeping a few shards open.

    ``folder`` is a folder of shards or a ``dataloading.index.sources.ShardSet`` (whose
    ``open_path`` fetches remote shards into the local cache). ``locate`` maps key -> (shard
    name relative to it, position in the shard); it comes from the index. Picklable (open
    shards are dropped), so it can go to a worker.
    """

    def __init__(self, name: str, folder, locate: Mapping[str, tuple[str, int]], max_open: int = 32):
        self.name = name
        self.source = None if isinstance(folder, (str, Path)) else folder
        self.folder = Path(folder) if self.source is None else self.source.target  # for messages
        self.reindex = f"omni data index {self.folder}" if self.source is None else self.source.index_command()
        self.locate = locate
        self.pool: ShardPool | None = None  # set by the constructor: one cap across its sources
        self._own = ShardPool(max_open)  # used while no shared pool is set

    def _open_shard(self, rel: str) -> Shard:
        if self.source is None:
            return Shard(self.folder / rel)
        return Shard(self.source.open_path(rel), label=self.source.url(rel), reindex=self.reindex)

    def shard(self, rel: str) -> Shard:
        pool = self.pool if self.pool is not None else self._own
        return pool.get((self.name, rel), lambda: self._open_shard(rel))

    def get(self, key: str) -> dict[str, bytes]:
        try:
            rel, position = self.locate[key]
        except KeyError:
            raise DataError(f"sample {self.name}/{key}: not in the index of {self.folder}; rebuild it with "
                            f"`{self.reindex}`", kind="missing_sample") from None
        return self.shard(rel).get(key, position)

    def close(self) -> None:
        """Close the shards opened through this reader's own pool (a shared pool is its owner's)."""
        self._own.close()

