"""What makes a checkpoint folder trustworthy: a manifest of every file's size and SHA-256,
written last, and the durable-write steps around it (fsync of files and folders, so that an
atomic rename can only ever expose a complete folder, even after a power loss).

``verify`` re-reads the folder against its manifest; ``resume=auto`` skips what fails it.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder`` and the folders themselves to the disk."""
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)
    for p in folder.rglob("*"):
        if p.is_dir():
            fsync_dir(p)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Size and checksum of every file already in ``folder`` (all ranks' shards), plus ``meta``."""
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[str(p.relative_to(folder))] = {"bytes": p.stat().st_size, "sha256": sha256(p)}
    manifest = {"format": FORMAT, **meta, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def verify(folder: Path) -> Optional[str]:
    """None if ``folder`` matches its manifest, else why not (one line)."""
    path = folder / MANIFEST
    if not path.is_file():
        return f"no {MANIFEST}"
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for rel, want in sorted(files.items()):
        p = folder / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != want["bytes"]:
            return f"{rel} has {p.stat().st_size} bytes, the manifest says {want['bytes']}"
        if sha256(p) != want["sha256"]:
            return f"{rel} does not match its checksum"
    return None
