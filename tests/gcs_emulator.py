"""A real GCS endpoint on 127.0.0.1 for tests: `gcp-storage-emulator` with one bug fixed.

Run as a module (`python tests/gcs_emulator.py --data-dir D --bucket B`) it is the launcher: it
patches the emulator, binds 127.0.0.1 on a free port and prints ``PORT <n>``. Imported, it gives
`running_emulator()` (a context manager starting that launcher), the `gcs_emulator` pytest fixture,
`dvc_env()`, `add_dvc_remote()`, `local_remote()`, and `pipeline_stages()` /
`missing_git_outputs()` (what a clone of a pipeline's repo needs).

The bug: the emulator parses a `multipart/related` upload with `email.parser`, which strips the
line break before each boundary as "CRLF or LF". gcsfs (uploads under 5 MiB) separates parts with a
bare LF, so a file ending in `\r` is read as ending in `\r\n` + boundary and silently loses its last
byte. `parse_multipart_related` takes the line break style from the first boundary line instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

# gcsfs otherwise tries a gRPC bucket lookup the emulator cannot answer (about 60 s per call), and
# google-auth probes the GCE metadata address. DVC must not send usage analytics anywhere.
GCS_TEST_ENV = {
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    "NO_GCE_CHECK": "true",
    "DVC_NO_ANALYTICS": "1",
}
BUCKET = "mtpipe-test"


def parse_multipart_related(body: bytes, content_type: str) -> dict:
    """Split a GCS multipart upload into ``{"meta", "content", "content-type"}`` byte-exactly."""
    match = re.search(r'boundary="?([^";]+)"?', content_type)
    if not match:
        raise ValueError(f"no boundary in Content-Type {content_type!r}")
    dash_boundary = b"--" + match.group(1).encode()
    rest = body[body.index(dash_boundary) + len(dash_boundary) :]
    eol = b"\r\n" if rest.startswith(b"\r\n") else b"\n"
    # Each piece starts with `eol` when a part follows, or with "--" after the closing delimiter.
    pieces = [p[len(eol) :] for p in rest.split(eol + dash_boundary) if not p.startswith(b"--")]
    if len(pieces) != 2:
        raise ValueError(f"expected 2 parts (metadata, media), got {len(pieces)}")
    parts = []
    for piece in pieces:
        head, _, payload = piece.partition(eol + eol)
        lines = (line.partition(":") for line in head.decode().split(eol.decode()))
        parts.append(({k.strip().lower(): v.strip() for k, _, v in lines}, payload))
    (_, meta), (media_headers, content) = parts
    return {
        "meta": json.loads(meta),
        "content": content,
        "content-type": media_headers.get("content-type", "application/octet-stream").split(";")[0],
    }


def patch_emulator() -> None:
    """Route `multipart/related` bodies through `parse_multipart_related`; keep the rest."""
    from gcp_storage_emulator import server

    original = server._read_data

    def read_data(request_handler, query):
        content_type = request_handler.headers.get("Content-Type") or ""
        if not content_type.startswith("multipart/related"):
            return original(request_handler, query)
        raw = server._decode_raw_data(server._read_raw_data(request_handler), request_handler)
        return parse_multipart_related(raw, content_type) if raw else None

    server._read_data = read_data


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


@pytest.fixture(scope="module")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsEmulator]:
    """One patched emulator per test module, storing objects under a temporary directory."""
    with running_emulator(tmp_path_factory.mktemp("gcs-data")) as emulator:
        yield emulator


def _serve(data_dir: str, bucket: str) -> None:
    """Launcher body: patch, bind 127.0.0.1:0, announce the port, serve until terminated."""
    import signal

    from gcp_storage_emulator.server import create_server

    patch_emulator()
    server = create_server("127.0.0.1", 0, default_bucket=bucket, data_dir=data_dir)
    server.start()
    print(f"PORT {server._api._httpd.server_address[1]}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (server.stop(), sys.exit(0)))
    signal.pause()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--bucket", default=BUCKET)
    options = parser.parse_args()
    _serve(options.data_dir, options.bucket)
