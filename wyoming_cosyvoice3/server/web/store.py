"""The writable voice catalog of the voice page: ``<first data dir>/voices.yaml`` and its clips.

Every change is made under two locks and written atomically, so concurrent edits (two browser
tabs, two requests at once, even two server processes on one data dir) cannot corrupt the
catalog and a crash leaves either the old or the new file, never half of one:

* an exclusive ``fcntl.flock`` on ``<data dir>/.voices.yaml.lock`` around read-modify-write
  (callers also serialise on an ``asyncio.Lock``, see ``admin.py``);
* the new text goes to a temporary file in the same directory, is flushed and ``fsync``-ed,
  then ``os.replace``-d over the old file (atomic on POSIX); the directory is ``fsync``-ed.

Clips are written the same way under ``<data dir>/clips/`` with a name made from the voice
name (already validated against ``catalog.VOICE_NAME_RE``) and an extension chosen from the
decoded format, never from anything the client sent; an existing file is never overwritten
(``os.link`` fails on an existing name, the next free ``NAME-2.ext`` ... is tried).

The file is rewritten with ``yaml.safe_dump``: entries keep every key, but YAML comments of a
hand-written file are not kept; the previous version is kept as ``voices.yaml.bak``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from ..catalog import CATALOG_FILE_NAME, MAX_CATALOG_BYTES, MAX_CATALOG_VOICES
from .errors import Conflict, PageError

CLIPS_DIR_NAME = "clips"
"""Folder of the first data dir that clips added by the page are written to."""
LOCK_FILE_NAME = ".voices.yaml.lock"
BACKUP_SUFFIX = ".bak"
MAX_CLIP_NAME_TRIES = 100
"""Free clip names tried (``NAME.ext``, ``NAME-2.ext``...) before giving up."""
CATALOG_HEADER = (
    "# Voices of wyoming-cosyvoice3 (see README, Voices). Written by the voice page;\n"
    "# hand edits are fine (comments are not kept when the page saves).\n"
)

Items = list[Any]
"""The ``voices:`` list of a catalog file (mappings as read by ``yaml.safe_load``)."""


class CatalogStore:
    """Reads and atomically rewrites one catalog file and stores clips next to it.

    Args:
        data_dir: the first data dir (``Settings.data_dirs[0]``); created when missing.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.path = data_dir / CATALOG_FILE_NAME
        self.clips_dir = data_dir / CLIPS_DIR_NAME
        self.lock_path = data_dir / LOCK_FILE_NAME

    # --- locking and reading -------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the catalog's file lock (blocking; other processes wait their turn)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def read_items(self) -> Items:
        """The file's ``voices`` list (empty when the file does not exist).

        Raises:
            Conflict: the file exists but cannot be read or parsed, or has no ``voices``
                list; the page refuses to rewrite it (that would lose the user's entries).
        """
        if not self.path.exists():
            return []
        try:
            if self.path.stat().st_size > MAX_CATALOG_BYTES:
                raise ValueError(f"it is larger than {MAX_CATALOG_BYTES} bytes")
            document = yaml.safe_load(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError, yaml.YAMLError) as err:
            raise Conflict(
                f"{self.path} cannot be read ({_one_line(err)}); fix or move it by hand, "
                "then try again"
            ) from err
        if document is None:
            return []
        items = document.get("voices") if isinstance(document, dict) else None
        if not isinstance(items, list):
            raise Conflict(f"{self.path} has no top-level 'voices:' list; fix it by hand first")
        return items

    # --- writing ---------------------------------------------------------------------------

    def update(self, change: Callable[[Items], Items]) -> Items:
        """Read the list, apply ``change`` to it and write the result atomically.

        ``change`` runs under the file lock and may raise :class:`PageError` to abort
        (nothing is written then).

        Returns:
            The list as written.

        Raises:
            PageError: from ``change``; Conflict when the file is unreadable or the result
                exceeds the catalog limits (256 voices, 1 MiB).
            OSError: the file could not be written (the old one is intact).
        """
        with self.locked():
            items = change(list(self.read_items()))
            if len(items) > MAX_CATALOG_VOICES:
                raise Conflict(f"{self.path} would list {len(items)} voices; the limit is "
                               f"{MAX_CATALOG_VOICES}: delete voices you no longer use")
            text = CATALOG_HEADER + yaml.safe_dump(
                {"voices": items}, allow_unicode=True, sort_keys=False, width=100
            )
            data = text.encode("utf-8")
            if len(data) > MAX_CATALOG_BYTES:
                raise Conflict(f"{self.path} would be larger than {MAX_CATALOG_BYTES} bytes; "
                               "shorten transcripts or delete voices")
            if self.path.exists():
                with contextlib.suppress(OSError):
                    _atomic_write(self.path.with_name(self.path.name + BACKUP_SUFFIX),
                                  self.path.read_bytes())
            _atomic_write(self.path, data)
            return items

    def write_clip(self, stem: str, extension: str, data: bytes) -> str:
        """Store a clip as ``clips/<stem>.<extension>`` (or the next free ``<stem>-N``).

        Args:
            stem: a validated voice name (ASCII letters, digits, ``._-``).
            extension: ``wav``, ``flac``, ``ogg`` or ``mp3`` (from the decoded format).
            data: the clip file's bytes.

        Returns:
            The path relative to the data dir, as written into ``voices.yaml``.

        Raises:
            PageError: no free name among the first 100.
            OSError: the disk refused the write.
        """
        self.clips_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=self.clips_dir, prefix=".upload-", suffix=".tmp")
        tmp = Path(tmp_name)
        try:
            os.fchmod(fd, _file_mode(None))
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            for attempt in range(1, MAX_CLIP_NAME_TRIES + 1):
                name = f"{stem}.{extension}" if attempt == 1 else f"{stem}-{attempt}.{extension}"
                try:
                    os.link(tmp, self.clips_dir / name)  # fails when the name exists
                except FileExistsError:
                    continue
                _fsync_dir(self.clips_dir)
                return f"{CLIPS_DIR_NAME}/{name}"
        finally:
            tmp.unlink(missing_ok=True)
        raise PageError(f"no free file name for {stem}.{extension} in {self.clips_dir}; "
                        "delete old clips there")

    def managed_clip(self, clip: object) -> Path | None:
        """The file of a ``clip`` value written by :meth:`write_clip` (``clips/NAME``), or
        None for any other value (clips placed by hand elsewhere are never deleted)."""
        if not isinstance(clip, str):
            return None
        parts = clip.split("/")
        if len(parts) != 2 or parts[0] != CLIPS_DIR_NAME or parts[1] in ("", ".", ".."):
            return None
        path = self.clips_dir / parts[1]
        return path if path.is_file() and not path.is_symlink() else None

    def remove_clip_if_unused(self, clip: object, items: Items) -> bool:
        """Delete a page-managed clip that no entry of ``items`` refers to any more."""
        path = self.managed_clip(clip)
        if path is None:
            return False
        if any(isinstance(item, dict) and item.get("clip") == clip for item in items):
            return False
        path.unlink(missing_ok=True)
        return True


def _file_mode(path: Path | None) -> int:
    """The permission bits for a new file: those of ``path`` when it exists, else 0644."""
    if path is not None:
        with contextlib.suppress(OSError):
            return path.stat().st_mode & 0o777
    return 0o644


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file + fsync + ``os.replace`` (the file
    keeps its permission bits)."""
    mode = _file_mode(path)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system supports it
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())
