"""A small Hugging Face Hub-compatible HTTP server for tests.

It speaks the subset of the Hub protocol that ``huggingface_hub`` 2.x uses for repos, commits (regular, LFS basic
and LFS multipart), downloads (with ``Range``), tree listings, refs, branches and tags (see
``shared/hub-protocol.md`` §1.9), so the real, unmodified client can be driven against it offline. State is kept in
memory (repos, commits, refs); file contents live in a content-addressed blob directory (``<root>/blobs/<sha256>``).

Test-only features:

- ``cdn=True``: LFS files resolve with a ``302`` to ``http://localhost:<port>/cdn/<sha256>``, a different origin
  than ``http://127.0.0.1:<port>``, like the real Hub's CDN.
- ``multipart_threshold``: LFS uploads at least that large use the multipart transfer (part ETags + completion).
- Fault injection (:class:`Fault`): cut a response body after K bytes, answer a status (e.g. 500) on the n-th
  request matching a pattern, or delay responses.
- A request log (:attr:`FakeHub.log`) that tests inspect: method, path, headers, status and body bytes sent.

Example:

```python
>>> hub = FakeHub(tmp_path)
>>> hub.start()
>>> hub.endpoint
'http://127.0.0.1:54321'
>>> hub.stop()
```
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["Fault", "FakeHub", "FileEntry", "RequestRecord"]

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".npy", ".npz",
                ".gz", ".zip", ".tar", ".parquet", ".arrow", ".model")
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024
STREAM_CHUNK = 64 * 1024
REPO_TYPES = ("model", "dataset", "space")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob holding ``data``."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git-lfs pointer file that stands in for an LFS object in git."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class FileEntry:
    """One file of a commit: its blob (by sha256) and its git identity."""

    path: str
    size: int
    sha256: str
    lfs: bool

    @property
    def git_oid(self) -> str:
        if self.lfs:
            return git_blob_sha1(lfs_pointer(self.sha256, self.size))
        return self._regular_oid

    _regular_oid: str = ""

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid

    def tree_entry(self) -> dict:
        entry: dict = {"type": "file", "oid": self.git_oid, "size": self.size, "path": self.path}
        if self.lfs:
            pointer = lfs_pointer(self.sha256, self.size)
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": len(pointer)}
        return entry


@dataclass
class Commit:
    oid: str
    parent: str | None
    files: dict[str, FileEntry]
    title: str
    message: str
    date: str


@dataclass
class Repo:
    repo_id: str
    repo_type: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)
    created_at: str = field(default_factory=_now)
    pr_count: int = 0


@dataclass
class Fault:
    """A fault the server injects into matching requests.

    Args:
        path_regex (`str`): matched with ``re.search`` against the request path (including the query string).
        method (`str`, *optional*): only requests with this method (default any).
        kind (`str`): ``"status"`` answers ``status`` instead of the real response; ``"cut"`` sends the real
            headers but only ``cut_after`` body bytes, then closes the connection; ``"slow"`` sleeps ``delay``
            seconds before answering.
        nth (`int`): the first matching request (1-based) the fault fires on.
        times (`int` or `None`): how many consecutive matching requests it fires on from ``nth`` (``None``: all).
    """

    path_regex: str
    method: str | None = None
    kind: str = "status"
    nth: int = 1
    times: int | None = 1
    status: int = 500
    cut_after: int = 0
    delay: float = 0.0
    seen: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("status", "cut", "slow"):
            raise ValueError(f"Fault.kind must be 'status', 'cut' or 'slow', got {self.kind!r}.")
        if self.nth < 1:
            raise ValueError(f"Fault.nth is 1-based, got {self.nth}.")

    def matches(self, method: str, path: str) -> bool:
        """Count a request and say whether the fault fires on it."""
        if self.method is not None and method != self.method:
            return False
        if not re.search(self.path_regex, path):
            return False
        self.seen += 1
        if self.seen < self.nth or (self.times is not None and self.fired >= self.times):
            return False
        self.fired += 1
        return True


@dataclass
class RequestRecord:
    """One request as the server saw it."""

    method: str
    path: str
    headers: dict[str, str]
    status: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    fault: str | None = None
    started: float = field(default_factory=time.monotonic)  # when the server began handling it
    ended: float = 0.0  # when it finished answering

    @property
    def range(self) -> str | None:
        return self.headers.get("range")


class HubHTTPError(Exception):
    """Raised inside handlers to answer an error status."""

    def __init__(self, status: int, message: str, *, code: str | None = None, headers: dict | None = None,
                 body: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.headers = headers or {}
        self.body = body


class FakeHub:
    """The server: in-memory repos, a blob directory, fault injection and a request log.

    Args:
        root (`Path`): directory for blobs and temporary upload parts.
        cdn (`bool`): answer LFS resolves with a cross-origin 302 to ``http://localhost:<port>/cdn/...``.
        multipart_threshold (`int`, *optional*): LFS objects at least this large are uploaded in parts.
        multipart_chunk_size (`int`): part size of multipart uploads.
        page_size (`int`): entries per tree page (``Link: rel="next"`` pagination).
    """

    def __init__(self, root: str | os.PathLike, *, cdn: bool = False, multipart_threshold: int | None = None,
                 multipart_chunk_size: int = 5 * 1024 * 1024, page_size: int = 1000) -> None:
        self.root = Path(root)
        self.blob_dir = self.root / "blobs"
        self.tmp_dir = self.root / "tmp"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.cdn = cdn
        self.multipart_threshold = multipart_threshold
        self.multipart_chunk_size = multipart_chunk_size
        self.page_size = page_size
        self.repos: dict[tuple[str, str], Repo] = {}
        self.faults: list[Fault] = []
        self.log: list[RequestRecord] = []
        self.lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> FakeHub:
        """Serve on ``127.0.0.1`` on a free port, in a daemon thread."""
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fakehub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and join the server thread."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=10)
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("FakeHub is not started.")
        return self._server.server_address[1]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cdn_endpoint(self) -> str:
        return f"http://localhost:{self.port}"

    # ----------------------------------------------------------------------------------------------- test helpers
    def add_fault(self, fault: Fault) -> Fault:
        with self.lock:
            self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self.lock:
            self.faults.clear()

    def clear_log(self) -> None:
        with self.lock:
            self.log.clear()

    def requests(self, method: str | None = None, path_regex: str | None = None) -> list[RequestRecord]:
        """Logged requests, optionally filtered by method and a path regex."""
        with self.lock:
            records = list(self.log)
        return [r for r in records if (method is None or r.method == method)
                and (path_regex is None or re.search(path_regex, r.path))]

    def repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        return self.repos[(repo_type, repo_id)]

    def head(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> Commit:
        repo = self.repo(repo_id, repo_type)
        return repo.commits[self._resolve_revision(repo, revision)]

    def read_file(self, repo_id: str, path: str, revision: str = "main", repo_type: str = "model") -> bytes:
        entry = self.head(repo_id, revision, repo_type).files[path]
        return (self.blob_dir / entry.sha256).read_bytes()

    # ----------------------------------------------------------------------------------------------- model
    def _store_blob(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        target = self.blob_dir / digest
        if not target.exists():
            tmp = self.tmp_dir / f"{digest}.{uuid.uuid4().hex}"
            tmp.write_bytes(data)
            os.replace(tmp, target)
        return digest

    def _blob_exists(self, sha256: str, size: int | None = None) -> bool:
        path = self.blob_dir / sha256
        return path.exists() and (size is None or path.stat().st_size == size)

    def _new_commit(self, repo: Repo, parent: str | None, files: dict[str, FileEntry], title: str,
                    message: str = "") -> Commit:
        seed = json.dumps([parent, sorted((p, f.sha256) for p, f in files.items()), title, uuid.uuid4().hex])
        commit = Commit(hashlib.sha1(seed.encode()).hexdigest(), parent, files, title, message, _now())
        repo.commits[commit.oid] = commit
        return commit

    def _resolve_revision(self, repo: Repo, revision: str) -> str:
        if revision in repo.branches:
            return repo.branches[revision]
        if revision in repo.tags:
            return repo.tags[revision]
        if revision.startswith("refs/heads/") and revision[11:] in repo.branches:
            return repo.branches[revision[11:]]
        if revision.startswith("refs/tags/") and revision[10:] in repo.tags:
            return repo.tags[revision[10:]]
        if revision in repo.commits:
            return revision
        raise HubHTTPError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")

    def create_repo_direct(self, repo_id: str, repo_type: str = "model", private: bool = False) -> Repo:
        """Create a repo with one empty commit on ``main`` (what the Hub does on creation)."""
        with self.lock:
            repo = Repo(repo_id, repo_type, private)
            repo.branches["main"] = self._new_commit(repo, None, {}, "initial commit").oid
            self.repos[(repo_type, repo_id)] = repo
            return repo

    def file_entry(self, path: str, data: bytes, *, lfs: bool | None = None) -> FileEntry:
        if lfs is None:
            lfs = self.is_lfs(path, len(data))
        sha = self._store_blob(data)
        return FileEntry(path, len(data), sha, lfs, _regular_oid="" if lfs else git_blob_sha1(data))

    @staticmethod
    def is_lfs(path: str, size: int) -> bool:
        return size > 0 and (path.endswith(LFS_SUFFIXES) or size >= LFS_SIZE_THRESHOLD)

    def url_for(self, repo: Repo) -> str:
        prefix = "" if repo.repo_type == "model" else f"{repo.repo_type}s/"
        return f"{self.endpoint}/{prefix}{repo.repo_id}"


class _Handler(BaseHTTPRequestHandler):
    """Routes requests to the ``FakeHub`` state (one instance per request)."""

    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - silence stderr logging
        logger.debug("fakehub: " + format, *args)

    # ----------------------------------------------------------------------------------------------- plumbing
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        record = RequestRecord(method, self.path, {k.lower(): v for k, v in self.headers.items()})
        self.record = record
        self.cut_after: int | None = None
        with self.hub.lock:
            self.hub.log.append(record)
            faults = [f for f in self.hub.faults if f.matches(method, self.path)]
        self._body: bytes | None = None
        try:
            for fault in faults:
                record.fault = fault.kind
                if fault.kind == "slow":
                    time.sleep(fault.delay)
                elif fault.kind == "cut":
                    self.cut_after = fault.cut_after
                elif fault.kind == "status":
                    self._read_body()
                    raise HubHTTPError(fault.status, f"Injected fault {fault.status}")
            _route(self, method)
        except HubHTTPError as err:
            self._send_error(err)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            record.ended = time.monotonic()

    def _read_body(self) -> bytes:
        if self._body is not None:
            return self._body
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            self._body = b"".join(chunks)
        else:
            self._body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.record.bytes_received = len(self._body)
        return self._body

    def json_body(self) -> dict:
        raw = self._read_body()
        try:
            return json.loads(raw or b"{}")
        except json.JSONDecodeError as err:
            raise HubHTTPError(400, f"Invalid JSON body: {err}") from None

    def send(self, status: int, body: bytes | dict | list = b"", headers: dict | None = None,
             content_type: str = "application/json") -> None:
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        self._read_body()
        self.send_response(status)
        all_headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
        all_headers.update(headers or {})
        for key, value in all_headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.record.status = status
        if self.command != "HEAD":
            self._write_body_bytes(body)

    def _write_body_bytes(self, body: bytes) -> None:
        limit = len(body) if self.cut_after is None else min(self.cut_after, len(body))
        self.wfile.write(body[:limit])
        self.record.bytes_sent += limit
        if limit < len(body):
            self._cut()

    def _cut(self) -> None:
        self.wfile.flush()
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def send_file(self, status: int, path: Path, start: int, length: int, headers: dict) -> None:
        self._read_body()
        self.send_response(status)
        headers = {"Content-Length": str(length), "Content-Type": "application/octet-stream",
                   "Accept-Ranges": "bytes", **headers}
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.record.status = status
        if self.command == "HEAD":
            return
        budget = length if self.cut_after is None else min(length, self.cut_after)
        with open(path, "rb") as f:
            f.seek(start)
            while budget > 0:
                chunk = f.read(min(STREAM_CHUNK, budget))
                if not chunk:
                    break
                self.wfile.write(chunk)
                self.record.bytes_sent += len(chunk)
                budget -= len(chunk)
        if self.record.bytes_sent < length:
            self._cut()

    def _send_error(self, err: HubHTTPError) -> None:
        headers = dict(err.headers)
        if err.code:
            headers["X-Error-Code"] = err.code
        headers["X-Error-Message"] = str(err)
        body = err.body if err.body is not None else {"error": str(err)}
        self.send(err.status, body, headers)


# --------------------------------------------------------------------------------------------------- routing
def _segments(path: str) -> tuple[list[str], dict[str, list[str]]]:
    parsed = urllib.parse.urlsplit(path)
    parts = [urllib.parse.unquote(p) for p in parsed.path.split("/") if p]
    return parts, urllib.parse.parse_qs(parsed.query)


def _route(h: _Handler, method: str) -> None:
    parts, query = _segments(h.path)
    if not parts:
        raise HubHTTPError(404, "Not found")
    if parts[0] == "api":
        return _route_api(h, method, parts[1:], query)
    if parts[0] == "_lfs":
        return _route_lfs_transfer(h, method, parts[1:])
    if parts[0] == "cdn" and method in ("GET", "HEAD"):
        return _serve_cdn(h, parts[1:])
    repo_type = "model"
    if parts[0] in ("datasets", "spaces"):
        repo_type, parts = parts[0][:-1], parts[1:]
    if len(parts) >= 3 and parts[1].endswith(".git") and parts[2:] == ["info", "lfs", "objects", "batch"]:
        return _lfs_batch(h, _get_repo(h.hub, repo_type, f"{parts[0]}/{parts[1][:-4]}"))
    if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
        return _resolve(h, repo_type, f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
    raise HubHTTPError(404, f"Unknown route {method} {h.path}")


def _get_repo(hub: FakeHub, repo_type: str, repo_id: str) -> Repo:
    repo = hub.repos.get((repo_type, repo_id))
    if repo is None:
        raise HubHTTPError(404, f"Repository not found: {repo_type} {repo_id}", code="RepoNotFound")
    return repo


def _route_api(h: _Handler, method: str, parts: list[str], query: dict) -> None:
    hub = h.hub
    if parts == ["repos", "create"] and method == "POST":
        return _create_repo(h)
    if parts == ["repos", "delete"] and method == "DELETE":
        body = h.json_body()
        repo_type = body.get("type") or "model"
        repo_id = f"{body.get('organization') or 'user'}/{body['name']}"
        with hub.lock:
            _get_repo(hub, repo_type, repo_id)
            del hub.repos[(repo_type, repo_id)]
        return h.send(200, {})
    if parts == ["whoami-v2"]:
        return h.send(200, {"type": "user", "name": "user", "fullname": "Fake User", "orgs": [],
                            "auth": {"type": "access_token", "accessToken": {"displayName": "fake", "role": "write"}}})
    if parts == ["validate-yaml"] and method == "POST":
        return h.send(200, {"errors": [], "warnings": []})
    if len(parts) >= 3 and parts[0] in ("models", "datasets", "spaces"):
        repo_type = parts[0][:-1]
        with hub.lock:
            repo = _get_repo(hub, repo_type, f"{parts[1]}/{parts[2]}")
        return _route_repo_api(h, method, repo, parts[3:], query)
    raise HubHTTPError(404, f"Unknown API route {method} {h.path}")


def _route_repo_api(h: _Handler, method: str, repo: Repo, rest: list[str], query: dict) -> None:
    action, args = (rest[0], rest[1:]) if rest else ("", [])
    if action.startswith("xet-"):
        raise HubHTTPError(404, "Xet is not supported by this server")
    table = {
        ("GET", ""): lambda: _repo_info(h, repo, "main", query),
        ("GET", "revision"): lambda: _repo_info(h, repo, "/".join(args), query),
        ("GET", "tree"): lambda: _tree(h, repo, args[0], "/".join(args[1:]), query),
        ("POST", "preupload"): lambda: _preupload(h, repo, "/".join(args)),
        ("POST", "commit"): lambda: _commit(h, repo, "/".join(args), query),
        ("GET", "refs"): lambda: _refs(h, repo),
        ("POST", "branch"): lambda: _create_branch(h, repo, "/".join(args)),
        ("DELETE", "branch"): lambda: _delete_ref(h, repo.branches, "/".join(args)),
        ("POST", "tag"): lambda: _create_tag(h, repo, "/".join(args)),
        ("DELETE", "tag"): lambda: _delete_ref(h, repo.tags, "/".join(args)),
        ("POST", "paths-info"): lambda: _paths_info(h, repo, "/".join(args)),
        ("GET", "commits"): lambda: _commits(h, repo, "/".join(args)),
    }
    handler = table.get((method, action))
    if handler is None:
        raise HubHTTPError(404, f"Unknown repo route {method} {h.path}")
    return handler()


# --------------------------------------------------------------------------------------------------- repos & refs
def _create_repo(h: _Handler) -> None:
    body = h.json_body()
    repo_type = body.get("type") or "model"
    if repo_type not in REPO_TYPES:
        raise HubHTTPError(400, f"Invalid repo type {repo_type!r}")
    repo_id = f"{body.get('organization') or 'user'}/{body['name']}"
    private = body.get("private", body.get("visibility") == "private") or False
    hub = h.hub
    with hub.lock:
        existing = hub.repos.get((repo_type, repo_id))
        if existing is not None:
            url = hub.url_for(existing)
            raise HubHTTPError(409, f"You already created this {repo_type} repo", body={"error": "exists", "url": url})
        repo = hub.create_repo_direct(repo_id, repo_type, bool(private))
    h.send(200, {"url": hub.url_for(repo), "name": repo_id, "id": repo_id})


def _refs(h: _Handler, repo: Repo) -> None:
    with h.hub.lock:
        body = {
            "branches": [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": c} for n, c in repo.branches.items()],
            "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": c} for n, c in repo.tags.items()],
            "converts": [],
        }
    h.send(200, body)


def _create_branch(h: _Handler, repo: Repo, branch: str) -> None:
    body = h.json_body()
    with h.hub.lock:
        if branch in repo.branches:
            raise HubHTTPError(409, f"Reference already exists: refs/heads/{branch}")
        start = h.hub._resolve_revision(repo, body.get("startingPoint") or "main")
        repo.branches[branch] = start
    h.send(200, {})


def _create_tag(h: _Handler, repo: Repo, revision: str) -> None:
    body = h.json_body()
    tag = body.get("tag")
    with h.hub.lock:
        if not tag:
            raise HubHTTPError(400, "Missing 'tag'")
        if tag in repo.tags:
            raise HubHTTPError(409, f"Tag already exists: {tag}")
        repo.tags[tag] = h.hub._resolve_revision(repo, revision)
    h.send(200, {})


def _delete_ref(h: _Handler, refs: dict[str, str], name: str) -> None:
    with h.hub.lock:
        if name not in refs:
            raise HubHTTPError(404, f"Invalid rev id: {name}", code="RevisionNotFound")
        del refs[name]
    h.send(200, {})


def _commit_at(h: _Handler, repo: Repo, revision: str) -> Commit:
    with h.hub.lock:
        return repo.commits[h.hub._resolve_revision(repo, revision)]


def _repo_info(h: _Handler, repo: Repo, revision: str, query: dict) -> None:
    commit = _commit_at(h, repo, revision)
    blobs = query.get("blobs", ["false"])[0] == "true"
    siblings = []
    for entry in sorted(commit.files.values(), key=lambda e: e.path):
        sibling: dict = {"rfilename": entry.path}
        if blobs:
            sibling.update(size=entry.size, blobId=entry.git_oid)
            if entry.lfs:
                sibling["lfs"] = entry.tree_entry()["lfs"] | {"sha256": entry.sha256}
        siblings.append(sibling)
    h.send(200, {
        "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24], "id": repo.repo_id, "private": repo.private,
        "author": repo.repo_id.split("/")[0], "sha": commit.oid, "lastModified": commit.date,
        "createdAt": repo.created_at, "disabled": False, "gated": False, "downloads": 0, "likes": 0,
        "tags": [], "siblings": siblings,
    })


def _commits(h: _Handler, repo: Repo, revision: str) -> None:
    commit: Commit | None = _commit_at(h, repo, revision)
    out = []
    while commit is not None:
        out.append({"id": commit.oid, "title": commit.title, "message": commit.message, "authors": [],
                    "date": commit.date})
        commit = repo.commits.get(commit.parent) if commit.parent else None
    h.send(200, out)


# --------------------------------------------------------------------------------------------------- listings
def _tree_entries(commit: Commit, path: str, recursive: bool) -> list[dict]:
    prefix = f"{path.rstrip('/')}/" if path else ""
    files = [e for p, e in commit.files.items() if p.startswith(prefix)]
    if path and not files and path not in commit.files:
        raise HubHTTPError(404, f"Entry not found: {path}", code="EntryNotFound",
                           headers={"X-Repo-Commit": commit.oid})
    entries: dict[str, dict] = {}
    for entry in files:
        rel = entry.path[len(prefix):].split("/")
        for depth in range(1, len(rel)):
            directory = prefix + "/".join(rel[:depth])
            if recursive or depth == 1:
                entries.setdefault(directory, {"type": "directory", "oid": git_blob_sha1(directory.encode()),
                                               "size": 0, "path": directory})
        if recursive or len(rel) == 1:
            entries[entry.path] = entry.tree_entry()
    return [entries[k] for k in sorted(entries)]


def _tree(h: _Handler, repo: Repo, revision: str, path: str, query: dict) -> None:
    commit = _commit_at(h, repo, revision)
    recursive = query.get("recursive", ["false"])[0].lower() == "true"
    entries = _tree_entries(commit, path, recursive)
    cursor = int(query.get("cursor", ["0"])[0])
    page = entries[cursor:cursor + h.hub.page_size]
    headers = {}
    if cursor + h.hub.page_size < len(entries):
        params = {k: v[0] for k, v in query.items()} | {"cursor": str(cursor + h.hub.page_size)}
        base = urllib.parse.urlsplit(h.path).path
        headers["Link"] = f'<{h.hub.endpoint}{base}?{urllib.parse.urlencode(params)}>; rel="next"'
    h.send(200, page, headers)


def _paths_info(h: _Handler, repo: Repo, revision: str) -> None:
    raw = h._read_body().decode()
    if h.headers.get("Content-Type", "").startswith("application/json"):
        paths = json.loads(raw or "{}").get("paths", [])
    else:
        paths = urllib.parse.parse_qs(raw).get("paths", [])
    commit = _commit_at(h, repo, revision)
    out = []
    for path in paths:
        if path in commit.files:
            out.append(commit.files[path].tree_entry())
        elif any(p.startswith(path.rstrip("/") + "/") for p in commit.files):
            out.append({"type": "directory", "oid": git_blob_sha1(path.encode()), "size": 0, "path": path})
    h.send(200, out)


# --------------------------------------------------------------------------------------------------- uploads
def _preupload(h: _Handler, repo: Repo, revision: str) -> None:
    body = h.json_body()
    try:
        commit = _commit_at(h, repo, revision)
    except HubHTTPError:
        commit = None  # the commit endpoint reports a bad revision
    files = []
    for item in body.get("files", []):
        existing = commit.files.get(item["path"]) if commit else None
        lfs = h.hub.is_lfs(item["path"], int(item["size"]))
        oid = None
        if existing is not None and existing.lfs == lfs:
            oid = existing.sha256 if lfs else existing.git_oid
        files.append({"path": item["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                      "oid": oid})
    h.send(200, {"files": files})


def _lfs_batch(h: _Handler, repo: Repo) -> None:
    body = h.json_body()
    hub = h.hub
    objects = []
    for obj in body.get("objects", []):
        oid, size = obj["oid"], int(obj["size"])
        if hub._blob_exists(oid, size):
            objects.append({"oid": oid, "size": size})
            continue
        base = f"{hub.endpoint}/_lfs/{oid}/{size}"
        actions: dict = {"verify": {"href": f"{base}/verify"}}
        if hub.multipart_threshold is not None and size >= hub.multipart_threshold:
            chunk = hub.multipart_chunk_size
            count = -(-size // chunk)
            header = {"chunk_size": str(chunk)} | {f"{i:05d}": f"{base}/part/{i}" for i in range(1, count + 1)}
            actions["upload"] = {"href": f"{base}/complete", "header": header}
        else:
            actions["upload"] = {"href": base}
        objects.append({"oid": oid, "size": size, "actions": actions, "authenticated": True})
    h.send(200, {"transfer": "basic", "objects": objects}, content_type="application/vnd.git-lfs+json")


def _route_lfs_transfer(h: _Handler, method: str, parts: list[str]) -> None:
    oid, size = parts[0], int(parts[1])
    rest = parts[2:]
    if method == "PUT" and not rest:
        _store_upload(h, oid, size, h._read_body())
        return h.send(200, b"", content_type="text/plain")
    if method == "PUT" and rest[0] == "part":
        data = h._read_body()
        part = h.hub.tmp_dir / f"{oid}.part{int(rest[1]):05d}"
        part.write_bytes(data)
        return h.send(200, b"", {"ETag": f'"{hashlib.md5(data).hexdigest()}"'}, content_type="text/plain")
    if method == "POST" and rest == ["complete"]:
        return _complete_multipart(h, oid, size)
    if method == "POST" and rest == ["verify"]:
        body = h.json_body()
        if body.get("oid") != oid or not h.hub._blob_exists(oid, int(body.get("size", -1))):
            raise HubHTTPError(404, f"LFS object {oid} not found")
        return h.send(200, {})
    raise HubHTTPError(404, f"Unknown LFS route {method} {h.path}")


def _store_upload(h: _Handler, oid: str, size: int, data: bytes) -> None:
    if len(data) != size or hashlib.sha256(data).hexdigest() != oid:
        raise HubHTTPError(400, f"Uploaded bytes do not match oid {oid} / size {size}")
    h.hub._store_blob(data)


def _complete_multipart(h: _Handler, oid: str, size: int) -> None:
    body = h.json_body()
    chunks = []
    for part in sorted(body.get("parts", []), key=lambda p: p["partNumber"]):
        path = h.hub.tmp_dir / f"{oid}.part{int(part['partNumber']):05d}"
        if not path.exists():
            raise HubHTTPError(400, f"Part {part['partNumber']} of {oid} was never uploaded")
        data = path.read_bytes()
        if part.get("etag", "").strip('"') != hashlib.md5(data).hexdigest():
            raise HubHTTPError(400, f"ETag mismatch for part {part['partNumber']} of {oid}")
        chunks.append(data)
    _store_upload(h, oid, size, b"".join(chunks))
    for path in h.hub.tmp_dir.glob(f"{oid}.part*"):
        path.unlink()
    h.send(200, {})


def _parse_ndjson(raw: bytes) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    header = next((line["value"] for line in lines if line.get("key") == "header"), None)
    if header is None:
        raise HubHTTPError(400, "Commit payload has no header line")
    return header, [line for line in lines if line.get("key") != "header"]


def _apply_operation(hub: FakeHub, files: dict[str, FileEntry], op: dict) -> None:
    key, value = op.get("key"), op.get("value", {})
    path = value.get("path", "")
    if key == "file":
        files[path] = hub.file_entry(path, base64.b64decode(value["content"]), lfs=False)
    elif key == "lfsFile":
        if not hub._blob_exists(value["oid"], int(value["size"])):
            raise HubHTTPError(422, f"LFS file {path} ({value['oid']}) was never uploaded")
        files[path] = FileEntry(path, int(value["size"]), value["oid"], True)
    elif key == "deletedFile":
        if path not in files:
            raise HubHTTPError(404, f"Cannot delete {path}: not found", code="EntryNotFound")
        del files[path]
    elif key == "deletedFolder":
        for name in [p for p in files if p.startswith(path.rstrip("/") + "/")]:
            del files[name]
    else:
        raise HubHTTPError(400, f"Unknown commit operation {key!r}")


def _commit(h: _Handler, repo: Repo, revision: str, query: dict) -> None:
    header, ops = _parse_ndjson(h._read_body())
    hub = h.hub
    with hub.lock:
        branch = revision[11:] if revision.startswith("refs/heads/") else revision
        if branch not in repo.branches:
            raise HubHTTPError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
        head = repo.branches[branch]
        parent = header.get("parentCommit")
        if parent and parent != head:
            raise HubHTTPError(412, f"A commit has happened since. Please refresh and try again ({head}).")
        target = branch
        if query.get("create_pr", ["0"])[0] in ("1", "true"):
            repo.pr_count += 1
            target = f"refs/pr/{repo.pr_count}"
            repo.branches[target] = head
        files = dict(repo.commits[head].files)
        for op in ops:
            _apply_operation(hub, files, op)
        commit = hub._new_commit(repo, head, files, header.get("summary", ""), header.get("description", ""))
        repo.branches[target] = commit.oid
    body = {"commitUrl": f"{hub.url_for(repo)}/commit/{commit.oid}", "commitOid": commit.oid}
    if target != branch:
        body["pullRequestUrl"] = f"{hub.url_for(repo)}/discussions/{repo.pr_count}"
    h.send(200, body)


# --------------------------------------------------------------------------------------------------- downloads
def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end inclusive) of a single ``bytes=`` range, None without one; 416 when unsatisfiable."""
    if not header:
        return None
    match = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
    if match is None or match.group(1) == match.group(2) == "":
        raise HubHTTPError(416, "Malformed range", headers={"Content-Range": f"bytes */{size}"})
    first, last = match.groups()
    if first == "":
        start, end = max(size - int(last), 0), size - 1
    else:
        start, end = int(first), min(int(last), size - 1) if last else size - 1
    if start >= size or start > end:
        raise HubHTTPError(416, "Range not satisfiable", headers={"Content-Range": f"bytes */{size}"})
    return start, end


def _send_blob(h: _Handler, sha256: str, headers: dict) -> None:
    path = h.hub.blob_dir / sha256
    size = path.stat().st_size
    byte_range = _parse_range(h.headers.get("Range"), size)
    if byte_range is None:
        return h.send_file(200, path, 0, size, headers)
    start, end = byte_range
    headers = {**headers, "Content-Range": f"bytes {start}-{end}/{size}"}
    h.send_file(206, path, start, end - start + 1, headers)


def _resolve(h: _Handler, repo_type: str, repo_id: str, revision: str, path: str) -> None:
    hub = h.hub
    with hub.lock:
        repo = _get_repo(hub, repo_type, repo_id)
        commit = repo.commits[hub._resolve_revision(repo, revision)]
        entry = commit.files.get(path)
    headers = {"X-Repo-Commit": commit.oid}
    if entry is None:
        raise HubHTTPError(404, f"Entry not found: {path}", code="EntryNotFound", headers=headers)
    headers["ETag"] = f'"{entry.etag}"'
    if entry.lfs:
        headers.update({"X-Linked-Etag": f'"{entry.sha256}"', "X-Linked-Size": str(entry.size)})
        if hub.cdn:
            quoted = urllib.parse.quote(path.split("/")[-1])
            headers["Location"] = f"{hub.cdn_endpoint}/cdn/{entry.sha256}?filename={quoted}"
            return h.send(302, b"", headers, content_type="text/plain")
    _send_blob(h, entry.sha256, headers)


def _serve_cdn(h: _Handler, parts: list[str]) -> None:
    sha256 = parts[0] if parts else ""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256) or not h.hub._blob_exists(sha256):
        raise HubHTTPError(404, "No such object")
    if "authorization" in h.record.headers:
        raise HubHTTPError(400, "The CDN must not receive the Hub token")
    _send_blob(h, sha256, {"ETag": f'"{sha256}"'})
