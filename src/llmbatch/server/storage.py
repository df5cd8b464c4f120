"""File contents: on local disk (default ``DATA_DIR/files``) or any fsspec location
(``s3://bucket/prefix``, ``gs://...``), one object per file id."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import IO

import fsspec


class FileStore:
    """Where file contents live; a local store writes beside the final name and renames."""

    def __init__(self, root: str):
        self.fs, self.root = fsspec.core.url_to_fs(root)
        self.local = self.fs.protocol in ("file", "local") or "file" in (self.fs.protocol or ())
        self.url_root = root.rstrip("/")
        self.fs.makedirs(self.root, exist_ok=True)

    def location(self, file_id: str) -> str:
        """The path or URL a job reads the file from."""
        return os.path.join(self.root, file_id) if self.local else f"{self.url_root}/{file_id}"

    def _path(self, file_id: str) -> str:
        return f"{self.root.rstrip('/')}/{file_id}"

    def writer(self, file_id: str) -> "Writer":
        """A file being written as ``file_id``: ``write`` chunks, then ``commit`` or ``abort``."""
        return Writer(self, file_id)

    def write(self, file_id: str, chunks: Iterator[bytes]) -> None:
        """Store ``chunks`` as ``file_id`` (nothing is left if the chunks raise)."""
        writer = self.writer(file_id)
        try:
            for chunk in chunks:
                writer.write(chunk)
            writer.commit()
        except BaseException:
            writer.abort()
            raise

    def put(self, local_path: str, file_id: str) -> None:
        """Store a local file (a batch's output) as ``file_id``."""
        if self.local:
            tmp = self._path(file_id) + ".tmp"
            shutil.copyfile(local_path, tmp)
            os.replace(tmp, self._path(file_id))
        else:
            self.fs.put_file(local_path, self._path(file_id))

    def remove_partial(self) -> int:
        """Remove the ``.tmp`` files a crashed server left in a local store; returns how many."""
        if not self.local:
            return 0
        removed = 0
        for entry in os.scandir(self.root):
            if entry.name.endswith(".tmp") and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                removed += 1
        return removed

    def open(self, file_id: str) -> IO[bytes]:
        return self.fs.open(self._path(file_id), "rb")

    def delete(self, file_id: str) -> None:
        if self.fs.exists(self._path(file_id)):
            self.fs.rm(self._path(file_id))


class Writer:
    """One file on its way into the store (a local store writes beside the final name)."""

    def __init__(self, store: FileStore, file_id: str):
        self.store = store
        self.target = store._path(file_id)
        self.tmp = self.target + ".tmp" if store.local else self.target
        self.fh = store.fs.open(self.tmp, "wb")
        self.bytes = 0

    def write(self, chunk: bytes) -> None:
        self.fh.write(chunk)
        self.bytes += len(chunk)

    def commit(self) -> None:
        if self.store.local:
            self.fh.flush()
            os.fsync(self.fh.fileno())
        self.fh.close()
        if self.store.local:
            os.replace(self.tmp, self.target)

    def abort(self) -> None:
        """Close and remove what was written (safe to call twice)."""
        try:
            self.fh.close()
        finally:
            if self.store.fs.exists(self.tmp):
                self.store.fs.rm(self.tmp)
