"""A loopback Hugging Face Hub stand-in for tests: a real HTTP server, not a mock of ``HfApi``.

:class:`HubStandIn` runs ``http.server.ThreadingHTTPServer`` on ``127.0.0.1`` (ephemeral
port) in a daemon thread and speaks the subset of the Hub's HTTP API that
``huggingface_hub`` 2.x and ``transformers`` use to create a repo, upload a folder in one
commit, and download it back:

===============================================  ==========  ======================================
request                                          route name  answer
===============================================  ==========  ======================================
``POST /api/repos/create``                       create      ``{"url", "name"}``; 409 if it exists
``POST /api/validate-yaml``                      validate    ``{"errors", "warnings"}`` (400 on errors)
``POST /api/models/{repo}/preupload/{rev}``      preupload   every file ``uploadMode: "regular"``, with
                                                             the remote git-sha1 ``oid`` when it exists
``POST /api/models/{repo}/commit/{rev}``         commit      NDJSON header + base64 ``file`` items and
                                                             ``deletedFile``; 412 on a stale ``parentCommit``
``POST /api/models/{repo}/branch/{branch}``      branch      201; 409 if it exists
``GET /api/models/{repo}[/revision/{rev}]``      info        ``{"id", "sha", "private", "siblings"}``
``GET /api/models/{repo}/tree/{rev}[/{path}]``   tree        ``[{"type": "file", "path", "oid", "size"}]``
``HEAD|GET /{repo}/resolve/{rev}/{path}``        resolve     bytes with ``ETag`` and ``X-Repo-Commit``;
                                                             404 + ``X-Error-Code: EntryNotFound``
``GET /api/agent-harnesses``                     agents      an empty registry (public, no token)
===============================================  ==========  ======================================

Commits live in memory: a repo starts with one initial commit holding ``.gitattributes``
(as on the Hub), and every accepted commit endpoint call adds one :class:`Commit`.
Regular uploads are inline base64, so the LFS and Xet paths of the client never run.

Faults are injected per route with :meth:`HubStandIn.fail`: an HTTP status (with
``Retry-After: 0`` so the client's backoff waits its minimum), ``"drop"`` (close the
connection without answering, before anything is applied) or ``"drop_after_apply"``
(apply, then close without answering: a lost response).

Every request is recorded in :attr:`HubStandIn.requests` (method, path, route, headers,
body, status), so tests can assert "no request was made" or inspect what reached the
server. This module uses only the standard library (plus PyYAML for ``validate-yaml``):
importing it never imports ``huggingface_hub``.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["Commit", "Fault", "HubStandIn", "RecordedRequest", "git_blob_sha1"]

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"

_REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
_ROUTES = [
    ("create", "POST", re.compile(r"^/api/repos/create$")),
    ("validate", "POST", re.compile(r"^/api/validate-yaml$")),
    # public and unauthenticated: huggingface_hub fetches it at most once a day (agent detection)
    ("agents", "GET", re.compile(r"^/api/agent-harnesses$")),
    ("preupload", "POST", re.compile(rf"^/api/models/{_REPO}/preupload/(?P<rev>[^/]+)$")),
    ("commit", "POST", re.compile(rf"^/api/models/{_REPO}/commit/(?P<rev>[^/]+)$")),
    ("branch", "POST", re.compile(rf"^/api/models/{_REPO}/branch/(?P<rev>[^/]+)$")),
    ("tree", "GET", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")),
    ("info", "GET", re.compile(rf"^/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?$")),
    ("resolve", "GET", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")),
    ("resolve", "HEAD", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")),
]


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob (what ``git hash-object`` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    """One commit on a branch: the full file snapshot after it, and what it changed."""

    oid: str
    parent: str | None
    title: str
    description: str
    files: dict[str, bytes]
    added: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    initial: bool = False


@dataclass
class _Repo:
    repo_id: str
    private: bool
    branches: dict[str, list[Commit]] = field(default_factory=dict)

    def head(self, rev: str) -> Commit | None:
        if rev in self.branches:
            return self.branches[rev][-1]
        for history in self.branches.values():
            for c in history:
                if c.oid == rev:
                    return c
        return None


@dataclass
class Fault:
    """An injected failure: ``mode`` is an HTTP status (int), ``"drop"`` or ``"drop_after_apply"``."""

    route: str
    mode: int | str
    times: int | None  # None = forever


@dataclass
class RecordedRequest:
    method: str
    path: str
    route: str | None
    headers: dict[str, str]
    body: bytes
    status: int | None = None  # None = connection dropped without an answer


class HubStandIn:
    """The loopback Hub. Use as a context manager, or call :meth:`start` / :meth:`stop`.

    Args:
        require_token: refuse write requests (create, preupload, commit, branch) without
            an ``Authorization: Bearer`` header (401), as the Hub does.
    """

    def __init__(self, *, require_token: bool = True):
        self.require_token = require_token
        self.repos: dict[str, _Repo] = {}
        self.requests: list[RecordedRequest] = []
        self.faults: list[Fault] = []
        self._lock = threading.RLock()
        self._counter = itertools.count(1)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> HubStandIn:
        handler = type("_Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-stand-in", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> HubStandIn:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the stand-in is not running: call start() first")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # ------------------------------------------------------------------ test controls
    def fail(self, route: str, mode: int | str = 500, *, times: int | None = 1) -> None:
        """Make the next ``times`` requests to ``route`` fail (``None`` = every one)."""
        if route not in {r for r, _, _ in _ROUTES}:
            raise ValueError(f"route={route!r}: allowed {sorted({r for r, _, _ in _ROUTES})}")
        if not (isinstance(mode, int) or mode in ("drop", "drop_after_apply")):
            raise ValueError(f"mode={mode!r}: an HTTP status, 'drop' or 'drop_after_apply'")
        with self._lock:
            self.faults.append(Fault(route, mode, times))

    def _take_fault(self, route: str | None) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.route == route and (fault.times is None or fault.times > 0):
                    if fault.times is not None:
                        fault.times -= 1
                    return fault
        return None

    def commits(self, repo_id: str, branch: str = "main", *, include_initial: bool = False) -> list[Commit]:
        """Commits on ``branch`` in order (by default without the repo's initial commit)."""
        with self._lock:
            repo = self.repos.get(repo_id)
            if repo is None or branch not in repo.branches:
                return []
            return [c for c in repo.branches[branch] if include_initial or not c.initial]

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """File snapshot at ``revision`` (branch name or commit oid)."""
        with self._lock:
            head = self.repos[repo_id].head(revision)
            if head is None:
                raise KeyError(f"{repo_id}@{revision} does not exist")
            return dict(head.files)

    def requests_to(self, route: str) -> list[RecordedRequest]:
        return [r for r in self.requests if r.route == route]

    def _new_oid(self, seed: str) -> str:
        return hashlib.sha1(f"{next(self._counter)}:{seed}".encode()).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    hub: HubStandIn
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # keep test output clean
        pass

    # ------------------------------------------------------------------ plumbing
    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, *, head_only: bool = False):
        self._record.status = status
        if self._suppress:  # "drop_after_apply": the state changed, the answer is lost
            return
        self.send_response(status)
        headers = dict(headers or {})
        headers.setdefault("Content-Type", "application/json")
        headers.setdefault("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if body and not head_only and self.command != "HEAD":  # a HEAD answer has no body, errors included
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict | None = None):
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, status: int, message: str, code: str | None = None):
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._json(status, {"error": message}, headers)

    def _drop(self):
        self._record.status = None
        self.close_connection = True

    def _dispatch(self, method: str):
        split = urlsplit(self.path)
        path, query = unquote(split.path), parse_qs(split.query)
        body = self._read_body() if method in ("POST", "PUT", "DELETE") else b""
        route, match = None, None
        for name, verb, pattern in _ROUTES:
            m = pattern.match(path) if verb == method else None
            if m:
                route, match = name, m
                break
        self._suppress = False
        self._record = RecordedRequest(method, self.path, route, {k.lower(): v for k, v in self.headers.items()}, body)
        with self.hub._lock:
            self.hub.requests.append(self._record)
        if route is None:
            return self._error(404, f"no route for {method} {path}")
        fault = self.hub._take_fault(route)
        if fault is not None and fault.mode == "drop":
            return self._drop()
        if fault is not None and isinstance(fault.mode, int):
            return self._json(fault.mode, {"error": f"injected {fault.mode}"}, {"Retry-After": "0"})
        if route in ("create", "preupload", "commit", "branch") and self.hub.require_token and not self._token():
            return self._error(401, "Invalid credentials in Authorization header")
        self._suppress = fault is not None and fault.mode == "drop_after_apply"
        getattr(self, f"_{route}")(match, query, body, method)
        if self._suppress:
            self._drop()

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[len("Bearer ") :] if auth.startswith("Bearer ") and len(auth) > len("Bearer ") else None

    def _repo_or_404(self, repo_id: str, *, read: bool = True) -> _Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None or (read and repo.private and not self._token()):
            self._error(404 if repo is None else 401, "Repository not found", "RepoNotFound")
            return None
        return repo

    def _repo_head(self, repo_id: str, rev: str, *, read: bool = True) -> tuple[_Repo | None, Commit | None]:
        """(repo, commit at ``rev``), or answer 401/404 and return Nones. Call under the lock."""
        repo = self._repo_or_404(repo_id, read=read)
        if repo is None:
            return None, None
        head = repo.head(rev)
        if head is None:
            self._error(404, f"Revision not found: {rev}", "RevisionNotFound")
            return None, None
        return repo, head

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    # ------------------------------------------------------------------ routes
    def _create(self, match, query, body, method):
        payload = json.loads(body or b"{}")
        name, org = payload.get("name"), payload.get("organization")
        repo_id = f"{org}/{name}" if org else name
        if not repo_id or "/" not in repo_id:
            return self._error(400, f"repo name {repo_id!r} needs a namespace")
        private = payload.get("private")
        if private is None:
            private = payload.get("visibility") == "private"
        url = f"{self.hub.url}/{repo_id}"
        with self.hub._lock:
            if repo_id in self.hub.repos:
                return self._json(409, {"error": "You already created this model repo", "url": url})
            initial = Commit(
                self.hub._new_oid(repo_id), None, "initial commit", "", {".gitattributes": GITATTRIBUTES},
                added=[".gitattributes"], initial=True,
            )
            self.hub.repos[repo_id] = _Repo(repo_id, bool(private), {"main": [initial]})
        self._json(200, {"url": url, "name": repo_id, "id": repo_id})

    def _agents(self, match, query, body, method):
        self._json(200, {"standardEnvVars": [], "harnesses": {}})

    def _validate(self, match, query, body, method):
        import yaml

        content = json.loads(body or b"{}").get("content", "")
        errors = []
        m = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", content, re.S)
        if m:
            try:
                meta = yaml.safe_load(m.group(1)) or {}
            except yaml.YAMLError as err:
                meta, errors = {}, [{"message": f"YAML error: {err}"}]
            if not isinstance(meta, dict):
                errors.append({"message": "metadata must be a mapping"})
            else:
                errors += [{"message": e} for e in _model_index_errors(meta.get("model-index"))]
        self._json(400 if errors else 200, {"errors": errors, "warnings": []})

    def _preupload(self, match, query, body, method):
        with self.hub._lock:
            _, head = self._repo_head(match["repo"], match["rev"], read=False)
            if head is None:
                return
            files = json.loads(body)["files"]
            answer = [
                {
                    "path": f["path"],
                    "uploadMode": "regular",
                    "shouldIgnore": False,
                    "oid": git_blob_sha1(head.files[f["path"]]) if f["path"] in head.files else None,
                }
                for f in files
            ]
            self._json(200, {"files": answer, "commitOid": head.oid})

    def _commit(self, match, query, body, method):
        if query.get("create_pr"):
            return self._error(400, "the stand-in does not implement pull requests")
        items = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = next((i["value"] for i in items if i.get("key") == "header"), None)
        if header is None:
            return self._error(400, "commit payload has no header")
        with self.hub._lock:
            repo = self._repo_or_404(match["repo"], read=False)
            if repo is None:
                return
            rev = match["rev"]
            if rev not in repo.branches:
                return self._error(404, f"Revision not found: {rev}", "RevisionNotFound")
            head = repo.branches[rev][-1]
            parent = header.get("parentCommit")
            if parent and not head.oid.startswith(parent):
                return self._error(412, "A commit has happened since. Please refresh and try again.")
            files, added, deleted = dict(head.files), [], []
            for item in items:
                key, value = item.get("key"), item.get("value", {})
                if key == "file":
                    if value.get("encoding") != "base64":
                        return self._error(400, f"unsupported encoding {value.get('encoding')!r}")
                    files[value["path"]] = base64.b64decode(value["content"])
                    added.append(value["path"])
                elif key == "deletedFile":
                    if files.pop(value["path"], None) is None:
                        return self._error(404, f"A file with this name doesn't exist: {value['path']}", "EntryNotFound")
                    deleted.append(value["path"])
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    gone = [p for p in files if p.startswith(prefix)]
                    for p in gone:
                        del files[p]
                    deleted += gone
                elif key != "header":
                    return self._error(400, f"the stand-in does not implement commit items of kind {key!r}")
            commit = Commit(
                self.hub._new_oid(header.get("summary", "")), head.oid, header.get("summary", ""),
                header.get("description", ""), files, added, deleted,
            )
            repo.branches[rev].append(commit)
        url = f"{self.hub.url}/{repo.repo_id}/commit/{commit.oid}"
        self._json(200, {"commitUrl": url, "commitOid": commit.oid, "pullRequestUrl": None})

    def _branch(self, match, query, body, method):
        with self.hub._lock:
            repo = self._repo_or_404(match["repo"], read=False)
            if repo is None:
                return
            name = match["rev"]
            if name in repo.branches:
                return self._error(409, f"Reference already exists: refs/heads/{name}")
            start = json.loads(body or b"{}").get("startingPoint") or "main"
            base = repo.head(start)
            if base is None:
                return self._error(404, f"Revision not found: {start}", "RevisionNotFound")
            repo.branches[name] = [base]
        self._json(200, {})

    def _info(self, match, query, body, method):
        with self.hub._lock:
            repo, head = self._repo_head(match["repo"], match["rev"] or "main")
            if head is None:
                return
            self._json(
                200,
                {
                    "id": repo.repo_id,
                    "modelId": repo.repo_id,
                    "author": repo.repo_id.split("/")[0],
                    "sha": head.oid,
                    "private": repo.private,
                    "disabled": False,
                    "gated": False,
                    "downloads": 0,
                    "likes": 0,
                    "tags": [],
                    "siblings": [{"rfilename": p} for p in sorted(head.files)],
                },
            )

    def _tree(self, match, query, body, method):
        with self.hub._lock:
            _, head = self._repo_head(match["repo"], match["rev"])
            if head is None:
                return
            prefix = (match["path"] or "").strip("/")
            entries = [
                {"type": "file", "path": p, "oid": git_blob_sha1(data), "size": len(data)}
                for p, data in sorted(head.files.items())
                if not prefix or p.startswith(prefix + "/")
            ]
        self._json(200, entries)

    def _resolve(self, match, query, body, method):
        with self.hub._lock:
            _, head = self._repo_head(match["repo"], match["rev"])
            if head is None:
                return
            data = head.files.get(match["path"])
        if data is None:
            return self._error(404, f"Entry not found: {match['path']}", "EntryNotFound")
        headers = {
            "Content-Type": "application/octet-stream",
            "ETag": f'"{git_blob_sha1(data)}"',
            "X-Repo-Commit": head.oid,
            "Accept-Ranges": "bytes",
        }
        status = 200
        rng = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
        if rng and method == "GET":
            start = int(rng[1])
            end = int(rng[2]) if rng[2] else len(data) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start : end + 1], 206
        headers["Content-Length"] = str(len(data))
        self._send(status, data, headers, head_only=(method == "HEAD"))


def _model_index_errors(model_index) -> list[str]:
    """Structural checks the Hub applies to ``model-index`` (a subset)."""
    if model_index is None:
        return []
    if not isinstance(model_index, list) or not model_index:
        return ["model-index must be a non-empty list"]
    errors = []
    for entry in model_index:
        if not isinstance(entry, dict) or not entry.get("name"):
            errors.append("model-index entries need a name")
            continue
        for result in entry.get("results") or []:
            task, dataset, metrics = result.get("task") or {}, result.get("dataset") or {}, result.get("metrics") or []
            if not task.get("type"):
                errors.append("model-index result without task.type")
            if not dataset.get("type") or not dataset.get("name"):
                errors.append("model-index result without dataset.type and dataset.name")
            for metric in metrics:
                if not metric.get("type") or "value" not in metric:
                    errors.append("model-index metric without type and value")
    return errors
