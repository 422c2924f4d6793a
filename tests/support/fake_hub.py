"""A hub of our own on 127.0.0.1 speaking the HTTP that huggingface_hub (and hub.models) send: search
(GET /api/models), model info with file metadata (GET /api/models/{repo}[/revision/{rev}]?blobs=true), and
HEAD / ranged GET of /{repo}/resolve/{rev}/{path} with X-Repo-Commit, ETag / X-Linked-Etag, X-Linked-Size,
Accept-Ranges and 206 answers. Faults on demand: drop the connection after N bytes of a file, advertise a wrong
sha256, answer 404, serve slowly, be killed with transfers in flight. Hostile answers on demand: any ETag, file name
or commit in place of the real one, a redirect loop, any model-info / search JSON, any file at any path."""

from __future__ import annotations

import functools
import hashlib
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")
CHUNK = 64 * 1024


@dataclass
class _File:
    source: Path
    size: int
    sha256: str
    blob_id: str  # git's blob sha1
    lfs: bool


@dataclass
class _Repo:
    id: str
    commit: str
    files: dict[str, _File]
    tags: list[str]
    config: dict | None
    gguf: dict | None
    safetensors: dict | None
    downloads: int


@dataclass
class Faults:
    drop_after: dict[str, int] = field(default_factory=dict)  # file path -> drop once at this byte offset
    wrong_hash: set[str] = field(default_factory=set)  # file paths whose advertised sha256 is wrong
    missing: set[str] = field(default_factory=set)  # file paths answered with 404 (still listed)
    seconds_per_chunk: float = 0.0  # slow transfers (for cancel tests)
    # -- a hostile hub ---------------------------------------------------------------------------------------
    etag: dict[str, str] = field(default_factory=dict)  # file path -> the ETag (and X-Linked-Etag) sent, verbatim
    rfilenames: dict[str, object] = field(default_factory=dict)  # file path -> the rfilename the listing gives
    commit: object = None  # the listing's sha and X-Repo-Commit for every repo (None: each repo's own)
    redirect_loop: set[str] = field(default_factory=set)  # file paths, or "api" (model info), redirected to themselves
    info: dict[str, object] = field(default_factory=dict)  # repo -> the model-info answer, any JSON (bytes: verbatim)
    search: object = None  # the search answer, any JSON (None: the real one)
    headers: dict[str, str] = field(default_factory=dict)  # sent by every file answer in place of its own
    any_file: Path | None = None  # answers every path nothing else does: the hub serves whatever name it listed


@functools.lru_cache(maxsize=64)
def _digests_of(path: Path, size: int, mtime_ns: int) -> tuple[str, str]:
    sha, git = hashlib.sha256(), hashlib.sha1()
    git.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            sha.update(block)
            git.update(block)
    return sha.hexdigest(), git.hexdigest()


def _digests(path: Path) -> tuple[str, str]:
    """(sha256, git blob sha1) of a file; remembered per size and mtime (the GGUF is hashed once a session)."""
    st = path.stat()
    return _digests_of(path.resolve(), st.st_size, st.st_mtime_ns)


def _any_file(source: Path, name: str) -> _File:
    """`source` served as `name` (an LFS file when the name says so)."""
    sha, blob_id = _digests(source)
    return _File(source, source.stat().st_size, sha, blob_id, name.endswith(LFS_SUFFIXES))


class FakeHub:
    def __init__(self, port: int = 0):
        self.repos: dict[str, _Repo] = {}
        self.faults = Faults()
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self._port = port
        self._server: ThreadingHTTPServer | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()

    # -- content ---------------------------------------------------------------------------------------------
    def add_repo(self, repo: str, files: dict[str, Path], *, tags, config=None, gguf=None, safetensors=None,
                 downloads: int = 0) -> None:
        entries = {}
        for name, source in files.items():
            sha, blob_id = _digests(Path(source))
            entries[name] = _File(Path(source), Path(source).stat().st_size, sha, blob_id, name.endswith(LFS_SUFFIXES))
        commit = hashlib.sha1(repo.encode() + b"".join(f.blob_id.encode() for f in entries.values())).hexdigest()
        self.repos[repo] = _Repo(repo, commit, entries, list(tags), config, gguf, safetensors, downloads)

    def advertised_sha256(self, path: str, f: _File) -> str:
        return hashlib.sha256(b"not this file" + f.sha256.encode()).hexdigest() if path in self.faults.wrong_hash \
            else f.sha256

    def commit_of(self, repo: _Repo | None):
        if self.faults.commit is not None:
            return self.faults.commit
        return repo.commit if repo is not None else "0" * 40

    def summary(self, repo: _Repo, with_files: bool) -> dict:
        item = {"id": repo.id, "modelId": repo.id, "sha": self.commit_of(repo), "tags": repo.tags,
                "downloads": repo.downloads, "likes": 0, "pipeline_tag": "text-generation", "private": False}
        for key in ("config", "gguf", "safetensors"):
            if getattr(repo, key) is not None:
                item[key] = getattr(repo, key)
        if with_files:
            item["siblings"] = [
                {"rfilename": self.faults.rfilenames.get(name, name), "size": f.size, "blobId": f.blob_id,
                 **({"lfs": {"size": f.size, "sha256": self.advertised_sha256(name, f), "pointerSize": 134}}
                    if f.lfs else {})}
                for name, f in repo.files.items()]
        return item

    # -- running ---------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = _Server(("127.0.0.1", self._port), Handler)
        self._server.daemon_threads = True
        self._port = self._server.server_address[1]  # a restart comes back on the same port
        threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True).start()
        return self

    def stop(self) -> None:
        """Killed, not drained: the listening socket closes and every open connection is cut."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            for s in list(self._sockets):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._server = None

    def ranged_gets(self, path: str) -> list[str | None]:
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + path)]


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        """A client that hung up (a cancel, a refused download) is no error of the hub's."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def setup(self):
        super().setup()
        with self.fake._lock:
            self.fake._sockets.add(self.connection)

    def finish(self):
        with self.fake._lock:
            self.fake._sockets.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def _send_json(self, status: int, body, headers: dict | None = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _not_found(self, code: str) -> None:
        self._send_json(404, {"error": code}, {"X-Error-Code": code})

    def do_HEAD(self):
        self._route()

    def do_GET(self):
        self._route()

    def _route(self):
        parts = urlsplit(self.path)
        raw = parts.path.lstrip("/").split("/")  # split before unquoting: a revision is quoted slashes and all
        path = unquote(parts.path)
        query = parse_qs(parts.query)
        self.fake.requests.append((self.command, path, self.headers.get("Range")))
        faults = self.fake.faults
        if path == "/api/models":
            if faults.search is not None:
                return self._send_json(200, faults.search)
            return self._search(query)
        if path.startswith("/api/models/"):
            rest = [unquote(p) for p in raw[2:]]
            repo_id, revision = "/".join(rest[:2]), (rest[3] if len(rest) >= 4 and rest[2] == "revision" else "main")
            if "api" in faults.redirect_loop:
                return self._redirect_to_itself()
            if repo_id in faults.info:
                return self._send_json(200, faults.info[repo_id])
            repo = self.fake.repos.get(repo_id)
            if repo is None:
                return self._not_found("RepoNotFound")
            if revision not in ("main", repo.commit, faults.commit):
                return self._not_found("RevisionNotFound")
            return self._send_json(200, self.fake.summary(repo, with_files=True))
        if len(raw) >= 5 and raw[2] == "resolve":
            return self._resolve("/".join(raw[:2]), unquote(raw[3]), unquote("/".join(raw[4:])))
        if faults.any_file is not None:  # a `../` name the client's URL normalization moved out of /resolve/
            return self._serve(None, PurePosixPath(path).name, _any_file(faults.any_file, path))
        self._not_found("RepoNotFound")

    def _redirect_to_itself(self) -> None:
        self.send_response(302)
        self.send_header("Location", self.path)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _search(self, query: dict) -> None:
        text = (query.get("search") or [""])[0].lower()
        wanted = set(query.get("filter", []))
        found = [r for r in self.fake.repos.values() if text in r.id.lower() and wanted <= set(r.tags)]
        found.sort(key=lambda r: -r.downloads)
        limit = int((query.get("limit") or [1000])[0])
        self._send_json(200, [self.fake.summary(r, with_files=False) for r in found[:limit]])

    def _resolve(self, repo_id: str, revision: str, name: str) -> None:
        faults = self.fake.faults
        if name in faults.redirect_loop:
            return self._redirect_to_itself()
        repo = self.fake.repos.get(repo_id)
        f = repo.files.get(name) if repo is not None else None
        if f is None and faults.any_file is not None:
            return self._serve(repo, name, _any_file(faults.any_file, name))
        if repo is None:
            return self._not_found("RepoNotFound")
        if revision not in ("main", repo.commit, faults.commit):
            return self._not_found("RevisionNotFound")
        if f is None or name in faults.missing:
            return self._not_found("EntryNotFound")
        self._serve(repo, name, f)

    def _serve(self, repo: _Repo | None, name: str, f: _File) -> None:
        faults = self.fake.faults
        start, end = 0, f.size - 1
        ranged = self.headers.get("Range")
        if ranged and ranged.startswith("bytes="):
            first, _, last = ranged[len("bytes="):].partition("-")
            start, end = int(first), min(int(last) if last else f.size - 1, f.size - 1)
            if start >= f.size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{f.size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        self.send_response(206 if ranged else 200)
        etag = f'"{self.fake.advertised_sha256(name, f) if f.lfs else f.blob_id}"'
        etag = faults.etag.get(name, etag)
        headers = {"X-Repo-Commit": str(self.fake.commit_of(repo)), "ETag": etag}
        if f.lfs:
            headers.update({"X-Linked-Etag": etag, "X-Linked-Size": str(f.size)})
        headers.update({"Accept-Ranges": "bytes", "Content-Length": str(end - start + 1)})
        if ranged:
            headers["Content-Range"] = f"bytes {start}-{end}/{f.size}"
        headers.update(faults.headers)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command == "HEAD":
            return
        drop_at = faults.drop_after.get(name)
        if drop_at is not None and start < drop_at:
            del faults.drop_after[name]  # once: the resume gets the rest
            end = drop_at - 1
        else:
            drop_at = None
        with open(f.source, "rb") as src:
            src.seek(start)
            left = end - start + 1
            try:
                while left > 0:
                    block = src.read(min(CHUNK, left))
                    self.wfile.write(block)
                    left -= len(block)
                    if faults.seconds_per_chunk:
                        time.sleep(faults.seconds_per_chunk)
                self.wfile.flush()
            except OSError:  # the client went away (a cancel) or the hub was killed
                self.close_connection = True
                return
        if drop_at is not None:  # the body is short of its Content-Length: cut the connection
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
