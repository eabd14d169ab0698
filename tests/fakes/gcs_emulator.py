"""A real GCS endpoint on 127.0.0.1 for tests: `gcp-storage-emulator`, patched (a bug, headers, speed).

Run as a script (`python tests/fakes/gcs_emulator.py --data-dir D --bucket B`) it is the launcher:
it patches the emulator, binds 127.0.0.1 on a free port and prints ``PORT <n>``. Imported, it gives
`running_emulator()` (a context manager starting that launcher; the `gcs_emulator` pytest fixture
of tests/conftest.py uses it), `dvc_env()`, `add_dvc_remote()`, `local_remote()`, and
`pipeline_stages()` / `missing_git_outputs()` (what a clone of a pipeline's repo needs).

The bug: the emulator parses a `multipart/related` upload with `email.parser`, which strips the
line break before each boundary as "CRLF or LF". gcsfs (uploads under 5 MiB) separates parts with a
bare LF, so a file ending in `\r` is read as ending in `\r\n` + boundary and silently loses its last
byte. `parse_multipart_related` takes the line break style from the first boundary line instead.

Generation headers (`_send_generation_headers`): real GCS sends `x-goog-generation` with every
download and tensorstore (Orbax's storage, pointed here by `TENSORSTORE_GCS_HTTP_URL`) fails every
read without it ("Malformed StorageGeneration"); Orbax's saves worked, its restores did not.

Speed (`_speed_up_storage`): the emulator rewrites its whole metadata file (`.meta`, every object's
resource as indented JSON, through Python's slow pure-Python encoder) after every object write, so
an upload of n objects costs O(n^2): 2916 small files took 13 min and more (400 files: 45 s, 33 s
of it in that write). Here the file is written at most once a second (compact JSON) and when the
launcher stops; the emulator reads it only when it starts, so a restarted emulator still sees every
object. Resumable uploads append each chunk instead of rereading and rewriting the partial file,
and the finished file is renamed into place instead of written again. The listen backlog is 128
instead of 5, so 16 parallel clients do not wait for TCP SYN retransmits. (400 files: 14 s; 2916:
38 s; measurements in docs/remote-and-cache.md.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# gcsfs otherwise tries a gRPC bucket lookup the emulator cannot answer (about 60 s per call), and
# google-auth probes the GCE metadata address. DVC must not send usage analytics anywhere.
GCS_TEST_ENV = {
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    "NO_GCE_CHECK": "true",
    "DVC_NO_ANALYTICS": "1",
}
BUCKET = "mtpipe-test"
# A bearer token of this form (what tests/fakes/fake_metadata.py hands a VM) makes the emulator hold
# the request to the bucket's IAM policy for the service account it names (`_hold_to_iam`).
SA_TOKEN_PREFIX = "fake-sa-token:"


def parse_multipart_related(body: bytes, content_type: str) -> dict:
    """Split a GCS multipart upload into ``{"meta", "content", "content-type"}`` byte-exactly."""
    match = re.search(r'boundary="?([^";]+)"?', content_type)
    if not match:
        raise ValueError(f"no boundary in Content-Type {content_type!r}")
    dash_boundary = b"--" + match.group(1).encode()
    pos = body.index(dash_boundary) + len(dash_boundary)
    eol = b"\r\n" if body.startswith(b"\r\n", pos) else b"\n"
    # The pieces between delimiters (eol + dash_boundary), as (start, end) offsets: slicing only
    # the payload copies a multi-MiB upload once. Each piece starts with `eol` when a part
    # follows, or with "--" after the closing delimiter.
    bounds, delimiter = [], eol + dash_boundary
    while (end := body.find(delimiter, pos)) >= 0:
        bounds.append((pos, end))
        pos = end + len(delimiter)
    bounds.append((pos, len(body)))
    pieces = [(start + len(eol), end) for start, end in bounds if not body.startswith(b"--", start, end)]
    if len(pieces) != 2:
        raise ValueError(f"expected 2 parts (metadata, media), got {len(pieces)}")
    parts = []
    for start, end in pieces:
        split = body.find(eol + eol, start, end)
        head_end, payload_start = (end, end) if split < 0 else (split, split + 2 * len(eol))
        lines = (line.partition(":") for line in body[start:head_end].decode().split(eol.decode()))
        parts.append(({k.strip().lower(): v.strip() for k, _, v in lines}, body[payload_start:end]))
    (_, meta), (media_headers, content) = parts
    return {
        "meta": json.loads(meta),
        "content": content,
        "content-type": media_headers.get("content-type", "application/octet-stream").split(";")[0],
    }


def patch_emulator() -> None:
    """Route `multipart/related` bodies through `parse_multipart_related`; send generation headers."""
    from gcp_storage_emulator import server

    original = server._read_data

    def read_data(request_handler, query):
        content_type = request_handler.headers.get("Content-Type") or ""
        if not content_type.startswith("multipart/related"):
            return original(request_handler, query)
        raw = server._decode_raw_data(server._read_raw_data(request_handler), request_handler)
        return parse_multipart_related(raw, content_type) if raw else None

    server._read_data = read_data
    _send_generation_headers(server)
    _speed_up_storage(server)
    _hold_to_iam(server)


# What the emulator's IAM check lets each role do with objects (cloud.google.com/storage/docs/
# access-control/iam-roles); members it honours: the token's service account, allUsers, allAuthenticatedUsers.
OBJECT_ROLES = {
    "roles/storage.admin": {"create", "delete", "get", "list"},
    "roles/storage.objectAdmin": {"create", "delete", "get", "list"},
    "roles/storage.objectUser": {"create", "delete", "get", "list"},
    "roles/storage.objectCreator": {"create"},
    "roles/storage.objectViewer": {"get", "list"},
    "roles/storage.legacyBucketOwner": {"create", "delete", "list"},
    "roles/storage.legacyBucketWriter": {"create", "delete", "list"},
    "roles/storage.legacyBucketReader": {"list"},
    "roles/storage.legacyObjectReader": {"get"},
}
OBJECT_PATH = re.compile(r"^(?:/upload|/download)?/storage/v1/b/(?P<bucket>[-.\w]+)/o(?P<object>/.+)?$")
BUCKET_READS = re.compile(r"^/storage/v1/b/[-.\w]+(?:/iam(?:/testPermissions)?)?$")


def _hold_to_iam(server) -> None:
    """Requests with a service account's token (SA_TOKEN_PREFIX) are held to the bucket's stored IAM
    policy (a binding's condition is taken as met: the emulator evaluates none; groups and domains
    never match), answered 403 in GCS's words when it does not allow them; other
    requests are served as before (the emulator enforces nothing). Bucket and IAM policy reads are
    checked against storage.v1's discovery document first and refused (400) as Google would."""
    from http import HTTPStatus
    from urllib.parse import urlsplit

    from fakes.discovery import Refused, api

    original_handle = server.Router.handle

    def refuse(handler, code: int, body: dict) -> None:
        response = server.Response(handler)
        response.status = HTTPStatus(code)
        response.json(body)
        response.close()

    def handle(self, method):
        handler = self._request_handler
        path = urlsplit(handler.path).path
        if method == "GET" and BUCKET_READS.match(path):
            try:
                api("storage.v1").check_request(method, handler.path, "")
            except Refused as e:
                return refuse(handler, e.code, e.body())
        token = (handler.headers.get("Authorization") or "").removeprefix("Bearer ")
        found = OBJECT_PATH.match(path)
        if token.startswith(SA_TOKEN_PREFIX) and found:
            email = token[len(SA_TOKEN_PREFIX):]
            action = {"POST": "create", "DELETE": "delete"}.get(method) or ("get" if found["object"] else "list")
            policy = handler.storage.get_bucket_iam_policy(found["bucket"]) or {}
            allowed = set().union(*[OBJECT_ROLES.get(b["role"], set()) for b in policy.get("bindings", [])
                                    if {f"serviceAccount:{email}", "allUsers", "allAuthenticatedUsers"}
                                    & set(b["members"])])
            if action not in allowed:
                message = (f"{email} does not have storage.objects.{action} access to the Google Cloud Storage "
                           f"{'object' if found['object'] or action == 'create' else 'bucket'}. Permission "
                           f"'storage.objects.{action}' denied on resource (or it may not exist).")
                return refuse(handler, 403, {"error": {"code": 403, "message": message, "errors": [
                    {"message": message, "domain": "global", "reason": "forbidden"}]}})
        return original_handle(self, method)

    server.Router.handle = handle


META_WRITE_INTERVAL_S = 1.0
_meta_lock = threading.RLock()  # held by each request and by each metadata write
_meta_dirty: set = set()  # Storage instances whose metadata file is out of date


def flush_metadata() -> None:
    """Write the metadata file of each storage that changed since its last write (compact JSON)."""
    with _meta_lock:
        for storage in list(_meta_dirty):
            _meta_dirty.discard(storage)
            data = {"buckets": storage.buckets, "objects": storage.objects, "resumable": storage.resumable,
                    "bucket_iam_policies": storage.bucket_iam_policies, "soft_deleted": storage.soft_deleted}
            storage._store.write_bytes(".meta", json.dumps(data).encode("utf-8"))


def _speed_up_storage(server) -> None:
    """Deferred metadata writes, appended resumable chunks, renamed finished uploads, backlog 128.

    The server handles one request at a time; the lock keeps the background writer from
    serialising the metadata while a request changes it.
    """
    from gcp_storage_emulator import storage as storage_module
    from gcp_storage_emulator.exceptions import BadRequest

    storage_cls = storage_module.Storage
    resumable_dir = storage_module.RESUMABLE_DIR

    def mark_dirty(self) -> None:
        _meta_dirty.add(self)

    def partial_path(self, file_id: str) -> Path | None:
        """The on-disk file of a resumable upload (None for the in-memory store)."""
        if self._use_memory_fs:
            return None
        return self._store._disk_path(self._object_path(resumable_dir, self.safe_id(file_id)))

    original_add, original_count, original_create = (
        storage_cls.add_to_resumable_upload, storage_cls.get_resumable_byte_count, storage_cls.create_file)
    completed: dict[str, bytes] = {}  # upload id -> the content its partial file holds, when complete

    def add_to_resumable_upload(self, file_id, content, total_size=None, expected_start=None):
        path = partial_path(self, file_id)
        if path is None:
            return original_add(self, file_id, content, total_size, expected_start)
        size = path.stat().st_size if path.is_file() else 0
        if expected_start is not None and expected_start != size:
            raise BadRequest(f"Invalid Content-Range start: expected {size}, got {expected_start}")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as f:
            f.write(content or b"")
        size += len(content or b"")
        if total_size is None or size < total_size:
            return None
        content = path.read_bytes()[:total_size]
        completed.clear()  # the request that completes an upload finishes it: keep only that one
        if size == total_size:
            completed[file_id] = content
        return content

    def get_resumable_byte_count(self, file_id):
        path = partial_path(self, file_id)
        if path is None:
            return original_count(self, file_id)
        return path.stat().st_size if path.is_file() else 0

    def create_file(self, bucket_name, file_name, content, file_obj, file_id=None):
        if not file_id or completed.pop(file_id, None) is not content or bucket_name not in self.buckets:
            return original_create(self, bucket_name, file_name, content, file_obj, file_id)
        target = self._store._disk_path(self._object_path(bucket_name, file_name))
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial_path(self, file_id), target)  # it holds exactly `content`
        self.objects.setdefault(bucket_name, {})[file_name] = file_obj
        self.delete_resumable_file_obj(file_id)
        self._write_config_to_file()

    storage_cls._write_config_to_file = mark_dirty
    storage_cls.add_to_resumable_upload = add_to_resumable_upload
    storage_cls.get_resumable_byte_count = get_resumable_byte_count
    storage_cls.create_file = create_file

    original_handle = server.Router.handle

    def handle(self, method):
        with _meta_lock:
            return original_handle(self, method)

    server.Router.handle = handle

    class Backlog128(server.server.HTTPServer):
        request_queue_size = 128

    def run(self) -> None:  # APIThread.run with the larger backlog
        self._httpd = Backlog128((self._host, self._port), server.partial(server.RequestHandler, self._storage))
        self.is_running.set()
        self._httpd.serve_forever()

    server.APIThread.run = run

    def write_periodically() -> None:
        while True:
            time.sleep(META_WRITE_INTERVAL_S)
            flush_metadata()

    threading.Thread(target=write_periodically, name="gcs-emulator-meta", daemon=True).start()


def _send_generation_headers(server) -> None:
    """Media downloads get `x-goog-generation` / `x-goog-metageneration`, as from real GCS.

    tensorstore (Orbax's storage) reads the object's generation from that header and fails every
    read without it ("Malformed StorageGeneration"); gcsfs does not need it.
    """
    from gcp_storage_emulator.handlers import objects

    original = objects.download

    def download(request, response, storage, *args, **kwargs):
        original(request, response, storage, *args, **kwargs)
        if response.status.value in (200, 206):
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = obj["generation"]
            response["x-goog-metageneration"] = obj["metageneration"]

    objects.download = download  # objects.get calls it for `alt=media`
    for _, methods in server.HANDLERS:
        for method, handler in methods.items():
            if handler is original:
                methods[method] = download


@dataclass(frozen=True)
class GcsEmulator:
    """A running emulator: its endpoint, its bucket, and where it stores objects."""

    endpoint: str
    bucket: str
    data_dir: Path


@contextmanager
def running_emulator(data_dir: Path, bucket: str = BUCKET) -> Iterator[GcsEmulator]:
    """Start the patched emulator on 127.0.0.1 (free port) and stop it on exit."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir.parent / f"{data_dir.name}.emulator.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--data-dir", str(data_dir), "--bucket", bucket],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("PORT "):
            raise RuntimeError(f"gcs emulator did not start (rc={proc.poll()}): {log.read_text()[-2000:]}")
        port = int(line.split()[1])
        _wait_for_port(port)
        yield GcsEmulator(f"http://127.0.0.1:{port}", bucket, data_dir)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _wait_for_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise


def dvc_env(tmp_root: Path) -> dict[str, str]:
    """Environment for DVC/git subprocesses: emulator settings, no analytics, isolated caches."""
    env = dict(os.environ, **GCS_TEST_ENV)
    env["DVC_SITE_CACHE_DIR"] = str(tmp_root / "dvc-site-cache")
    env["DVC_GLOBAL_CONFIG_DIR"] = str(tmp_root / "dvc-global-config")
    env.pop("STORAGE_EMULATOR_HOST", None)
    return env


def add_dvc_remote(repo: Path, emulator: GcsEmulator, env: dict[str, str], name: str = "gcs",
                   prefix: str = "dvc", local: bool = True) -> None:
    """Make `gs://<bucket>/<prefix>` on the emulator the default remote.

    In `.dvc/config.local` (the default: test settings stay out of the committed config), or in
    `.dvc/config` when ``local`` is false (a test repo whose commits should carry the remote).
    """

    def dvc(*args: str) -> None:
        subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=env, check=True, capture_output=True)

    level = ["--local"] if local else []
    dvc("remote", "add", *level, "-d", name, f"gs://{emulator.bucket}/{prefix}")
    dvc("remote", "modify", *level, name, "endpointurl", emulator.endpoint)
    dvc("remote", "modify", *level, name, "allow_anonymous_login", "true")


@contextmanager
def local_remote(repo: Path, emulator: GcsEmulator, env: dict[str, str],
                 prefix: str = "dvc") -> Iterator[None]:
    """`add_dvc_remote` to a repo that has no `.dvc/config.local`, removed again on exit.

    For repos shared between tests (the `pipeline_repo` fixture): they are left as found.
    """
    config_local = repo / ".dvc" / "config.local"
    if config_local.exists():
        raise RuntimeError(f"{config_local} exists: it would be overwritten and then deleted")
    try:
        add_dvc_remote(repo, emulator, env, prefix=prefix)
        yield
    finally:
        config_local.unlink(missing_ok=True)


def _request(emulator: GcsEmulator, method: str, path: str, body: dict | None) -> dict:
    """A JSON API request to the emulator, never through a proxy."""
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{emulator.endpoint}/storage/v1/{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10) as answer:
        return json.loads(answer.read() or b"{}")


def create_bucket(emulator: GcsEmulator, name: str) -> None:
    """buckets.insert (no error when it exists)."""
    import urllib.error

    try:
        _request(emulator, "POST", "b?project=proj-1", {"name": name})
    except urllib.error.HTTPError as e:
        if e.code != 409:
            raise


def set_bucket_policy(emulator: GcsEmulator, bindings: list[dict], bucket: str | None = None) -> None:
    """buckets.setIamPolicy: the bucket's IAM policy becomes ``bindings`` ({role, members[, condition]})."""
    _request(emulator, "PUT", f"b/{bucket or emulator.bucket}/iam", {"bindings": bindings})


def pipeline_stages(repo: Path) -> dict[str, dict[str, bool]]:
    """The stages of the repo's dvc.yaml: ``{name: {output path: DVC caches it}}``.

    (dvc.lock may still hold entries of stages since removed from dvc.yaml: this ignores them.)
    """
    from dvc.repo import Repo

    with Repo(str(repo)) as dvc_repo:
        return {s.name: {str(o.def_path): o.use_cache for o in s.outs}
                for s in dvc_repo.index.stages}


def missing_git_outputs(clone: Path) -> list[str]:
    """Outputs DVC leaves to git (`cache: false`) that a git clone lacks.

    Neither git (it ignores them) nor `dvc pull` (they are not cached) brings these, so `dvc repro`
    in the clone reruns their stages.
    """
    return sorted(path for outs in pipeline_stages(clone).values() for path, cached in outs.items()
                  if not cached and not (clone / path).exists())


def _serve(data_dir: str, bucket: str) -> None:
    """Launcher body: patch, bind 127.0.0.1:0, announce the port, serve until terminated."""
    import signal

    from gcp_storage_emulator.server import create_server

    patch_emulator()
    server = create_server("127.0.0.1", 0, default_bucket=bucket, data_dir=data_dir)
    server.start()
    print(f"PORT {server._api._httpd.server_address[1]}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (server.stop(), flush_metadata(), sys.exit(0)))
    signal.pause()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `fakes.discovery` from tests/
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--bucket", default=BUCKET)
    options = parser.parse_args()
    _serve(options.data_dir, options.bucket)
