"""A Hugging Face Hub stand-in for tests: serves repos from a directory on 127.0.0.1.

Layout: ``root/{models,datasets}/<repo_id>/<commit sha>/<files>`` plus ``refs/<branch>`` files that
hold a commit sha; :func:`publish` writes one commit. The server speaks the subset of the Hub API
that ``huggingface_hub`` 1.x uses for ``snapshot_download`` and ``repo_info``:

* ``GET /api/{models,datasets}/<repo>/revision/<rev>``: repo info (``sha``, ``siblings``)
* ``GET /api/{models,datasets}/<repo>/tree/<rev>[/<dir>]?recursive=``: file listing, LFS metadata
* ``GET /api/{models,datasets}/<repo>/auth-check``: what ``HfApi.auth_check`` (huggingface_hub 1.32)
  asks: 200 when the request's token may read the repo, else the gated repo's 401/403
* ``HEAD|GET /<repo>/resolve/<rev>/<path>``, ``/datasets/<repo>/resolve/<rev>/<path>``: files with
  ``X-Repo-Commit``, ``ETag`` and, for LFS files, ``X-Linked-Etag`` / ``X-Linked-Size``

and the write subset ``HfApi.create_repo`` and ``create_commit`` use (with ``HF_HUB_DISABLE_XET``: the
LFS protocol, not Xet's CAS), each refused without ``Authorization: Bearer <write_token>``:

* ``POST /api/repos/create``: a repo with one initial commit (``.gitattributes``), 409 when it exists
* ``POST /api/models/<repo>/preupload/<rev>``: ``lfs`` upload mode for the LFS suffixes, else ``regular``
* ``POST /<repo>.git/info/lfs/objects/batch``, then ``PUT /lfs-upload/<sha256>?sig=``: LFS objects (the
  upload URL is presigned, as the Hub's S3 URLs are: no token, a signature the batch answer made)
* ``POST /api/validate-yaml``: a README's metadata block must parse as a YAML mapping
* ``POST /api/models/<repo>/commit/<rev>``: the NDJSON commit (header, file, lfsFile, deletedFile),
  one new commit on top of ``rev``; ``commits(repo_id)`` lists a repo's commits, oldest first

Errors carry the Hub's ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo).
A gated repo answers 401 without ``Authorization: Bearer <token>`` and 403 with a wrong token,
except for its repo info, which (like the Hub's) anyone may read: it says ``gated: "manual"``.
Every request is recorded (method, path, whether it carried an Authorization header; never its value).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".parquet", ".bin", ".model")  # stored in LFS, like the Hub's .gitattributes
_API = re.compile(r"/api/(models|datasets)/(.+?)/(revision|tree)/([^/]+)(?:/(.*))?")
_RESOLVE = re.compile(r"/(datasets/)?(.+?)/resolve/([^/]+)/(.+)")
_AUTH_CHECK = re.compile(r"/api/(models|datasets)/(.+?)/auth-check")
_SHA = re.compile(r"[0-9a-f]{40}")
_PREUPLOAD_OR_COMMIT = re.compile(r"/api/models/(.+?)/(preupload|commit)/([^/]+)")
_LFS_BATCH = re.compile(r"/(.+?)\.git/info/lfs/objects/batch")
_LFS_UPLOAD = re.compile(r"/lfs-upload/([0-9a-f]{64})")


def publish(root: Path, repo_id: str, files: dict[str, bytes], repo_type: str = "model", branch: str = "main") -> str:
    """Write one commit of ``repo_id`` under ``root``, point ``branch`` at it, return its sha."""
    digest = hashlib.sha1(repo_id.encode())
    for path in sorted(files):
        digest.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    sha = digest.hexdigest()
    repo = root / f"{repo_type}s" / repo_id
    for path, data in files.items():
        (repo / sha / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / sha / path).write_bytes(data)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / branch).write_text(sha)
    return sha


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    authorized: bool  # an Authorization header was present


@dataclass
class HubServer:
    """Threaded Hub-compatible server; use as a context manager, read ``url`` and ``requests``."""

    root: Path
    gated: dict[str, str] = field(default_factory=dict)  # repo_id -> the one token that has access
    corrupt: set[str] = field(default_factory=set)  # file paths served with flipped bytes (same size)
    requests: list[Request] = field(default_factory=list)
    write_token: str | None = None  # the token writes need (None: writes refused)
    upload_sigs: dict[str, str] = field(default_factory=dict)  # LFS oid -> its presigned URL's signature

    def commits(self, repo_id: str) -> list[str]:
        """The commits of a model repo, oldest first."""
        log = self.root / "models" / repo_id / "commits.log"
        return log.read_text().split() if log.is_file() else []

    def __enter__(self) -> HubServer:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"


class _HubError(Exception):
    def __init__(self, status: int, code: str, message: str, commit: str | None = None, **extra: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.commit, self.extra = status, code, message, commit, extra


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._serve(body=True)

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_POST(self) -> None:
            self._write()

        def do_PUT(self) -> None:
            self._write()

        def _write(self) -> None:
            """The write endpoints (module docstring)."""
            path = urlsplit(self.path).path
            hub.requests.append(Request(self.command, self.path, "Authorization" in self.headers))
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                if (m := _LFS_UPLOAD.fullmatch(path)) and self.command == "PUT":  # a presigned URL: no token
                    if parse_qs(urlsplit(self.path).query).get("sig") != [hub.upload_sigs.get(m[1])]:
                        raise _HubError(403, "Forbidden", "the upload URL's signature is not valid")
                    if hashlib.sha256(data).hexdigest() != m[1]:
                        raise _HubError(400, "BadRequest", "the uploaded object does not match its sha256")
                    (hub.root / "lfs").mkdir(exist_ok=True)
                    (hub.root / "lfs" / m[1]).write_bytes(data)
                    return self._send(200, b"{}", {"Content-Type": "application/json"}, True)
                if hub.write_token is None or self.headers.get("Authorization") != f"Bearer {hub.write_token}":
                    raise _HubError(401, "Unauthorized", "Invalid credentials in Authorization header")
                if path == "/api/repos/create":
                    out = self._create_repo(json.loads(data))
                elif path == "/api/validate-yaml":
                    out = _validate_card(json.loads(data)["content"])
                elif m := _PREUPLOAD_OR_COMMIT.fullmatch(path):
                    repo_id, what, rev = m[1], m[2], unquote(m[3])
                    repo, sha = self._open("models", repo_id, rev)
                    if what == "preupload":
                        out = {"files": [{"path": f["path"], "shouldIgnore": False,
                                          "uploadMode": "lfs" if f["path"].endswith(LFS_SUFFIXES) else "regular"}
                                         for f in json.loads(data)["files"]]}
                    else:
                        out = self._commit(repo_id, repo, sha, rev, data)
                elif _LFS_BATCH.fullmatch(path):
                    objects = json.loads(data)["objects"]
                    hub.upload_sigs |= {o["oid"]: secrets.token_hex(8) for o in objects}
                    out = {"transfer": "basic", "objects": [
                        {"oid": o["oid"], "size": o["size"], "authenticated": True, "actions": {"upload": {
                            "href": f"{hub.url}/lfs-upload/{o['oid']}?sig={hub.upload_sigs[o['oid']]}"}}}
                        for o in objects]}
                else:
                    raise _HubError(404, "RepoNotFound", f"no route for {path}")
                self._send(200, json.dumps(out).encode(), {"Content-Type": "application/json"}, True)
            except _HubError as err:
                body = json.dumps({"error": err.message, **err.extra}).encode()
                self._send(err.status, body, {"X-Error-Code": err.code, "X-Error-Message": err.message,
                                              "Content-Type": "application/json"}, True)

        def _create_repo(self, request: dict) -> dict:
            repo_id = f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
            if (hub.root / "models" / repo_id / "refs").is_dir():
                raise _HubError(409, "RepoExists", "You already created this model repo", url=f"{hub.url}/{repo_id}")
            sha = publish(hub.root, repo_id, {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"})
            (hub.root / "models" / repo_id / "commits.log").write_text(sha + "\n")
            private = request.get("visibility") == "private" or bool(request.get("private"))
            (hub.root / "models" / repo_id / "private").write_text(str(private))
            return {"url": f"{hub.url}/{repo_id}", "name": repo_id}

        def _commit(self, repo_id: str, repo: Path, parent: str, rev: str, data: bytes) -> dict:
            """One commit on top of ``parent``: the files it adds or replaces, minus those it deletes."""
            snapshot = repo / parent
            files = {p.relative_to(snapshot).as_posix(): p.read_bytes() for p in snapshot.rglob("*") if p.is_file()}
            for line in data.decode().splitlines():
                entry = json.loads(line)
                key, value = entry["key"], entry["value"]
                if key == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "lfsFile":
                    obj = hub.root / "lfs" / value["oid"]
                    if not obj.is_file():
                        raise _HubError(400, "BadRequest", f"LFS object {value['oid']} was never uploaded")
                    files[value["path"]] = obj.read_bytes()
                elif key == "deletedFile":
                    files.pop(value["path"], None)
            sha = publish(hub.root, repo_id, files, branch=rev)
            with open(repo / "commits.log", "a") as log:
                log.write(sha + "\n")
            return {"commitUrl": f"{hub.url}/{repo_id}/commit/{sha}", "commitOid": sha, "pullRequestUrl": None}

        def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
            pass

        def _serve(self, body: bool) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            hub.requests.append(Request(self.command, self.path, "Authorization" in self.headers))
            try:
                if m := _API.fullmatch(url.path):
                    kind, repo_id, endpoint, rev = m[1], m[2], m[3], unquote(m[4])
                    repo, sha = self._open(kind, repo_id, rev, gate=endpoint != "revision")
                    if endpoint == "revision":
                        data = _info(repo_id, sha, repo / sha, repo_id in hub.gated)
                    else:
                        if not (repo / sha / unquote(m[5] or "")).is_dir():
                            raise _HubError(404, "EntryNotFound", f"no folder {m[5]} at {sha}", commit=sha)
                        recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() == "true"
                        data = _tree(repo / sha, unquote(m[5] or ""), recursive)
                    self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"}, body)
                elif m := _AUTH_CHECK.fullmatch(url.path):
                    self._repo(m[1], m[2])
                    self._gate(m[1], m[2])
                    self._send(200, b"{}", {"Content-Type": "application/json"}, body)
                elif m := _RESOLVE.fullmatch(url.path):
                    kind = "datasets" if m[1] else "models"
                    repo, sha = self._open(kind, m[2], unquote(m[3]))
                    self._file(repo / sha, unquote(m[4]), sha, body)
                else:
                    raise _HubError(404, "RepoNotFound", f"no route for {path}")
            except _HubError as err:
                headers = {"X-Error-Code": err.code, "X-Error-Message": err.message}
                if err.commit:
                    headers["X-Repo-Commit"] = err.commit
                data = json.dumps({"error": err.message}).encode()
                self._send(err.status, data, {**headers, "Content-Type": "application/json"}, body)

        def _open(self, kind: str, repo_id: str, rev: str, gate: bool = True) -> tuple[Path, str]:
            """Find the repo directory and the commit sha of ``rev``, enforcing gating."""
            repo = self._repo(kind, repo_id)
            if gate:
                self._gate(kind, repo_id)
            ref = repo / "refs" / rev
            sha = ref.read_text() if not _SHA.fullmatch(rev) and ref.is_file() else rev
            if not _SHA.fullmatch(sha) or not (repo / sha).is_dir():
                raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return repo, sha

        def _repo(self, kind: str, repo_id: str) -> Path:
            repo = hub.root / kind / repo_id
            if not (repo / "refs").is_dir():
                raise _HubError(404, "RepoNotFound", f"Repository {repo_id} not found")
            return repo

        def _gate(self, kind: str, repo_id: str) -> None:
            """A gated repo answers 401 without a token, 403 with one it did not grant."""
            if repo_id not in hub.gated:
                return
            auth = self.headers.get("Authorization")
            what = f"Access to {kind[:-1]} {repo_id} is restricted"
            if auth is None:
                raise _HubError(401, "GatedRepo", f"{what}. You must be authenticated to access it.")
            if auth != f"Bearer {hub.gated[repo_id]}":
                raise _HubError(403, "GatedRepo", f"{what} and you are not in the authorized list.")

        def _file(self, snapshot: Path, rel: str, sha: str, body: bool) -> None:
            target = snapshot / rel
            if not target.is_file() or not target.resolve().is_relative_to(snapshot.resolve()):
                raise _HubError(404, "EntryNotFound", f"{rel} does not exist at {sha}", commit=sha)
            data = target.read_bytes()
            headers = {"X-Repo-Commit": sha, "Content-Type": "application/octet-stream"}
            if rel.endswith(LFS_SUFFIXES):
                digest = hashlib.sha256(data).hexdigest()
                headers |= {"ETag": f'"{digest}"', "X-Linked-Etag": f'"{digest}"', "X-Linked-Size": str(len(data))}
            else:
                headers["ETag"] = f'"{git_blob_sha1(data)}"'
            if rel in hub.corrupt:
                data = bytes(b ^ 0xFF for b in data)
            self._send(200, data, headers, body)

        def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
            self.send_response(status)
            for name, value in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(name, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler


def _validate_card(content: str) -> dict:
    """The Hub's check of a README: the block between the first two ``---`` lines is a YAML mapping."""
    import yaml

    parts = content.split("---\n", 2)
    if len(parts) < 3 or parts[0] or not isinstance(yaml.safe_load(parts[1]), dict):
        raise _HubError(400, "BadRequest", "the README's metadata is not a YAML mapping between --- lines")
    return {"errors": [], "warnings": []}


def _info(repo_id: str, sha: str, snapshot: Path, gated: bool) -> dict:
    files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    return {"id": repo_id, "sha": sha, "private": False, "gated": "manual" if gated else False,
            "siblings": [{"rfilename": f} for f in files]}


def _tree(snapshot: Path, folder: str, recursive: bool) -> list[dict]:
    """Entries as the Hub lists them: files with git oid and LFS metadata, and directories."""
    base = snapshot / folder
    entries = []
    for p in sorted(base.rglob("*") if recursive else base.iterdir()):
        rel = p.relative_to(snapshot).as_posix()
        if p.is_dir():
            entries.append({"type": "directory", "oid": hashlib.sha1(rel.encode()).hexdigest(), "size": 0, "path": rel})
            continue
        data = p.read_bytes()
        entry = {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": rel}
        if rel.endswith(LFS_SUFFIXES):
            digest = hashlib.sha256(data).hexdigest()
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{digest}\nsize {len(data)}\n".encode()
            entry |= {
                "oid": git_blob_sha1(pointer),
                "lfs": {"oid": digest, "size": len(data), "pointerSize": len(pointer)},
            }
        entries.append(entry)
    return entries
