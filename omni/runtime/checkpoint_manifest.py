"""What makes a checkpoint folder trustworthy: a manifest of every file's size and SHA-256,
written last, and the durable-write steps around it (fsync of files and folders, so that an
atomic rename can only ever expose a complete folder, even after a power loss).

The work scales with the ranks: at save time each rank hashes and flushes the files it wrote
(``seal``) and rank 0 only merges the results (``write_manifest``); at resume each rank checks
its own share of the files (``share``, ``verify``) and the ranks combine their answers.
``resume=auto`` skips a folder that fails the check.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import os
from pathlib import Path
from typing import Any, Iterable, Optional

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 1 << 20
# checkpoint.verify: "full" re-hashes every file, "size" compares sizes only (catches a
# truncated or missing file), "none" trusts a folder that has its manifest.
VERIFY_MODES = ("full", "size", "none")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def seal(folder: Path, names: Iterable[str]) -> dict[str, dict]:
    """Size and checksum of ``names`` (paths relative to ``folder``), each flushed to the disk:
    what one rank contributes to the manifest."""
    entries = {}
    for rel in sorted(set(names)):
        p = folder / rel
        with open(p, "rb") as f:
            os.fsync(f.fileno())
        entries[rel] = {"bytes": p.stat().st_size, "sha256": sha256(p)}
    return entries


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path, meta: dict[str, Any], sealed: Optional[dict[str, dict]] = None) -> dict[str, Any]:
    """The manifest of ``folder``: ``sealed`` (the ranks' entries for the files they wrote) plus
    every other file found there, sealed here (the shared metadata and marker files; with
    ``sealed`` None, all of them), and ``meta``. The manifest itself and the folders are
    flushed too, so that a rename that follows exposes only durable content."""
    on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST}
    files = dict(sealed or {})  # a sealed file gone since stays listed: verify reports it missing
    files.update(seal(folder, on_disk - set(files)))
    manifest = {"format": FORMAT, **meta, "files": dict(sorted(files.items()))}
    path = folder / MANIFEST
    with open(path, "w") as f:
        f.write(json.dumps(manifest, indent=1, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    for sub in sorted({p.parent for p in folder.rglob("*")} | {folder}, reverse=True):
        fsync_dir(sub)
    return manifest


def read_manifest(folder: Path) -> tuple[Optional[dict], Optional[str]]:
    """(manifest, None), or (None, why it cannot be read)."""
    path = folder / MANIFEST
    if not path.is_file():
        return None, f"no {MANIFEST}"
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest["files"], dict):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return None, f"{MANIFEST} is unreadable"
    return manifest, None


def share(files: dict[str, dict], rank: int, world: int) -> list[str]:
    """The files ``rank`` of ``world`` checks: the largest first, each to the least loaded rank
    so far, so every rank reads about the same number of bytes. A pure function of the
    manifest, so every rank computes the same split."""
    loads = [(0, r) for r in range(world)]
    mine = []
    for rel in sorted(files, key=lambda k: (-int(files[k]["bytes"]), k)):
        load, r = heapq.heappop(loads)
        if r == rank:
            mine.append(rel)
        heapq.heappush(loads, (load + int(files[rel]["bytes"]), r))
    return sorted(mine)


def verify(folder: Path, mode: str = "full", rank: int = 0, world: int = 1) -> Optional[str]:
    """None if this rank's share of ``folder`` matches the manifest, else why not (one line).
    With the defaults (one rank, ``full``): the whole folder, every checksum."""
    manifest, problem = read_manifest(folder)
    if problem is not None:
        return problem
    if mode == "none":
        return None
    files = manifest["files"]
    for rel in share(files, rank, world):
        want = files[rel]
        p = folder / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != want["bytes"]:
            return f"{rel} has {p.stat().st_size} bytes, the manifest says {want['bytes']}"
        if mode == "full" and sha256(p) != want["sha256"]:
            return f"{rel} does not match its checksum"
    return None
