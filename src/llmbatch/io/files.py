"""Writing files that must survive a crash: complete or absent, never half written.

Every durable file llmbatch writes goes through here: the data is written beside its final
name, fsynced, renamed into place, and the folder is fsynced so the rename itself survives.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place (a hidden sibling)."""
    return path.with_name(f".{path.name}.tmp")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    tmp = temporary_name(path)
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, value: Any, indent: int | None = 2) -> None:
    atomic_write_bytes(path, json.dumps(value, indent=indent, default=str).encode())


def write_parquet_synced(table: pa.Table, path: str | os.PathLike) -> None:
    """Write a Parquet file and fsync it (the caller renames it into place)."""
    with open(path, "wb") as fh:
        pq.write_table(table, fh)
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_parquet(table: pa.Table, path: str | os.PathLike, replace: bool = True, sync_dir: bool = True) -> None:
    """Write ``path`` whole or not at all. ``replace=False`` publishes without replacing: a
    file already at ``path`` raises FileExistsError and stays as it was (a hard link is the
    no-replace rename; where the filesystem has no links, the check and the rename are two steps).
    ``sync_dir=False`` leaves the folder's fsync to the caller (one for several files)."""
    path = Path(path)
    tmp = temporary_name(path)
    write_parquet_synced(table, tmp)
    if replace:
        os.replace(tmp, path)
    else:
        publish_new(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)


def publish_new(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path`` unless ``path`` exists (FileExistsError; ``tmp`` is removed)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        tmp.unlink(missing_ok=True)
        raise
    except OSError:  # no hard links here (some FUSE and object-store mounts)
        if os.path.lexists(path):
            tmp.unlink(missing_ok=True)
            raise FileExistsError(errno.EEXIST, "exists", str(path)) from None
        os.rename(tmp, path)
        return
    tmp.unlink()
