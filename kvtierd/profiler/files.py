"""One JSON file per context in a directory: crash-safe writes, names safe for any context id.

A file is written to a temporary name, fsynced, renamed over the old one and the directory is
fsynced, so after a crash a context has its old or its new file, never a torn one. Context ids
are arbitrary strings (LMCache keys, user names), so the file name is a hash of the id; the id
itself is stored inside the document, and a reload takes it from there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtierd.errors import CorruptObjectError

SUFFIX = ".json"


class JsonDir:
    """``directory/<sha256(context_id)[:32]>.json`` documents, each holding ``context_id``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def path(self, context_id: str) -> Path:
        digest = hashlib.sha256(context_id.encode()).hexdigest()[:32]
        return self.directory / f"{digest}{SUFFIX}"

    def write(self, context_id: str, doc: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.path(context_id)
        tmp = final.with_suffix(".tmp")
        data = json.dumps({**doc, "context_id": context_id}, sort_keys=True).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        dfd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def delete(self, context_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(context_id).unlink()

    def documents(self) -> Iterator[dict[str, Any]]:
        """Every stored document (leftover ``.tmp`` files of a crashed write are ignored)."""
        if not self.directory.is_dir():
            return
        for p in sorted(self.directory.glob(f"*{SUFFIX}")):
            yield self._load(p)

    @staticmethod
    def _load(p: Path) -> dict[str, Any]:
        try:
            doc = json.loads(p.read_bytes())
        except (OSError, ValueError) as e:
            raise CorruptObjectError(f"cannot read profiler file {p}: {e}") from e
        if not isinstance(doc, dict) or not isinstance(doc.get("context_id"), str):
            raise CorruptObjectError(f"{p}: not a profiler document (no context_id)")
        return doc
