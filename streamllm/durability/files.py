"""File-system steps that survive power loss, not only a killed process.

A file's data is durable after `fsync` of the file; its *name* is durable only after
`fsync` of the directory that holds it (POSIX: creating, renaming or removing an entry
changes the directory, not the file). Every place that creates a segment, a folder or a
snapshot, or renames one, goes through these helpers.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: str | Path) -> None:
    """Make the entries of directory `path` (created, renamed, removed files) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str | Path) -> Path:
    """mkdir -p, fsyncing the parent of every folder it creates (so the new names are durable)."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for folder in reversed(missing):
        folder.mkdir(exist_ok=True)
        fsync_dir(folder.parent)
    return path


def durable_rename(src: str | Path, dst: str | Path) -> None:
    """os.replace, then fsync the directories involved: after it returns, a power loss keeps `dst`."""
    src, dst = Path(src), Path(dst)
    os.replace(src, dst)
    fsync_dir(dst.parent)
    if src.parent != dst.parent:
        fsync_dir(src.parent)


def write_durably(path: str | Path, data: bytes) -> None:
    """Write `data` to a temp file beside `path`, fsync it, rename it over `path`, fsync the folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        durable_rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
