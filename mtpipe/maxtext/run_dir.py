"""Where a training stage keeps MaxText's run directory: this machine's ``work/``, or a GCS bucket.

MaxText resumes a run by its name: it restores the latest complete checkpoint under
``<base_output_directory>/<run_name>/checkpoints``. Run names are input digests (mtpipe.pipeline.stage), so
the same inputs find the same run directory. By default it is ``work/<stage>/<run_name>``: a killed
stage resumes on the same machine; ``MTPIPE_WORK_DIR=/ABSOLUTE/PATH`` moves it to
``<path>/<stage>/<run_name>`` (the TPU VM's conf/vm.yaml sets /dev/shm/mtpipe-work, where the
tutorials write: the boot disk holds no checkpoints; /dev/shm dies with the VM, so a replacement VM
resumes only from a work bucket). With ``MTPIPE_WORK_BUCKET=gs://BUCKET[/PREFIX]`` it is
``gs://BUCKET/PREFIX/<stage>/<run_name>``: a stage started with the same inputs on any machine (a
new VM after a Spot preemption, a fresh clone) resumes from the bucket. The variable is not a DVC
param because where scratch state lives changes no stage's result (docs/decisions/training.md); neither is
MTPIPE_WORK_DIR.

Files only this machine needs stay in ``work/<stage>/<run_name>`` (the scratch directory): the rl
warm-up's chat parquet, and MaxText's ``metrics_file``, which it appends to with ``open()``; the
stage mirrors that file into the bucket while MaxText runs, so a resumed run's loss curve is whole.
On success the stage moves (local) or downloads (bucket) the final params into its DVC output and
deletes the run directory; ``MTPIPE_WORK_BUCKET_KEEP=1`` keeps the bucket's copy.
A run directory has one holder at a time (:meth:`RunDir.leased`): a lease file, renewed while the
stage runs, so a second machine (or process) with the same recipe stops naming the holder instead
of training beside it and deleting the directory under it; a lease whose holder is gone (its process
ended on this host, or not renewed for STALE_S) is taken over, and the run resumes.
Credentials: Application Default Credentials, from the environment only.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mtpipe.errors import ConfigError
from mtpipe.maxtext.checkpoints import COMMIT_MARKER, latest_checkpoint, normalise_orbax_metadata
from mtpipe.pipeline import stage_table
from mtpipe.pipeline.stage import ROOT, WORK, recipe

if TYPE_CHECKING:
    import gcsfs

WORK_BUCKET_ENV = "MTPIPE_WORK_BUCKET"
WORK_DIR_ENV = "MTPIPE_WORK_DIR"
KEEP_ENV = "MTPIPE_WORK_BUCKET_KEEP"
BUCKET_URL = re.compile(r"gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[^\s]*)?")
MIRROR_EVERY_S = 5.0
LEASE = "mtpipe-lease.json"   # in the run directory: who trains there (RunDir.leased)
RENEW_S = 30.0                # how often the holder renews its lease
STALE_S = 180.0               # a lease not renewed for this long belongs to a run that is gone
DYING_S = 15.0                # how long a holder on this host gets to finish ending (SIGKILLed, tearing down)
BUCKET_FIX = (f"export {WORK_BUCKET_ENV}=gs://BUCKET/PREFIX for a bucket this machine's credentials can write "
              "(roles/storage.objectUser), or unset it to keep run directories in work/")


def work_bucket() -> str | None:
    """``gs://BUCKET[/PREFIX]`` from MTPIPE_WORK_BUCKET without a trailing slash; None when unset."""
    value = os.environ.get(WORK_BUCKET_ENV, "").strip()
    if not value:
        return None
    if not BUCKET_URL.fullmatch(value.rstrip("/")):
        raise ConfigError(WORK_BUCKET_ENV, f"{value!r} is not a gs://BUCKET[/PREFIX] URL", BUCKET_FIX)
    return value.rstrip("/")


def work_dir() -> Path:
    """Where local run directories live: MTPIPE_WORK_DIR (an absolute path), else this checkout's work/."""
    value = os.environ.get(WORK_DIR_ENV, "").strip()
    if not value:
        return WORK
    if not os.path.isabs(value):
        raise ConfigError(WORK_DIR_ENV, f"{value!r} is not an absolute path",
                          f"export {WORK_DIR_ENV}=/dev/shm/mtpipe-work (or another absolute path), "
                          "or unset it to keep run directories in work/")
    return Path(value)


def gcs() -> gcsfs.GCSFileSystem:
    """A new gcsfs file system: no listing cached from before MaxText wrote; endpoint and credentials
    from the environment (Application Default Credentials; STORAGE_EMULATOR_HOST in tests).
    Imported here: a run without a work bucket does not load it."""
    import gcsfs

    return gcsfs.GCSFileSystem(skip_instance_cache=True)


def check_writable(url: str) -> None:
    """Write and delete a probe object under ``url``; fail naming MTPIPE_WORK_BUCKET and the fix."""
    probe = f"{url}/.mtpipe-write-probe"
    try:
        fs = gcs()
        fs.pipe(probe, b"")
        fs.rm(probe)
    except Exception as err:  # gcsfs raises HTTP, auth and connection errors of many types
        raise ConfigError(WORK_BUCKET_ENV, f"cannot write to {url} ({type(err).__name__}: {err})",
                          BUCKET_FIX) from err


@dataclass(frozen=True)
class RunDir:
    """One MaxText run: ``base`` is its base_output_directory, ``scratch`` this machine's part of it."""

    base: str
    run_name: str
    scratch: Path

    @property
    def url(self) -> str:
        """The run directory MaxText writes (a local path or a gs:// URL)."""
        return f"{self.base}/{self.run_name}"

    @property
    def in_bucket(self) -> bool:
        return self.base.startswith("gs://")

    def latest_checkpoint(self, checkpoints: str = "checkpoints") -> int | None:
        """Highest complete checkpoint step under ``<run dir>/<checkpoints>``, if any.

        Orbax renames a finished step into place on a local disk; on GCS it writes
        ``<step>/commit_success.txt`` last, and MaxText restores only such steps."""
        if not self.in_bucket:
            return latest_checkpoint(Path(self.url) / checkpoints)
        markers = gcs().glob(f"{self.url}/{checkpoints}/*/{COMMIT_MARKER}")
        steps = [int(step) for step in (m.split("/")[-2] for m in markers) if step.isdigit()]
        return max(steps, default=None)

    def take(self, path: str, dest: Path) -> None:
        """Move (local: a rename, or a copy from another file system such as /dev/shm) or download
        (bucket) ``<run dir>/<path>`` to ``dest``, the same bytes wherever the run directory was
        (:func:`mtpipe.maxtext.checkpoints.normalise_orbax_metadata`)."""
        if self.in_bucket:
            gcs().get(f"{self.url}/{path}", str(dest), recursive=True)
        else:
            shutil.move(Path(self.url) / path, dest)
        normalise_orbax_metadata(dest)

    @contextlib.contextmanager
    def mirrored(self, local: Path) -> Iterator[None]:
        """Keep a copy of the scratch file ``local`` in the bucket run directory while the block runs.

        A new machine first gets the bucket's copy (if it has none of its own); then the file is
        uploaded every MIRROR_EVERY_S seconds when it changed, and once more at the end (also on
        failure). A SIGKILL loses at most the last MIRROR_EVERY_S seconds. Local runs: no-op."""
        if not self.in_bucket:
            yield
            return
        remote, fs = f"{self.url}/{local.name}", gcs()
        if not local.exists() and fs.exists(remote):
            fs.get(remote, str(local))
        stop = threading.Event()
        thread = threading.Thread(target=self._upload_changes, args=(local, remote, stop), daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    @staticmethod
    def _upload_changes(local: Path, remote: str, stop: threading.Event) -> None:
        """Upload ``local``'s complete lines when they changed, until ``stop`` (then once more)."""
        fs, uploaded = gcs(), b""
        while True:
            stopping = stop.wait(MIRROR_EVERY_S)
            data = local.read_bytes() if local.exists() else b""
            lines = data[: data.rfind(b"\n") + 1]  # a line MaxText is still writing waits for the next round
            if lines != uploaded:
                try:
                    fs.pipe(remote, lines)
                    uploaded = lines
                except Exception as err:  # a network blip must not stop training: retried next round
                    print(f"  could not mirror {local.name} to {remote}: {err}")
            if stopping:
                return

    @contextlib.contextmanager
    def leased(self) -> Iterator[None]:
        """Hold the run directory while the block runs: refuse, naming the holder, when another live run
        holds it; take it over from one that is gone (:meth:`_gone`); renew the lease every RENEW_S;
        release it at the end (:meth:`remove` deletes it with the directory)."""
        lease = self.lease()
        deadline = time.monotonic() + DYING_S
        while lease and not self._gone(lease) and lease.get("host") == socket.gethostname() \
                and time.monotonic() < deadline:   # a killed holder here may still be ending
            time.sleep(0.5)
        if lease and not (why := self._gone(lease)):
            raise ConfigError(self.url, f"is in use by {lease['holder']} (pid {lease['pid']}), training the same "
                              f"recipe since {lease['start']}, lease renewed {self._age(lease):.0f} s ago",
                              "wait for that run to end (its output then comes with `dvc pull`), or stop it; a "
                              f"lease not renewed for {STALE_S:.0f} s is taken over and the run resumed")
        if lease:
            print(f"  taking over {self.url} from {lease['holder']} (pid {lease['pid']}): {why}")
        now = _now()
        mine = {"holder": f"{getpass.getuser()}@{socket.gethostname()}", "host": socket.gethostname(),
                "pid": os.getpid(), "pid_started": _started(os.getpid()), "token": secrets.token_hex(8),
                "start": now, "renewed": now}
        self._write(LEASE, json.dumps(mine).encode())
        stop = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(mine, stop), daemon=True)
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join()
            with contextlib.suppress(Exception):   # gone with the directory after success
                if (self.lease() or {}).get("token") == mine["token"]:
                    self._delete(LEASE)

    def lease(self) -> dict | None:
        """The run directory's lease as its holder last wrote it (None: nobody holds it)."""
        found = self._read(LEASE)
        return json.loads(found) if found else None

    def holder(self) -> str | None:
        """Who holds the run directory and still runs (None: nobody, or a holder that is gone)."""
        lease = self.lease()
        return lease["holder"] if lease and not self._gone(lease) else None

    def _renew(self, mine: dict, stop: threading.Event) -> None:
        while not stop.wait(RENEW_S):
            try:
                self._write(LEASE, json.dumps(mine | {"renewed": _now()}).encode())
            except Exception as err:  # a network blip must not stop training: renewed next round
                print(f"  could not renew the lease of {self.url}: {err}")

    @staticmethod
    def _age(lease: dict) -> float:
        return (datetime.now(timezone.utc) - datetime.fromisoformat(lease["renewed"])).total_seconds()

    def _gone(self, lease: dict) -> str | None:
        """Why the lease's holder no longer runs (None while it may): its process ended on this host, or
        it was not renewed for STALE_S (another host: killed, its VM preempted)."""
        if lease.get("host") == socket.gethostname() and not _alive(int(lease["pid"]), lease.get("pid_started")):
            return f"its process ended on {lease['host']}"
        if (age := self._age(lease)) > STALE_S:
            return f"not renewed for {age:.0f} s"
        return None

    def _read(self, name: str) -> bytes | None:
        path = f"{self.url}/{name}"
        if self.in_bucket:
            fs = gcs()
            return fs.cat(path) if fs.exists(path) else None
        return Path(path).read_bytes() if Path(path).is_file() else None

    def _write(self, name: str, data: bytes) -> None:
        if self.in_bucket:
            gcs().pipe(f"{self.url}/{name}", data)
        else:
            Path(self.url).mkdir(parents=True, exist_ok=True)
            tmp = Path(self.url) / f".{name}.partial"
            tmp.write_bytes(data)
            os.replace(tmp, Path(self.url) / name)

    def _delete(self, name: str) -> None:
        if self.in_bucket:
            gcs().rm(f"{self.url}/{name}")
        else:
            (Path(self.url) / name).unlink(missing_ok=True)

    def size(self) -> int:
        """The bytes the run directory holds."""
        if self.in_bucket:
            return int(gcs().du(self.url))
        return sum(p.stat().st_size for p in Path(self.url).rglob("*") if p.is_file())

    def delete(self) -> None:
        """Delete the run directory and this machine's scratch part of it."""
        if self.in_bucket:
            gcs().rm(self.url, recursive=True)
        shutil.rmtree(self.scratch, ignore_errors=True)  # a local run directory is its own scratch

    def remove(self) -> None:
        """After success: delete the run directory (the bucket's kept with MTPIPE_WORK_BUCKET_KEEP=1)."""
        if self.in_bucket and os.environ.get(KEEP_ENV) == "1":
            print(f"  {KEEP_ENV}=1: keeping {self.url}")
            shutil.rmtree(self.scratch, ignore_errors=True)
        else:
            self.delete()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _started(pid: int) -> str | None:
    """When process ``pid`` started (Linux: /proc/<pid>/stat's start time, in clock ticks since boot),
    which tells it from a later process that got the same pid; None where /proc is not there."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None = None) -> bool:
    """Whether process ``pid`` of this host still runs: not ended, not a zombie (a killed process whose
    parent has not reaped it), and, where ``started`` is known, not a later process with its pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X") and (started is None or _started(pid) == started)


TRAINING = tuple((stage, branch) for stage in stage_table.TRAINING for branch in stage_table.BY_NAME[stage].branches)


def run_name(stage: str, branch: str) -> str:
    """The run name of ``stage`` in ``branch`` as its view and inputs are now: its recipe's digest
    (:func:`mtpipe.pipeline.stage.recipe`), so the same recipe finds the same run directory."""
    declared = stage_table.BY_NAME[stage]  # the inputs its recipe covers besides its view: what it reads
    digest = recipe(branch, stage, *(ROOT / declared.path(path, branch) for path in declared.reads.values()))[:12]
    return f"train_sft-{branch}-{digest}" if stage == "train_sft" else f"train_rl-{digest}"


def run_dirs(base: str) -> list[RunDir]:
    """The run directories under ``base`` (a local path or a gs:// URL; none where it does not exist)."""
    if base.startswith("gs://"):
        fs = gcs()
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)] if fs.exists(base) else []
    else:
        names = sorted(p.name for p in Path(base).iterdir() if p.is_dir()) if Path(base).is_dir() else []
    scratch = WORK / base.rsplit("/", 1)[-1] if base.startswith("gs://") else Path(base)  # as run_dir() has it
    return [RunDir(base, name, scratch / name) for name in names]


def run_dir(stage: str, run_name: str) -> RunDir:
    """Where ``stage`` keeps run ``run_name``: in the work bucket, checked writable, else in
    :func:`work_dir` (then the scratch directory is the run directory itself)."""
    bucket = work_bucket()
    if bucket is None:
        local = work_dir() / stage
        return RunDir(str(local), run_name, local / run_name)
    scratch = WORK / stage / run_name
    run = RunDir(f"{bucket}/{stage}", run_name, scratch)
    check_writable(run.url)
    return run
