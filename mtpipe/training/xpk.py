"""A training stage's MaxText command as an xpk workload on a GKE TPU slice (``hardware.backend: xpk``).

On this machine, :func:`run` (called by mtpipe.training.backend for train_sft and train_rl):

1. checks before it submits or uploads anything: the ``xpk:`` section of the hardware preset is
   filled in, ``MTPIPE_WORK_BUCKET`` holds the run directory (the hosts share no disk), the ``xpk``
   binary exists (``MTPIPE_XPK`` may name it);
2. makes sure the image exists (:func:`mtpipe.training.image.ensure`: built and pushed once per tag);
3. uploads the local files the command names (converted checkpoint, dataset files, tokenizer) once,
   content-addressed, to ``<work bucket>/inputs/<digest>/`` (skipped when they are there);
4. runs ``xpk workload create`` (multi-controller JAX, as MaxText's sft_on_multi_host.md) or
   ``xpk workload create-pathways`` (train_rl, or ``hardware.xpk.pathways``, as rl_on_multi_host.md)
   with the stage's own MaxText module and arguments, local paths mapped to the bucket;
5. waits: polls ``xpk workload list``, prints the training steps from the workload's log in the
   bucket, writes that log to the stage's log file and raises :class:`WorkloadFailed` (naming the
   workload, its state and the log) when it fails. On success the stage reads its checkpoints from
   the bucket as after a local run (mtpipe.maxtext.run_dir).

In the pod, the workload's command starts with ``python3 -m mtpipe.training.xpk_pod`` (the pod's
side, mtpipe/training/xpk_pod.py), which mirrors its log and MaxText's metrics file into the run
directory, where :func:`run` reads them. No secret reaches the workload: its inputs are the pinned
files hf_download fetched, so it never calls the Hub.
docs/multihost.md has the setup, the costs and what is tested where.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mtpipe.errors import ConfigError
from mtpipe.maxtext import runner
from mtpipe.maxtext.commands import TRAIN_RL, MaxTextCommand
from mtpipe.maxtext.run_dir import WORK_BUCKET_ENV, gcs, work_bucket
from mtpipe.pipeline.view import View
from mtpipe.pipeline.schema import Xpk
from mtpipe.training import image
from mtpipe.training.xpk_pod import LOG_DIR, POD_DIR

XPK_ENV = "MTPIPE_XPK"
INSTALL_FIX = ("install xpk in its own virtual environment (`python3 -m venv ~/xpk && ~/xpk/bin/pip install xpk`; "
               "it also needs gcloud, kubectl and docker: github.com/AI-Hypercomputer/xpk docs/installation.md) "
               f"and put it on PATH, or export {XPK_ENV}=/path/to/xpk")
POLL_S = 30.0              # between two `xpk workload list`
MISSING_POLLS = 5          # a workload not listed this many polls in a row is gone
NO_LOG_HINT_S = 600.0      # running this long without a log: say where to look
NAME_LIMIT = 22            # Pathways: "<name>-pathways-head-0-0.<name>" must fit a 63-byte label
PATHWAYS_ENV = ("JAX_PLATFORMS=proxy", "JAX_BACKEND_TARGET=grpc://127.0.0.1:29000", "ENABLE_PATHWAYS_PERSISTENCE=1")
# What MaxText's Pathways tutorials add: checkpoints without OCDBT/zarr3, and one controller for all hosts.
PATHWAYS_ARGS = {"checkpoint_storage_use_zarr3": "false", "checkpoint_storage_use_ocdbt": "false",
                 "enable_single_controller": "true"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".gguf", ".msgpack", ".h5", ".ckpt", ".onnx")
GLOB = re.compile(r"[*?\[]")


class WorkloadFailed(runner.MaxTextFailed):
    """The xpk workload failed, used up its restarts, or disappeared."""

    def __init__(self, workload: str, state: str, log_path: Path) -> None:
        super().__init__(f"xpk workload {workload} {state}; log: {log_path}")
        self.workload, self.state, self.log_path = workload, state, log_path


# ---- the checks before anything is submitted -------------------------------------------------------

PLACEHOLDERS = {
    "cluster": "the name of the cluster `xpk cluster create-pathways --cluster NAME ...` made",
    "project": "its Google Cloud project",
    "zone": "its zone, e.g. us-east5-b",
    "docker_image": "an Artifact Registry repository you can push to, e.g. us-docker.pkg.dev/PROJECT/mtpipe/mtpipe",
}


def target(cfg: View) -> Xpk:
    """The hardware's xpk section, its placeholders filled in: one still null is named with the file
    to fill it in."""
    hardware, file = cfg.hardware, f"conf/hardware/{cfg.hardware.name}.yaml"
    section = hardware.xpk
    if section is None:
        raise ConfigError("hardware.xpk", "is missing, but backend: xpk needs the cluster and image",
                          f"add an xpk: section to {file} (conf/hardware/v6e-32.yaml has one)")
    needed = dict(PLACEHOLDERS)
    if section.provisioning == "reservation":
        needed["reservation"] = "the name of the capacity reservation the workload runs in"
    for key, what in needed.items():
        if not getattr(section, key):
            raise ConfigError(f"hardware.xpk.{key}", "is not set",
                              f"set {key}: <{what}> in the xpk: section of {file} (docs/multihost.md, \"Once\")")
    return section


def require_work_bucket() -> str:
    """MTPIPE_WORK_BUCKET: the hosts of a slice write one checkpoint together and share no disk."""
    bucket = work_bucket()
    if bucket is None:
        raise ConfigError(WORK_BUCKET_ENV, "is not set, but an xpk workload keeps MaxText's run directory and its "
                          "inputs in a bucket (the hosts of a slice share no disk)",
                          f"export {WORK_BUCKET_ENV}=gs://BUCKET/PREFIX for a bucket that this machine and the "
                          "cluster's nodes can write (roles/storage.objectUser)")
    return bucket


def xpk_binary() -> str:
    """The xpk executable: ``$MTPIPE_XPK`` or ``xpk`` on PATH."""
    name = os.environ.get(XPK_ENV) or "xpk"
    found = shutil.which(name)
    if found is None:
        raise ConfigError(XPK_ENV if os.environ.get(XPK_ENV) else "xpk", f"{name!r} is not an executable "
                          "(the xpk backend submits workloads with it)", INSTALL_FIX)
    return found


def workload_name(run_name: str) -> str:
    """A name xpk and Kubernetes accept, the same for the same run: lowercase letters, digits and
    dashes, at most :data:`NAME_LIMIT` characters (a shortened one ends in a digest of the run name)."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_name.lower()).strip("-")
    slug = slug if slug[:1].isalpha() else f"w-{slug}"
    if len(slug) <= NAME_LIMIT:
        return slug
    tail = hashlib.sha256(run_name.encode()).hexdigest()[:8]
    return f"{slug[:NAME_LIMIT - 9].rstrip('-')}-{tail}"


# ---- the workload's command ------------------------------------------------------------------------

@dataclass(frozen=True)
class Inputs:
    """Local files an argument names, as they go to the bucket: ``files`` relative to ``root``."""

    root: Path
    files: tuple[str, ...]

    def digest(self) -> str:
        """sha256 over each file's relative path, size and bytes: the upload's address."""
        h = hashlib.sha256()
        for rel in self.files:
            path = self.root / rel
            h.update(f"{rel}\0{path.stat().st_size}\0".encode())
            with open(path, "rb") as f:
                while chunk := f.read(1 << 23):
                    h.update(chunk)
        return h.hexdigest()


@dataclass
class Plan:
    """The workload's side of a command: its arguments, what to upload and what the pod fetches."""

    args: list[str]
    uploads: dict[str, Inputs] = field(default_factory=dict)      # bucket URL -> local files
    fetches: list[tuple[str, str]] = field(default_factory=list)  # (bucket URL, directory in the pod)
    metrics: tuple[Path, str] | None = None                       # (this machine's file, the pod's)


def _directory(path: Path, keep: Callable[[str], bool] = lambda rel: True) -> Inputs:
    """The files under ``path`` (those ``keep`` admits), relative to its parent: the bucket keeps its name."""
    files = [rel for rel in sorted(p.relative_to(path.parent).as_posix() for p in path.rglob("*") if p.is_file())
             if keep(rel)]
    if not files:
        raise FileNotFoundError(f"{path} holds no files to upload")
    return Inputs(path.parent, tuple(files))


def _glob(pattern: str) -> tuple[Inputs, str]:
    """The files a glob matches, relative to its last directory without wildcards; and the glob from there."""
    parts = Path(pattern).parts
    fixed = next(i for i, part in enumerate(parts) if GLOB.search(part)) if GLOB.search(pattern) else len(parts) - 1
    root, rest = Path(*parts[:fixed]), Path(*parts[fixed:]).as_posix()
    files = tuple(sorted(p.relative_to(root).as_posix() for p in root.glob(rest) if p.is_file()))
    if not files:
        raise FileNotFoundError(f"no files match {pattern}")
    return Inputs(root, files), rest


def _is_tokenizer_file(rel: str) -> bool:
    return not rel.endswith(WEIGHT_SUFFIXES) and "/original/" not in f"/{rel}"


def plan(cmd: MaxTextCommand, bucket: str, pathways: bool) -> Plan:
    """Map the command's local paths for the workload; fail on a local path it would not find.

    load_parameters_path, hf_train_files, hf_eval_files: uploaded, passed as gs:// URLs;
    tokenizer_path: the tokenizer files uploaded, copied into the pod (Hugging Face's loaders read
    local directories only); metrics_file: written in the pod, mirrored into the run directory;
    jax_cache_dir: the bucket's compile cache; Pathways: :data:`PATHWAYS_ARGS`.
    """
    out = Plan([])

    def upload(inputs: Inputs, rest: str) -> str:
        url = f"{bucket}/inputs/{inputs.digest()[:16]}"
        out.uploads[url] = inputs
        return f"{url}/{rest}"

    for arg in cmd.args:
        key, sep, value = arg.partition("=")
        if key == "load_parameters_path":
            value = upload(_directory(Path(value)), Path(value).name)
        elif key in ("hf_train_files", "hf_eval_files"):
            value = upload(*_glob(value))
        elif key == "tokenizer_path":
            url = upload(_directory(Path(value), _is_tokenizer_file), Path(value).name)
            value = f"{POD_DIR}/inputs/{url.removeprefix(bucket + '/inputs/')}"
            out.fetches.append((url, value))
        elif key == "metrics_file":
            out.metrics = (Path(value), f"{POD_DIR}/{Path(value).name}")
            value = out.metrics[1]
        elif key == "jax_cache_dir":
            value = f"{bucket}/jax-cache"
        elif key == "base_output_directory" and not value.startswith(f"{bucket}/"):
            raise ConfigError(WORK_BUCKET_ENV, f"is {bucket}, but the run directory is {value}",
                              "run the stage with the same MTPIPE_WORK_BUCKET the run directory was made with")
        elif pathways and key in PATHWAYS_ARGS:
            value = PATHWAYS_ARGS[key]
        elif value.startswith("/") and Path(value).exists():
            raise RuntimeError(f"{key}={value} names a file on this machine, which the workload cannot read; "
                               "mtpipe.training.xpk.plan must upload it")
        out.args.append(f"{key}{sep}{value}")
    if pathways:
        out.args += [f"{k}={v}" for k, v in PATHWAYS_ARGS.items() if not any(a.startswith(f"{k}=") for a in out.args)]
    return out


def workload_command(cmd: MaxTextCommand, p: Plan, run_url: str, pathways: bool) -> str:
    """``[Pathways env] python3 -m mtpipe.training.xpk_pod ... -- python3 -m <launcher> <module> <args>``."""
    pod = ["python3", "-m", "mtpipe.training.xpk_pod", "--run-dir", run_url]
    for url, directory in p.fetches:
        pod += ["--fetch", f"{url}={directory}"]
    if p.metrics:
        pod += ["--metrics", p.metrics[1]]
    main = ["python3", "-m", cmd.launcher, cmd.module, *p.args]
    return " ".join([*(PATHWAYS_ENV if pathways else ()), shlex.join([*pod, "--", *main])])


def create_args(t: Xpk, name: str, image_ref: str, command: str, env: dict[str, str], pathways: bool,
                bucket: str) -> list[str]:
    """The ``xpk workload create[-pathways]`` arguments (after the binary)."""
    args = ["workload", "create-pathways" if pathways else "create", *location(t), "--workload", name,
            "--docker-image", image_ref, "--tpu-type", t.tpu_type, "--num-slices", str(t.num_slices),
            "--max-restarts", str(t.max_restarts), "--priority", t.priority]
    if t.provisioning == "reservation":
        args += ["--reservation", str(t.reservation)]
    elif t.provisioning:
        args.append(f"--{t.provisioning}")
    if pathways:
        args += ["--pathways-gcs-location", f"{bucket}/pathways"]
    for key, value in env.items():
        args += ["--env", f"{key}={value}"]
    return [*args, "--command", command]


def location(t: Xpk) -> list[str]:
    return ["--cluster", t.cluster, "--project", t.project, "--zone", t.zone]


def _arg(args: list[str], key: str) -> str:
    return next(a.partition("=")[2] for a in args if a.startswith(f"{key}="))


# ---- upload, submit, wait ---------------------------------------------------------------------------

def upload_inputs(uploads: dict[str, Inputs]) -> None:
    """Upload each input set unless ``<url>/.complete`` says an earlier upload finished."""
    fs = gcs()
    for url, inputs in uploads.items():
        if fs.exists(f"{url}/.complete"):
            print(f"  inputs {url}: already in the bucket")
            continue
        size = sum((inputs.root / rel).stat().st_size for rel in inputs.files)
        print(f"  inputs {url}: uploading {len(inputs.files)} files, {size / 1e9:.2f} GB", flush=True)
        fs.put([str(inputs.root / rel) for rel in inputs.files], [f"{url}/{rel}" for rel in inputs.files])
        fs.pipe(f"{url}/.complete", "\n".join(inputs.files).encode())


@dataclass(frozen=True)
class Status:
    """One row of ``xpk workload list``: Kueue's latest condition of the workload."""

    state: str      # QuotaReserved, Admitted, Evicted, Finished
    message: str
    running: int    # TPU VMs running (or that ran)


def parse_list(output: str, name: str) -> Status | None:
    """The row of workload ``name`` in xpk's fixed-width table (columns where the header's titles start)."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Jobset Name")), None)
    if start is None:
        return None
    titles = [(m.start(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", lines[start])]
    for line in lines[start + 1:]:
        if line.startswith("[XPK]"):
            break
        cells = {title: line[pos:end].strip() for (pos, title), end in
                 zip(titles, [p for p, _ in titles[1:]] + [len(line)])}
        if cells.get("Jobset Name") == name:
            running = next((v for k, v in cells.items() if "Running" in k), "")
            return Status(cells.get("Status", ""), cells.get("Status Message", ""),
                          int(running) if running.isdigit() else 0)
    return None


class Workload:
    """One xpk workload: submitted, watched and deleted through the xpk CLI; its log read from the bucket."""

    def __init__(self, binary: str, t: Xpk, name: str, run_url: str, log_path: Path) -> None:
        self.binary, self.target, self.name, self.run_url, self.log_path = binary, t, name, run_url, log_path
        self.attempts: dict[str, int] = {}  # log object of each attempt -> bytes of it already shown
        self.first_step: tuple[int, float] | None = None  # (step, when) of the first step line shown

    def xpk(self, *args: str, record: bool = True, check: bool = True) -> subprocess.CompletedProcess:
        """Run xpk without Hub tokens in its environment. Its command line and output go to the log
        (``record``; the polls only when they fail); with ``check`` a failure raises WorkloadFailed."""
        result = subprocess.run([self.binary, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                errors="replace", env=runner.child_env({}))
        if record or result.returncode != 0:
            with open(self.log_path, "a", encoding="utf8") as log:
                log.write(runner.redact(f"# $ xpk {shlex.join(args)}\n{result.stdout}{result.stderr}"))
        if check and result.returncode != 0:
            tail = "".join((result.stdout + result.stderr).splitlines(keepends=True)[-20:])
            raise WorkloadFailed(self.name, f"could not be handled: `xpk {' '.join(args[:2])}` exited with "
                                 f"{result.returncode}:\n{runner.redact(tail)}", self.log_path)
        return result

    def status(self, check: bool = True) -> Status | None:
        """The workload's row of ``xpk workload list``; None when it is not listed (or, unchecked, xpk failed)."""
        listing = self.xpk("workload", "list", *location(self.target), "--filter-by-job", self.name, record=False,
                           check=check)
        return parse_list(listing.stdout, self.name) if listing.returncode == 0 else None

    def delete(self, check: bool = True) -> bool:
        return self.xpk("workload", "delete", *location(self.target), "--workload", self.name,
                        check=check).returncode == 0

    def wait(self, total_steps: int | None) -> None:
        """Until the workload finishes: progress lines from its log; raise WorkloadFailed unless it completed."""
        shown, missing, start, hinted = None, 0, time.monotonic(), False
        while True:
            status = self.status(check=False)
            missing = 0 if status else missing + 1
            if missing >= MISSING_POLLS:
                raise WorkloadFailed(self.name, f"is not listed by `xpk workload list` (deleted, or xpk failed "
                                     f"{missing} times in a row: see the log); if it still runs, `xpk workload "
                                     "delete` stops it", self.log_path)
            state = self.describe(status)
            if state != shown:
                print(f"  {self.name}: {state}", flush=True)
                shown = state
            self.progress(total_steps)
            if status and status.state == "Finished":
                if "failed" in status.message.lower():
                    restarts = max(len(self.attempts) - 1, 0)
                    raise WorkloadFailed(self.name, f"failed after {restarts} restarts (hardware.xpk.max_restarts: "
                                         f"{self.target.max_restarts}): {status.message}", self.log_path)
                return
            if (not hinted and not self.attempts and status and status.running
                    and time.monotonic() - start > NO_LOG_HINT_S):
                print(f"  {self.name}: no log yet; `kubectl get pods -l jobset.sigs.k8s.io/jobset-name={self.name}` "
                      "shows why (e.g. an image that cannot be pulled)", flush=True)
                hinted = True
            time.sleep(POLL_S)

    def describe(self, status: Status | None) -> str:
        if status is None:
            return "not listed"
        if status.state == "Finished":
            return f"finished: {status.message}"
        if status.state == "Evicted":
            return f"evicted ({status.message}); Kueue queues it again"
        if status.running == 0:
            return f"queued for {self.target.num_slices} x {self.target.tpu_type} ({status.state})"
        return f"running on {status.running} TPU VMs"

    def progress(self, total_steps: int | None) -> None:
        """Print the new step lines of the newest attempt's log; say when a new attempt (restart) began.
        A bucket error only skips this round: the log is a view, the workload runs on."""
        try:
            fs = gcs()
            for path in sorted(fs.glob(f"{self.run_url}/{LOG_DIR}/*.log")):
                if path not in self.attempts:
                    self.attempts[path] = 0
                    if len(self.attempts) > 1:
                        print(f"  {self.name}: restarted (attempt {len(self.attempts)}); MaxText resumes from the "
                              "bucket's latest checkpoint", flush=True)
            if not self.attempts:
                return
            newest = max(self.attempts)
            data = fs.cat_file(newest, start=self.attempts[newest])
        except OSError as err:  # gcsfs raises its HTTP and connection errors as OSError subclasses
            print(f"  {self.name}: could not read its log this round ({err})", flush=True)
            return
        complete = data[: data.rfind(b"\n") + 1]
        self.attempts[newest] += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            match = runner.STEP_LINE.search(line)
            if match:
                step = int(match["step"])
                self.first_step = self.first_step or (step, time.monotonic())
                print(runner.format_progress(step, total_steps, match["loss"], match["tps"],
                                             time.monotonic() - self.first_step[1], self.first_step[0]), flush=True)

    def write_logs(self) -> None:
        """Append every attempt's log of the first host to the stage's log file (Hub tokens masked)."""
        fs = gcs()
        paths = sorted(fs.glob(f"{self.run_url}/{LOG_DIR}/*.log"))
        with open(self.log_path, "a", encoding="utf8") as log:
            for i, path in enumerate(paths, 1):
                again = " (restarted)" if i > 1 else ""
                log.write(f"# attempt {i} of {len(paths)}{again}: gs://{path}\n")
                log.write(runner.redact(fs.cat_file(path).decode(errors="replace")))


def run(cfg: View, cmd: MaxTextCommand, log_path: Path, total_steps: int | None) -> None:
    """Run ``cmd`` as an xpk workload and wait for it; raise WorkloadFailed if it does not complete."""
    t = target(cfg)
    bucket = require_work_bucket()
    binary = xpk_binary()
    pathways = t.pathways or cmd.module == TRAIN_RL
    run_name = _arg(cmd.args, "run_name")
    run_url = f"{_arg(cmd.args, 'base_output_directory')}/{run_name}"
    p = plan(cmd, bucket, pathways)
    name = workload_name(run_name)
    image_ref = image.ensure(t.docker_image)
    upload_inputs(p.uploads)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf8") as log:
        log.write(f"$ {runner.redact(cmd.as_tutorial())}\n# as xpk workload {name} on cluster {t.cluster}\n")
    workload = Workload(binary, t, name, run_url, log_path)
    if workload.status() is not None:
        print(f"  {name}: a workload of that name exists (an earlier attempt of this stage); deleting it, the "
              "new one resumes from the bucket's checkpoints")
        workload.delete()
    print(f"  xpk workload {'create-pathways' if pathways else 'create'} {name}: {t.num_slices} x {t.tpu_type} "
          f"on cluster {t.cluster}, billed while it runs; run directory {run_url}", flush=True)
    start = time.monotonic()
    try:
        workload.xpk(*create_args(t, name, image_ref, workload_command(cmd, p, run_url, pathways), dict(cmd.env),
                                  pathways, bucket))
        workload.wait(total_steps)
    except KeyboardInterrupt:
        print(f"\n  interrupted: deleting workload {name} (its checkpoints stay in {run_url})", flush=True)
        if not workload.delete(check=False):
            print(f"  could not delete it: `xpk workload delete --workload {name} {shlex.join(location(t))}`")
        raise
    except WorkloadFailed:
        print(f"  {name}: kept for inspection (`kubectl get pods -l jobset.sigs.k8s.io/jobset-name={name}`); "
              "the next run of this stage deletes it", flush=True)
        raise
    finally:
        workload.write_logs()
        if p.metrics and gcs().exists(f"{run_url}/{p.metrics[0].name}"):
            gcs().get(f"{run_url}/{p.metrics[0].name}", str(p.metrics[0]))
    workload.delete()
    print(f"  done in {time.monotonic() - start:.1f}s (workload {name}, log: {log_path})", flush=True)
