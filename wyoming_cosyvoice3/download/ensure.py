"""``ensure_model``: make a download directory hold a complete, verified model directory.

Per file the states are: verified (record matches, nothing to do), missing, corrupt (its
record exists but the content changed: removed), unverified (present without a record:
placed by hand, or from another revision). Only missing, corrupt and unverified files lead
to network traffic, and only when the hub may be used.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from huggingface_hub import constants as hub_constants

from ..engine.errors import ModelFilesMissing
from .fetch import (
    NETWORK_ERRORS,
    RemoteFile,
    RemoteNotFound,
    fetch_metadata,
    partial_path,
    remove_stale_partials,
    transfer,
)
from .files import (
    DEFAULT_REVISION,
    EXPORT_REPO,
    UPSTREAM_REPO,
    HubSource,
    ModelFile,
    model_files,
)
from .manifest import FileRecord, Manifest, etag_matches, hash_file, stat_matches
from .progress import DownloadCancelled, format_bytes

_LOGGER = logging.getLogger(__name__)

MAX_ATTEMPTS_PER_FILE = 2
"""A file whose downloaded content fails its hash check is fetched once more, then reported."""
DISK_MARGIN_BYTES = 64 * 1024 * 1024
_DOWNLOAD_ERRORS: tuple[type[BaseException], ...] = (*NETWORK_ERRORS, OSError)
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}  # huggingface_hub constants.ENV_VARS_TRUE_VALUES


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set now or at hub import."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").upper() in _TRUE_VALUES:
            return True
    return bool(hub_constants.is_offline_mode())


def resolve_endpoint(endpoint: str | None = None) -> str:
    """The hub address: ``endpoint``, else ``HF_ENDPOINT`` read now, else the hub default."""
    value = endpoint or os.environ.get("HF_ENDPOINT") or hub_constants.ENDPOINT
    return value.rstrip("/")


def find_missing(download_dir: Path, precision: str = "int8") -> list[str]:
    """Names of the files of ``precision`` absent from ``download_dir`` (existence only, fast)."""
    return [f.filename for f in model_files(precision) if not (download_dir / f.filename).is_file()]


class DownloadUnavailable(ModelFilesMissing):
    """Model files are missing and could not be fetched now (code ``model-files-missing``).

    ``reason`` is one line saying why (hub unreachable, offline mode, not found, disk full,
    failed verification); the server retries later with backoff.
    """

    def __init__(self, model_dir: str, missing: list[str], hint: str, reason: str) -> None:
        super().__init__(model_dir, missing, hint)
        self.reason = reason


@dataclass
class _Plan:
    """What one ``ensure_model`` call found and still has to do."""

    missing: list[ModelFile] = field(default_factory=list)
    unverified: list[ModelFile] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)
    """filename -> why it could not be fetched (shown in the error)."""


def _check_local(
    download_dir: Path, files: list[ModelFile], source: HubSource, manifest: Manifest, verify: bool
) -> _Plan:
    plan = _Plan()
    for file in files:
        path = download_dir / file.filename
        if not path.is_file():
            plan.missing.append(file)
            continue
        record = manifest.get(file.filename)
        if record is None or (record.repo_id, record.revision) != source.repo_of(file):
            plan.unverified.append(file)
            continue
        if stat_matches(path, record) and not verify:
            continue
        size_bytes = path.stat().st_size
        if size_bytes == record.size_bytes:
            _LOGGER.info("Checking %s against its verification record", file.filename)
            digests = hash_file(path)
            if digests.sha256 == record.sha256:
                mtime_ns = path.stat().st_mtime_ns
                manifest.put(file.filename, replace(record, mtime_ns=mtime_ns))
                continue
            found = f"sha256 {digests.sha256}, expected {record.sha256}"
        else:
            found = f"{size_bytes} bytes, expected {record.size_bytes}"
        _LOGGER.warning("%s is corrupt (%s): removing it", path, found)
        _remove(path)
        manifest.drop(file.filename)
        plan.missing.append(file)
        plan.problems[file.filename] = "was corrupt and has been removed"
    return plan


def _remove(path: Path) -> None:
    """Delete a file known to be wrong; a read-only directory only earns a warning (the
    later placement of the downloaded file then fails with a clear error)."""
    try:
        path.unlink()
    except OSError as err:
        _LOGGER.warning("Cannot remove %s: %s", path, err)


def _by_hand_hint(
    reason: str,
    missing: list[ModelFile],
    source: HubSource,
    download_dir: Path,
    precision: str,
    problems: dict[str, str],
) -> str:
    lines = [f"{reason}. Get them by hand:"]
    for file in missing:
        note = f" ({problems[file.filename]})" if file.filename in problems else ""
        lines.append(f"  {file.filename}{note} <- {source.url_of(file)}")
    lines.append(
        f"and place them in {download_dir} under these names (voices/*.wav in its voices/ "
        f"directory), or run `python -m wyoming_cosyvoice3.download --download-dir "
        f"{download_dir} --llm-precision {precision}` on a machine with network access and "
        "copy the directory over"
    )
    return "\n".join(lines)


def _record(
    path: Path, remote: RemoteFile, source: HubSource, file: ModelFile, sha256: str
) -> FileRecord:
    repo_id, revision = source.repo_of(file)
    st = path.stat()
    return FileRecord(
        repo_id=repo_id,
        revision=revision,
        commit=remote.commit,
        etag=remote.etag,
        size_bytes=st.st_size,
        mtime_ns=st.st_mtime_ns,
        sha256=sha256,
    )


def _check_against_remote(path: Path, remote: RemoteFile) -> tuple[bool, str]:
    """Size and hash check of a local file against the hub; returns (ok, sha256)."""
    if remote.size_bytes is not None and path.stat().st_size != remote.size_bytes:
        return False, ""
    digests = hash_file(path)
    return etag_matches(remote.etag, digests) is not False, digests.sha256


def _download_one(
    download_dir: Path,
    file: ModelFile,
    remote: RemoteFile,
    source: HubSource,
    manifest: Manifest,
    *,
    token: str | bool | None,
    progress: bool | None,
    should_stop: Callable[[], bool] | None,
) -> str | None:
    """Fetch, verify and atomically place one file. Returns None, or why it failed."""
    part = partial_path(download_dir, file.filename, remote.etag)
    remove_stale_partials(download_dir, file.filename, keep=part)
    repo_id, revision = source.repo_of(file)
    for attempt in range(1, MAX_ATTEMPTS_PER_FILE + 1):
        _LOGGER.info(
            "Downloading %s (%s) from %s@%s",
            file.filename,
            format_bytes(remote.size_bytes) if remote.size_bytes is not None else "size unknown",
            repo_id,
            revision,
        )
        transfer(
            remote,
            part,
            label=file.filename,
            token=token,
            progress=progress,
            should_stop=should_stop,
        )
        ok, sha256 = _check_against_remote(part, remote)
        if ok:
            final = download_dir / file.filename
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, final)
            manifest.put(file.filename, _record(final, remote, source, file, sha256))
            _LOGGER.info("Verified and placed %s", final)
            return None
        _LOGGER.warning(
            "Downloaded %s does not match the hub's size/hash (etag %s), attempt %d of %d",
            file.filename,
            remote.etag,
            attempt,
            MAX_ATTEMPTS_PER_FILE,
        )
        part.unlink(missing_ok=True)
    return f"the downloaded content failed its hash check (etag {remote.etag})"


def ensure_model(
    download_dir: Path,
    precision: str = "int8",
    *,
    local_files_only: bool = False,
    export_repo: str = EXPORT_REPO,
    export_revision: str = DEFAULT_REVISION,
    upstream_repo: str = UPSTREAM_REPO,
    upstream_revision: str = DEFAULT_REVISION,
    endpoint: str | None = None,
    token: str | bool | None = None,
    progress: bool | None = None,
    verify: bool = False,
    should_stop: Callable[[], bool] | None = None,
) -> Path:
    """Make ``download_dir`` a complete model directory for ``precision`` and return it.

    The directory is laid out like the model directory the engine loads (flat, plus
    ``voices/``). Files verified earlier are trusted by size and modification time and no
    network is used when every file is present and verified. Missing files are downloaded
    (resuming partial downloads), checked against the hub's size and SHA-256 / Git SHA-1,
    and only then renamed to their final name.

    Args:
        download_dir: directory to fill (created when needed).
        precision: LLM precision, ``fp32``, ``int8`` or ``q4``.
        local_files_only: never use the network; present files are accepted as they are.
        export_repo, export_revision, upstream_repo, upstream_revision: the two sources.
        endpoint: hub address; default ``HF_ENDPOINT`` (read at call time) or huggingface.co.
        token: Hugging Face token (None: the hub's usual lookup; not needed for these repos).
        progress: True: progress bar; False: INFO log lines; None: bar only on a terminal.
        verify: hash every present file again (slow: reads about 2-4 GB).
        should_stop: polled between chunks; True stops with :class:`DownloadCancelled`.

    Raises:
        ValueError: unknown precision.
        DownloadUnavailable: (a ModelFilesMissing) files are missing and cannot be fetched
            (offline, hub unreachable, not found, hash mismatch, disk full); the message lists
            each with its URL, ``reason`` says why in one line.
        DownloadCancelled: ``should_stop`` returned True.
    """
    files = model_files(precision)
    download_dir = Path(download_dir).expanduser()
    source = HubSource(
        export_repo, export_revision, upstream_repo, upstream_revision, resolve_endpoint(endpoint)
    )
    manifest = Manifest(download_dir)
    plan = _check_local(download_dir, files, source, manifest, verify)
    if not plan.missing and not plan.unverified:
        _LOGGER.info("Model directory %s is complete (%d files verified)", download_dir, len(files))
        return download_dir

    def fail(reason: str, missing: list[ModelFile]) -> ModelFilesMissing:
        hint = _by_hand_hint(reason, missing, source, download_dir, precision, plan.problems)
        return DownloadUnavailable(str(download_dir.absolute()), [f.filename for f in missing],
                                   hint, reason)

    offline_reason = (
        "local_files_only is set"
        if local_files_only
        else "HF_HUB_OFFLINE is set"
        if hub_offline()
        else ""
    )
    if offline_reason:
        for file in plan.unverified:
            _LOGGER.warning("Using %s unverified (%s)", file.filename, offline_reason)
        if plan.missing:
            raise fail(f"cannot download ({offline_reason})", plan.missing)
        return download_dir

    # One HEAD per file that needs the hub: sizes, hashes and download locations.
    remotes: dict[str, RemoteFile] = {}
    to_fetch: list[ModelFile] = []
    not_found: list[ModelFile] = []
    for index, file in enumerate(plan.unverified + plan.missing):
        try:
            remote = fetch_metadata(source.url_of(file), token)
        except RemoteNotFound as err:
            if file in plan.unverified:
                _LOGGER.warning(
                    "Using %s unverified: the hub has no such file (%s)", file.filename, err
                )
            else:
                plan.problems[file.filename] = f"not on the hub: {err}"
                not_found.append(file)
            continue
        except NETWORK_ERRORS as err:
            for pending in (plan.unverified + plan.missing)[index:]:
                if pending in plan.unverified:
                    _LOGGER.warning("Using %s unverified: hub unreachable", pending.filename)
            still = _ordered(files, plan.missing + to_fetch + not_found)
            if still:
                reason = f"the Hugging Face Hub at {source.endpoint} is unreachable ({err})"
                raise fail(reason, still) from err
            return download_dir
        remotes[file.filename] = remote
        if file in plan.unverified:
            path = download_dir / file.filename
            ok, sha256 = _check_against_remote(path, remote)
            if ok:
                manifest.put(file.filename, _record(path, remote, source, file, sha256))
                _LOGGER.info("Verified %s against the hub", file.filename)
                continue
            _LOGGER.warning(
                "%s differs from %s on the hub: replacing it", path, source.url_of(file)
            )
            _remove(path)
        to_fetch.append(file)
    if not_found:
        raise fail(
            "some files are not available from the hub", _ordered(files, not_found + to_fetch)
        )

    if not to_fetch:
        return download_dir
    _check_disk_space(download_dir, to_fetch, remotes, fail)
    failed: list[ModelFile] = []
    for position, file in enumerate(to_fetch):
        if should_stop is not None and should_stop():
            raise DownloadCancelled("download stopped on request; the next start resumes it")
        try:
            problem = _download_one(
                download_dir,
                file,
                remotes[file.filename],
                source,
                manifest,
                token=token,
                progress=progress,
                should_stop=should_stop,
            )
        except _DOWNLOAD_ERRORS as err:
            plan.problems[file.filename] = f"download failed: {err}"
            raise fail(
                "the download failed (the partial file is kept; the next start resumes it)",
                _ordered(files, failed + to_fetch[position:]),
            ) from err
        if problem:
            plan.problems[file.filename] = problem
            failed.append(file)
    if failed:
        raise fail("downloaded files failed verification", failed)
    return download_dir


def _ordered(files: list[ModelFile], subset: list[ModelFile]) -> list[ModelFile]:
    chosen = {f.filename for f in subset}
    return [f for f in files if f.filename in chosen]


def _check_disk_space(
    download_dir: Path,
    to_fetch: list[ModelFile],
    remotes: dict[str, RemoteFile],
    fail: Callable[[str, list[ModelFile]], ModelFilesMissing],
) -> None:
    need = 0
    for file in to_fetch:
        remote = remotes[file.filename]
        part = partial_path(download_dir, file.filename, remote.etag)
        have = part.stat().st_size if part.is_file() else 0
        need += max((remote.size_bytes or 0) - have, 0)
    download_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(download_dir).free
    _LOGGER.info(
        "Downloading %d file(s), %s, into %s", len(to_fetch), format_bytes(need), download_dir
    )
    if need + DISK_MARGIN_BYTES > free:
        raise fail(
            f"not enough disk space: {format_bytes(need)} needed, {format_bytes(free)} free in "
            f"{download_dir}; free space or choose another download directory",
            to_fetch,
        )
