"""A local stand-in for the Hugging Face Hub's file endpoints, for offline download tests.

Two HTTP servers on 127.0.0.1 (ephemeral ports):

* the hub: ``HEAD|GET /{org}/{repo}/resolve/{revision}/{path}``. Regular ("git") files are
  answered directly (200, ``ETag`` = Git blob SHA-1, body on GET, Range honoured). LFS files
  (``.onnx``, ``.data``, ``.wav``) get a 302 to the CDN with ``X-Linked-Etag`` = SHA-256
  and ``X-Linked-Size``, as huggingface.co does. Every answer carries ``X-Repo-Commit``.
  Unknown repositories get 401 ``X-Error-Code: RepoNotFound``, unknown revisions 404
  ``RevisionNotFound``, unknown files 404 ``EntryNotFound``.
* the CDN: ``HEAD|GET /blobs/{sha256}`` with ``Range: bytes=<start>-`` support (206 +
  ``Content-Range``; 416 past the end).

These are the headers huggingface_hub 2.x reads in ``get_hf_file_metadata`` and
``http_get``. Faults can be injected per file name: drop the connection after N bytes
(once), stall after N bytes until released, serve wrong bytes (N times); or Range headers
can be ignored (200 with the whole file, as some proxies do). Every request is logged in
:attr:`HubMimic.requests`.
"""

from __future__ import annotations

import hashlib
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".onnx", ".data", ".wav")
STALL_LIMIT_S = 30.0
_RANGE_RE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass(frozen=True)
class Request:
    """One request the mimic received."""

    server: str  # "hub" or "cdn"
    method: str
    path: str
    range: str | None


@dataclass
class Faults:
    """Faults injected into the data-serving GET of a file (keyed by file name)."""

    drop_once_after: dict[str, int] = field(default_factory=dict)
    stall_after: dict[str, int] = field(default_factory=dict)
    wrong_bytes: dict[str, int] = field(default_factory=dict)  # name -> times left
    ignore_range: bool = False
    stalled: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


def git_blob_sha1(data: bytes) -> str:
    """Git blob id: SHA-1 over ``b"blob <size>\\0" + data``."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def is_lfs(filename: str) -> bool:
    return filename.endswith(LFS_SUFFIXES)


class HubMimic:
    """Serve ``repos`` (repo id -> {file name: bytes}) like the hub. Use as a context manager."""

    def __init__(self, repos: dict[str, dict[str, bytes]]) -> None:
        self.repos = repos
        self.commits = {
            repo: hashlib.sha1(repo.encode(), usedforsecurity=False).hexdigest() for repo in repos
        }
        self.blobs: dict[str, tuple[str, bytes]] = {}
        for files in repos.values():
            for name, data in files.items():
                self.blobs[hashlib.sha256(data).hexdigest()] = (name, data)
        self.faults = Faults()
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._hub = ThreadingHTTPServer(("127.0.0.1", 0), self._handler("hub"))
        self._cdn = ThreadingHTTPServer(("127.0.0.1", 0), self._handler("cdn"))
        for server in (self._hub, self._cdn):
            server.daemon_threads = True
        self._threads = [
            threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            for s in (self._hub, self._cdn)
        ]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._hub.server_address[1]}"

    @property
    def cdn(self) -> str:
        return f"http://127.0.0.1:{self._cdn.server_address[1]}"

    def start(self) -> HubMimic:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self.faults.release.set()
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()

    def __enter__(self) -> HubMimic:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def gets_of(self, filename: str) -> list[Request]:
        """Data-serving GETs (CDN blob or direct resolve) of ``filename``."""
        out = []
        for req in list(self.requests):
            if req.method != "GET":
                continue
            if req.server == "cdn":
                blob = self.blobs.get(req.path.rsplit("/", 1)[-1])
                if blob is not None and blob[0] == filename:
                    out.append(req)
            elif req.path.endswith("/" + filename):
                out.append(req)
        return out

    def _handler(self, server_name: str) -> type[BaseHTTPRequestHandler]:
        mimic = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                # Headers and body go out in separate writes: without this, Nagle's
                # algorithm and delayed ACKs add ~40 ms per response.
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, format: str, *args: object) -> None:  # quiet
                return None

            def do_HEAD(self) -> None:
                self._dispatch(send_body=False)

            def do_GET(self) -> None:
                self._dispatch(send_body=True)

            def _dispatch(self, send_body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                mimic.log(Request(server_name, self.command, path, self.headers.get("Range")))
                if server_name == "cdn":
                    self._serve_blob(path, send_body)
                else:
                    self._serve_resolve(path, send_body)

            def _empty(self, status: int, headers: dict[str, str]) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _serve_resolve(self, path: str, send_body: bool) -> None:
                match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if match is None:
                    self._empty(404, {})
                    return
                repo, revision, filename = match.groups()
                if repo not in mimic.repos:
                    self._empty(401, {"X-Error-Code": "RepoNotFound"})
                    return
                commit = mimic.commits[repo]
                if revision not in ("main", commit):
                    self._empty(404, {"X-Error-Code": "RevisionNotFound"})
                    return
                data = mimic.repos[repo].get(filename)
                if data is None:
                    self._empty(404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit})
                    return
                if is_lfs(filename):
                    sha = hashlib.sha256(data).hexdigest()
                    self._empty(
                        302,
                        {
                            "Location": f"{mimic.cdn}/blobs/{sha}",
                            "X-Repo-Commit": commit,
                            "ETag": f'"{git_blob_sha1(sha.encode())}"',
                            "X-Linked-Etag": f'"{sha}"',
                            "X-Linked-Size": str(len(data)),
                        },
                    )
                    return
                extra = {"X-Repo-Commit": commit, "ETag": f'"{git_blob_sha1(data)}"'}
                self._send_data(filename, data, send_body, extra)

            def _serve_blob(self, path: str, send_body: bool) -> None:
                blob = mimic.blobs.get(path.rsplit("/", 1)[-1])
                if not path.startswith("/blobs/") or blob is None:
                    self._empty(404, {})
                    return
                self._send_data(blob[0], blob[1], send_body, {})

            def _send_data(
                self, filename: str, data: bytes, send_body: bool, extra: dict[str, str]
            ) -> None:
                faults = mimic.faults
                if send_body and faults.wrong_bytes.get(filename, 0) > 0:
                    faults.wrong_bytes[filename] -= 1
                    data = bytes(b ^ 0x5A for b in data)
                start = 0
                status = 200
                range_header = self.headers.get("Range")
                match = _RANGE_RE.match(range_header or "")
                if match is not None and not faults.ignore_range:
                    start = int(match.group(1))
                    if start >= len(data):
                        self._empty(416, {"Content-Range": f"bytes */{len(data)}"})
                        return
                    status = 206
                body = data[start:]
                self.send_response(status)
                for key, value in extra.items():
                    self.send_header(key, value)
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not send_body:
                    return
                cut = faults.drop_once_after.pop(filename, None)
                stall = faults.stall_after.get(filename)
                if cut is not None or stall is not None:
                    keep = max((cut if cut is not None else stall or 0) - start, 0)
                    self.wfile.write(body[:keep])
                    self.wfile.flush()
                    if stall is not None and cut is None:
                        faults.stalled.set()
                        faults.release.wait(STALL_LIMIT_S)
                    self.close_connection = True
                    return
                self.wfile.write(body)

        return Handler


def repos_from_dir(
    model_dir: Path, export_repo: str, upstream_repo: str
) -> dict[str, dict[str, bytes]]:
    """Split the files of a (synthetic) model directory into the two hub repositories."""
    from wyoming_cosyvoice3.download.files import UPSTREAM_FILES

    export: dict[str, bytes] = {}
    upstream: dict[str, bytes] = {}
    for path in sorted(model_dir.rglob("*")):
        if not path.is_file() or any(
            part.startswith(".") for part in path.relative_to(model_dir).parts
        ):
            continue
        name = path.relative_to(model_dir).as_posix()
        (upstream if name in UPSTREAM_FILES else export)[name] = path.read_bytes()
    return {export_repo: export, upstream_repo: upstream}


BIG_FILE_BYTES = 12_000_000
"""Size of the synthetic LLM ``.data`` file: larger than the hub client's 10 MiB read chunk
(``constants.DOWNLOAD_CHUNK_SIZE``), so a transfer cut after 11 MB leaves a 10 MiB partial."""
CHUNK_BYTES = 10 * 1024 * 1024


def make_repos(precision: str = "int8", seed: int = 0) -> dict[str, dict[str, bytes]]:
    """Random contents for every file of ``precision`` (and the other LLM variants), split
    into the export and upstream repositories. LLM ``.data`` files are ``BIG_FILE_BYTES``
    long, every other file a few kB; ``tokenizer.json`` is a regular (non-LFS) file."""
    import random

    from wyoming_cosyvoice3.download import EXPORT_REPO, UPSTREAM_REPO, model_files
    from wyoming_cosyvoice3.engine.options import LLM_FILES

    rng = random.Random(seed)
    repos: dict[str, dict[str, bytes]] = {EXPORT_REPO: {}, UPSTREAM_REPO: {}}
    for prec in [precision, *(p for p in LLM_FILES if p != precision)]:
        for file in model_files(prec):
            size = BIG_FILE_BYTES if file.filename.endswith(".data") else rng.randint(2000, 9000)
            repo = UPSTREAM_REPO if file.source == "upstream" else EXPORT_REPO
            repos[repo].setdefault(file.filename, rng.randbytes(size))
    return repos


def content_of(repos: dict[str, dict[str, bytes]], filename: str) -> bytes:
    """The bytes a repository of ``repos`` holds under ``filename``."""
    for files in repos.values():
        if filename in files:
            return files[filename]
    raise KeyError(filename)


def closed_endpoint() -> str:
    """An http://127.0.0.1 address with nobody listening (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
