"""Where a source's shards are: a folder, a glob, a brace list, or a URL.

``resolve_source(spec)`` turns what the user wrote into a ``ShardSet``: the shard names
(relative to a base folder or URL prefix), where the metadata index lives, and a local file
for each shard::

    data/shapes                            folder, every *.tar below it   index data/shapes/omni_index.jsonl
    'data/shapes/*.tar', 'data/**/tr-*.tar'  glob (only *.tar matches)    index BASE/omni_index.<hash>.jsonl
    'data/x/shard-{000000..000009}.tar'    brace list (all must exist)    index BASE/omni_index.<hash>.jsonl
    's3://bucket/x/shard-{0..9}.tar'       URL (any fsspec protocol; a folder, a glob or braces)
                                           index $OMNI_CACHE/index/<hash>/omni_index.jsonl

BASE is the folder before the first wildcard or brace; <hash> comes from the rest of the spec,
so the index moves with the folder. Remote shards are copied once into
``$OMNI_CACHE/shards/`` and read from there: wids memory-maps a local file, and random access
over the network would cost a request per sample.
"""
from __future__ import annotations

import glob
import hashlib
import os
import posixpath
import re
import shlex
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from dataloading.errors import DataError
from dataloading.index.shards import list_shards

INDEX_NAME = "omni_index.jsonl"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_WILDCARDS = "*?["
# fsspec protocol -> the package that implements it, for the "pip install" hint.
_PROTOCOL_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
                      "http": "aiohttp", "https": "aiohttp", "hf": "huggingface_hub"}


def cache_root() -> Path:
    """Omni's cache folder: ``$OMNI_CACHE``, default ``~/.cache/omni`` (demo data, remote shards,
    indexes of remote sources)."""
    return Path(os.environ.get("OMNI_CACHE") or "~/.cache/omni").expanduser()


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def _join(base: str, rel: str) -> str:
    return base + rel if base.endswith("/") else f"{base}/{rel}"


@dataclass(frozen=True)
class ShardSet:
    """The shards of one source. Picklable: it travels to index and loader workers."""

    spec: str  # what the user wrote
    index_path: Path  # the metadata index (always local)
    base: str  # local folder or URL prefix the shard names are relative to
    shards: tuple[str, ...]  # sorted
    pattern: str = ""  # the spec relative to base; "" for a folder (every *.tar below it)
    # Remote only: the sizes fsspec listed (None where the filesystem reports none), aligned
    # with ``shards``. Local shards are stat'ed when asked, so this stays empty for them.
    sizes: tuple[int | None, ...] = field(default=(), repr=False)

    @property
    def remote(self) -> bool:
        return _SCHEME.match(self.base) is not None

    @property
    def target(self) -> str:
        """The spec with its base resolved: what ``omni data index`` takes, from any folder."""
        return _join(self.base, self.pattern) if self.pattern else self.base

    def url(self, rel: str) -> str:
        """The shard's full name (local path or URL), for messages."""
        return _join(self.base, rel) if self.remote else str(Path(self.base) / rel)

    def describe(self) -> str:
        if not self.pattern:
            return f"{'URL' if self.remote else 'data folder'} {self.base}"
        kind = "URL" if self.remote else "glob" if any(c in self.pattern for c in _WILDCARDS) else "shard list"
        n = len(self.shards)
        return f"{kind} {self.target} ({n} shard{'s' if n != 1 else ''})"

    def index_command(self) -> str:
        return f"omni data index {shlex.quote(self.target)}"

    @cached_property
    def _listed(self) -> dict[str, int | None]:
        return dict(zip(self.shards, self.sizes))

    def size(self, rel: str) -> int | None:
        """The shard's size now (local), or as listed (remote); None when unknown."""
        if self.remote:
            return self._listed.get(rel)
        try:
            return (Path(self.base) / rel).stat().st_size
        except FileNotFoundError:
            return None

    def open_path(self, rel: str) -> Path:
        """A local file holding shard ``rel``; a remote shard is downloaded on first use."""
        if not self.remote:
            return Path(self.base) / rel
        url = self.url(rel)
        dest = cache_root() / "shards" / f"{_sha1(url)}.tar"
        want = self.size(rel)
        # A cached copy of another size is an older version of the shard (its index would stay
        # stale forever): fetch it again. Without a listed size the cached copy is trusted.
        if dest.is_file() and (want is None or dest.stat().st_size == want):
            return dest
        fs, path = _filesystem(url)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
        try:
            fs.get_file(path, str(tmp))
            os.replace(tmp, dest)  # atomic: concurrent readers never see half a shard
        except FileNotFoundError:
            raise DataError(f"shard {url}: not found; restore it or rebuild the index with `{self.index_command()}`",
                            kind="missing_shard") from None
        except Exception as e:  # network, credentials, ...: each filesystem raises its own types
            raise DataError(f"shard {url}: download failed ({type(e).__name__}: {e}); check the URL, network "
                            f"and credentials", kind="missing_shard") from None
        finally:
            tmp.unlink(missing_ok=True)
        return dest


def resolve_source(spec: str | Path, relative_to: Path | None = None) -> ShardSet:
    """The shards ``spec`` names (see the module docstring); relative local paths start at
    ``relative_to`` (the mixture file's folder) when given. Mistakes raise a one-line
    ``DataError(kind="config")``."""
    text = str(spec).strip()
    if not text:
        raise DataError("data source '': empty path; give a folder, a glob, a brace list or a URL", kind="config")
    if _SCHEME.match(text):
        return _resolve_remote(text)
    return _resolve_local(text, relative_to)


def _split(spec: str, wildcards: str) -> tuple[str, str]:
    """``("data/x", "s-*.tar")`` for ``data/x/s-*.tar``: the folder before the first wildcard
    or brace, and the rest (``""`` when there is none)."""
    i = min((spec.find(c) for c in wildcards + "{" if c in spec), default=-1)
    if i < 0:
        return spec, ""
    scheme = _SCHEME.match(spec)
    floor = scheme.end() if scheme else 0  # never cut inside "s3://"
    j = spec.rfind("/", floor, i)
    if j < 0:
        return spec[:floor] or ".", spec[floor:]
    return spec[:j] if j > floor else spec[:j + 1], spec[j + 1:]  # "/" or "file:///" keep their root


def _expand(spec: str, pattern: str) -> list[str]:
    from braceexpand import braceexpand

    try:
        return list(braceexpand(pattern))
    except Exception as e:  # unbalanced braces and the like
        raise DataError(f"data source {spec}: bad brace pattern ({e}); write e.g. shard-{{000000..000009}}.tar",
                        kind="config") from None


def _missing(spec: str, missing: list[str], listed: int) -> DataError:
    return DataError(f"data source {spec}: shard {missing[0]} does not exist ({len(missing)} of {listed} listed "
                     f"shards are missing); fix the pattern or restore the files", kind="config")


def _nothing(spec: str, base: str) -> DataError:
    return DataError(f"data source {spec}: matched no .tar shards under {base}; check the pattern (and quote it "
                     f"in a shell: omni data index {shlex.quote(spec)})", kind="config")


def _resolve_local(spec: str, relative_to: Path | None) -> ShardSet:
    base_text, pattern = _split(spec, _WILDCARDS)
    base = Path(base_text).expanduser()
    if relative_to is not None and not base.is_absolute():
        base = Path(relative_to).expanduser() / base
    if not pattern:
        if base.is_dir():
            shards = tuple(str(p.relative_to(base)) for p in list_shards(base))
            if not shards:
                raise DataError(f"data folder {base}: no *.tar shards found; point it at a folder of webdataset "
                                "shards (see docs/data.md)", kind="config")
            return ShardSet(spec, base / INDEX_NAME, str(base), shards)
        if not (base.is_file() and base.name.endswith(".tar")):
            raise DataError(f"data folder {base}: no such directory; check the path", kind="config")
        base, pattern = base.parent, base.name  # one shard: a list of one
    names = _expand(spec, pattern)
    found: set[str] = set()
    missing: list[str] = []
    for name in names:
        if any(c in name for c in _WILDCARDS):
            # root_dir: a base folder whose name holds '[' must not be read as a pattern
            found.update(m for m in glob.glob(name, root_dir=base, recursive=True)
                         if m.endswith(".tar") and (base / m).is_file())
        elif (base / name).is_file():
            found.add(posixpath.normpath(name))
        else:
            missing.append(str(base / name))
    if missing:
        raise _missing(spec, missing, len(names))
    if not found:
        raise _nothing(spec, str(base))
    index = base / f"omni_index.{_sha1(pattern)[:10]}.jsonl"
    return ShardSet(spec, index, str(base), tuple(sorted(found)), pattern)


def _filesystem(url: str, spec: str | None = None):
    """``(fsspec filesystem, path)`` for ``url``; a missing package is a one-line hint that
    names ``spec`` (default: the url)."""
    proto = _SCHEME.match(url).group(1)
    spec = spec or url
    hint = "pip install fsspec" + (f" {_PROTOCOL_PACKAGES[proto]}" if proto in _PROTOCOL_PACKAGES else "")
    try:
        import fsspec.core  # optional: only remote sources need it
    except ImportError:
        raise DataError(f"data source {spec}: {proto}:// URLs need fsspec; {hint}", kind="config") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise DataError(f"data source {spec}: {e}; {hint}", kind="config") from None
    except ValueError as e:  # "Protocol not known: ..."
        raise DataError(f"data source {spec}: {e}; use a protocol fsspec knows (s3://, gs://, https://, file://, ...)",
                        kind="config") from None


def _resolve_remote(spec: str) -> ShardSet:
    scheme = _SCHEME.match(spec)
    proto, path = scheme.group(1), spec[scheme.end():].rstrip("/")
    if not path:
        raise DataError(f"data source {spec}: no path after the protocol; name a folder, a glob or a brace list",
                        kind="config")
    wildcards = "*[" if proto in ("http", "https") else _WILDCARDS  # '?' starts an http query string
    base, pattern = _split(spec[:scheme.end()] + path, wildcards)
    if not pattern and base.endswith(".tar") and "/" in base[len(proto) + 3:]:
        base, pattern = base.rsplit("/", 1)  # one shard: a list of one
    fs, root = _filesystem(base, spec)
    listed: dict[str, int | None] = {}

    def rel(path: str) -> str:  # fsspec answers in paths without the protocol, like ``root``
        return path[len(root):].lstrip("/") if path.startswith(root) else path

    try:
        if not pattern:  # a folder: every *.tar below it
            if not fs.isdir(root):
                raise DataError(f"data source {spec}: no such folder; check the URL", kind="config")
            for path, info in fs.find(root, detail=True).items():
                if path.endswith(".tar"):
                    listed[rel(path)] = info.get("size")
        else:
            names = _expand(spec, pattern)
            plain = []
            for name in names:
                full = posixpath.join(root, name) if root else name
                if any(c in name for c in wildcards):
                    for path, info in fs.glob(full, detail=True).items():
                        if info.get("type") == "file" and path.endswith(".tar"):
                            listed[rel(path)] = info.get("size")
                else:
                    plain.append(full)
            sizes, missing = _sizes(fs, proto, plain)
            if missing:
                raise _missing(spec, [_join(base, rel(p)) for p in missing], len(names))
            listed.update((rel(p), size) for p, size in sizes.items())
    except DataError:
        raise
    except Exception as e:  # network, credentials, ...
        raise DataError(f"data source {spec}: listing failed ({type(e).__name__}: {e}); check the URL, network "
                        f"and credentials", kind="config") from None
    if not listed:
        raise _nothing(spec, base)
    shards = tuple(sorted(listed))
    target = _join(base, pattern) if pattern else base
    index = cache_root() / "index" / _sha1(target) / INDEX_NAME
    return ShardSet(spec, index, base, shards, pattern, tuple(listed[s] for s in shards))


def _sizes(fs, proto: str, paths: list[str]) -> tuple[dict[str, int | None], list[str]]:
    """Sizes of the named remote shards, and the missing ones. Listing each folder once costs
    one request per folder instead of one per shard (http has no real listing: ask per file)."""
    folders: dict[str, dict[str, dict]] = {}
    sizes: dict[str, int | None] = {}
    missing = []
    for path in paths:
        folder = posixpath.dirname(path)
        if folder not in folders:
            try:
                folders[folder] = {} if proto in ("http", "https") else \
                    {i["name"]: i for i in fs.ls(folder, detail=True)}
            except FileNotFoundError:
                folders[folder] = {}
        info = folders[folder].get(path)
        if info is None:
            try:
                info = fs.info(path)
            except FileNotFoundError:
                missing.append(path)
                continue
        sizes[path] = info.get("size")
    return sizes, missing
