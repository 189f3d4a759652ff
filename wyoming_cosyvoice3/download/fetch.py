"""Talking to the Hugging Face Hub: file metadata and resumable transfers.

Built on huggingface_hub 2.x public functions: ``get_hf_file_metadata`` (a HEAD on
``{endpoint}/{repo}/resolve/{revision}/{file}``; it reads ``X-Repo-Commit``,
``X-Linked-Etag``/``ETag`` and ``X-Linked-Size``/``Content-Length`` and stops at a redirect
to another host, the CDN) and ``file_download.http_get`` (a streaming GET that sends
``Range: bytes=<n>-`` when resuming, retries dropped connections in-process with a Range
request, restarts when a server ignores the Range, and checks the final size).

Why not ``hf_hub_download(local_dir=...)``: in huggingface_hub 2.x it downloads into a
process-unique temporary file and deletes it when the transfer fails, so a download cut by a
restart starts again from zero. Here the partial file has a stable name
(``.cosyvoice3/partial/<file>.<etag>.part``) and the next start resumes it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import constants as hub_constants
from huggingface_hub import get_hf_file_metadata
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers

from .manifest import STATE_DIR_NAME, normalize_etag
from .progress import ProgressFile, make_reporter

_LOGGER = logging.getLogger(__name__)


NETWORK_ERRORS: tuple[type[BaseException], ...] = (httpx2.HTTPError, ConnectionError)
"""Transport failures, HTTP errors (``HfHubHTTPError`` derives from ``httpx2.HTTPError``) and
the hub's ``OfflineModeIsEnabled`` (a ``ConnectionError``)."""
NOT_FOUND_ERRORS: tuple[type[BaseException], ...] = (
    RepositoryNotFoundError,  # also GatedRepoError
    RevisionNotFoundError,
    EntryNotFoundError,
)


def disable_hub_telemetry() -> None:
    """Keep huggingface_hub from contacting anything but the files' addresses.

    huggingface_hub 2.x builds its User-Agent with ``detect_agent()``, which fetches
    ``{HF_ENDPOINT at import}/api/agent-harnesses`` once a day unless
    ``HF_HUB_DISABLE_TELEMETRY`` is set (``utils/_headers.py _http_user_agent``). A home
    server has no use for that request, and with a mirror endpoint it would still go to the
    import-time address. Set here at call time (the hub reads the constant on every call)
    unless the user set ``HF_HUB_DISABLE_TELEMETRY`` explicitly.
    """
    if "HF_HUB_DISABLE_TELEMETRY" not in os.environ:
        hub_constants.HF_HUB_DISABLE_TELEMETRY = True


class RemoteNotFound(Exception):
    """The hub answered but has no such repository, revision or file (or it is gated)."""


@dataclass(frozen=True)
class RemoteFile:
    """Metadata the hub reports for one file.

    Attributes:
        url: the address to GET (the CDN location when the hub redirects).
        etag: normalised ETag: SHA-256 (LFS) or Git blob SHA-1 (regular file).
        commit: commit id the revision resolved to.
        size_bytes: file size, or None when the hub did not say.
        same_host: whether ``url`` is on the hub host itself (auth header may be sent).
    """

    url: str
    etag: str
    commit: str
    size_bytes: int | None
    same_host: bool


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


def fetch_metadata(resolve_url: str, token: str | bool | None = None) -> RemoteFile:
    """HEAD ``resolve_url`` and return what the hub says about the file.

    Raises:
        RemoteNotFound: no such repository / revision / file, or gated.
        NETWORK_ERRORS: the hub is unreachable or answered with another HTTP error.
    """
    disable_hub_telemetry()
    try:
        meta = get_hf_file_metadata(
            resolve_url, token=token, timeout=hub_constants.HF_HUB_ETAG_TIMEOUT
        )
    except NOT_FOUND_ERRORS as err:
        raise RemoteNotFound(str(err).splitlines()[0]) from err
    except HfHubHTTPError as err:
        if err.response is not None and err.response.status_code == 404:
            raise RemoteNotFound(str(err).splitlines()[0]) from err
        raise
    etag = normalize_etag(meta.etag)
    if not etag or not meta.commit_hash:
        raise httpx2.DecodingError(
            f"{resolve_url} answered without ETag / X-Repo-Commit headers: "
            "the endpoint is not a Hugging Face Hub (check HF_ENDPOINT and proxies)"
        )
    location = meta.location or resolve_url
    return RemoteFile(
        url=location,
        etag=etag,
        commit=meta.commit_hash,
        size_bytes=meta.size,
        same_host=_origin(location) == _origin(resolve_url),
    )


def _version_tag(etag: str) -> str:
    """Up to 16 alphanumeric characters of the ETag, safe in a file name."""
    return re.sub(r"[^0-9A-Za-z]", "", etag)[:16] or "unknown"


def partial_path(download_dir: Path, filename: str, etag: str) -> Path:
    """Stable name of the partial download of ``filename`` at version ``etag``."""
    return download_dir / STATE_DIR_NAME / "partial" / f"{filename}.{_version_tag(etag)}.part"


def remove_stale_partials(download_dir: Path, filename: str, keep: Path | None) -> None:
    """Delete partial downloads of ``filename`` of other versions than ``keep``."""
    folder = partial_path(download_dir, filename, "x").parent
    if not folder.is_dir():
        return
    pattern = re.compile(re.escape(Path(filename).name) + r"\.[0-9A-Za-z]{1,16}\.part")
    for candidate in folder.iterdir():
        if candidate != keep and pattern.fullmatch(candidate.name):
            _LOGGER.info("Removing stale partial download %s", candidate)
            candidate.unlink(missing_ok=True)


def transfer(
    remote: RemoteFile,
    part: Path,
    *,
    label: str,
    token: str | bool | None = None,
    progress: bool | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> None:
    """Download ``remote`` into ``part``, resuming from the bytes ``part`` already holds.

    On return ``part`` holds ``remote.size_bytes`` bytes (checked by ``http_get``); its
    content is not verified here. A failure leaves ``part`` in place for the next attempt.

    Raises:
        NETWORK_ERRORS / OSError: transfer failed after the hub client's retries.
        DownloadCancelled: ``should_stop`` returned True.
    """
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if remote.size_bytes is not None and have > remote.size_bytes:
        _LOGGER.warning("Partial file %s is larger than %s; starting over", part, label)
        part.unlink()
        have = 0
    if remote.size_bytes is not None and have == remote.size_bytes:
        return
    headers = build_hf_headers(token=token if remote.same_host else False)
    if have:
        _LOGGER.info("Resuming %s at byte %d", label, have)
    reporter = make_reporter(progress, label, remote.size_bytes, have)
    try:
        with part.open("r+b" if have else "wb") as stream:
            stream.seek(have)
            http_get(
                remote.url,
                ProgressFile(stream, reporter, should_stop),  # type: ignore[arg-type]
                resume_size=have,
                headers=headers,
                expected_size=remote.size_bytes,
                displayed_filename=label,
                tqdm_class=_SilentBar,
            )
    finally:
        reporter.close()


class _SilentBar:
    """Stand-in for the hub's own progress bar (our reporter draws or logs instead)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.n = 0

    def __enter__(self) -> _SilentBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: float | None = 1) -> None:
        return None

    def close(self) -> None:
        return None
