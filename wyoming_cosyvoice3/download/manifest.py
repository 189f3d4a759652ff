"""Local verification records: which files of a download directory were checked, and how.

A record is written after a file was downloaded and its size and hash matched what the hub
reported. On later starts a file whose size and modification time still equal its record
counts as verified without reading it or touching the network; a file whose stat changed
is hashed again and compared with its record. Records live in
``<download_dir>/.cosyvoice3/manifest.json``.

Hash identities used by the hub (huggingface_hub ``file_download.py``, ``hf_hub_url``
docstring): the ETag of a Git LFS file is the SHA-256 of its content; the ETag of a regular
Git file is its Git blob id, SHA-1 over ``b"blob <size>\\0" + content``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

_LOGGER = logging.getLogger(__name__)

STATE_DIR_NAME = ".cosyvoice3"
"""Hidden directory inside the download directory: manifest and partial downloads."""
MANIFEST_VERSION = 1
HASH_BLOCK_BYTES = 8 * 1024 * 1024
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
GIT_SHA1_RE = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class FileRecord:
    """What was verified about one file.

    Attributes:
        repo_id, revision: where it came from (the revision as requested, e.g. ``main``).
        commit: the commit the hub resolved the revision to, or ``""`` when unknown.
        etag: the hub's normalised ETag (SHA-256 for LFS files, Git blob SHA-1 otherwise).
        size_bytes: file size.
        mtime_ns: modification time when verified (``os.stat().st_mtime_ns``).
        sha256: hex SHA-256 of the content, computed locally after the check.
    """

    repo_id: str
    revision: str
    commit: str
    etag: str
    size_bytes: int
    mtime_ns: int
    sha256: str


def normalize_etag(etag: str | None) -> str:
    """Strip the weak prefix and quotes of an HTTP ETag (``W/"abc"`` -> ``abc``)."""
    if not etag:
        return ""
    value = etag.strip()
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"').lower()


@dataclass(frozen=True)
class Digests:
    """Digests of a local file: hex SHA-256 and the Git blob SHA-1."""

    sha256: str
    git_sha1: str


def hash_file(path: Path) -> Digests:
    """Read ``path`` once and return its SHA-256 and Git blob SHA-1 (hex strings)."""
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    git_sha1 = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(HASH_BLOCK_BYTES), b""):
            sha256.update(block)
            git_sha1.update(block)
    return Digests(sha256.hexdigest(), git_sha1.hexdigest())


def etag_matches(etag: str, digests: Digests) -> bool | None:
    """Compare a hub ETag with local digests.

    Returns True or False when the ETag is a content hash (SHA-256 or Git SHA-1), and None
    when it is some other opaque tag that cannot be checked against the content.
    """
    if SHA256_RE.fullmatch(etag):
        return etag == digests.sha256
    if GIT_SHA1_RE.fullmatch(etag):
        return etag == digests.git_sha1
    return None


class Manifest:
    """Verification records of one download directory, kept in a JSON file.

    Writing replaces the file atomically; a missing or unreadable manifest is an empty one
    (the files are then verified again, online when possible).
    """

    def __init__(self, download_dir: Path) -> None:
        self.state_dir = download_dir / STATE_DIR_NAME
        self.path = self.state_dir / "manifest.json"
        self._records: dict[str, FileRecord] = {}
        self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as err:
            _LOGGER.warning("Ignoring unreadable download manifest %s: %s", self.path, err)
            return
        if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
            _LOGGER.warning("Ignoring download manifest %s of another version", self.path)
            return
        files = data.get("files")
        if not isinstance(files, dict):
            return
        for name, raw in files.items():
            try:
                self._records[str(name)] = FileRecord(**raw)
            except TypeError:
                _LOGGER.warning("Ignoring malformed manifest entry for %s", name)

    def get(self, filename: str) -> FileRecord | None:
        """Return the record of ``filename`` or None."""
        return self._records.get(filename)

    def put(self, filename: str, record: FileRecord) -> None:
        """Store a record and save the manifest (a write failure is logged, not raised)."""
        self._records[filename] = record
        self.save()

    def drop(self, filename: str) -> None:
        """Forget ``filename`` (it failed verification or was removed)."""
        if self._records.pop(filename, None) is not None:
            self.save()

    def save(self) -> None:
        """Write the manifest atomically; on a read-only directory only log a warning."""
        payload = {
            "version": MANIFEST_VERSION,
            "files": {name: asdict(rec) for name, rec in sorted(self._records.items())},
        }
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(payload, indent=1), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as err:
            _LOGGER.warning("Cannot write download manifest %s: %s", self.path, err)
            tmp.unlink(missing_ok=True)


def stat_matches(path: Path, record: FileRecord) -> bool:
    """True when ``path`` has the size and modification time stored in ``record``."""
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_size == record.size_bytes and st.st_mtime_ns == record.mtime_ns
