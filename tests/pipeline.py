"""A throwaway copy of the project to run the real pipeline in, and DVC commands against it.

The copy holds what git would commit (tracked and untracked-but-not-ignored files), is a git repo of
its own with one commit (DVC experiments need one), and shares the JAX compile cache with the
checkout so that repeated test sessions skip XLA compiles.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# What a test copy changes in the committed params.yaml: the RL warm-up runs 120 steps, not 400 (enough for
# the answer format: tests/pipeline/test_pipeline_rl.py), GRPO 8 steps, not the demo's 100, and its eval takes 16
# prompts, not 96. The code path is the same; the demo's settings would cost about 10 minutes more in the
# shared pipeline and in every test that reruns train_rl (docs/testing.md). The demo's own result is
# metrics/rl/train_rl.json.
TEST_PARAMS = {"    steps: null                  # SFT warm-up before GRPO (0: none)\n": "    steps: 120\n",
               "    num_batches: null\n": "    num_batches: 8\n", "    num_test_batches: null\n": "    num_test_batches: 1\n",
               "    num_problems: null           # held-out problems each model is scored on (null: the preset's)\n":
                   "    num_problems: 64\n"}
GIT_ID = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def env() -> dict[str, str]:
    """Environment for pipeline commands: the project's venv first on PATH, no cloud probing. Without
    DECOUPLE_GCLOUD: the hardware preset alone decides it (the canary runs' preset leaves it out)."""
    venv_bin = str(Path(sys.executable).parent)
    return {
        **{k: v for k, v in os.environ.items() if k != "DECOUPLE_GCLOUD"}, **GIT_ID,
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "NO_GCE_CHECK": "true", "DVC_NO_ANALYTICS": "1",
    }


def copy_project(dest: Path, test_params: bool = True) -> Path:
    """Copy the project into ``dest`` (a new git repo with one commit) and return it. Its params.yaml is
    the committed one (a `dvc exp run -S ...` in the workspace rewrites that file: tests/families.py)
    with :data:`TEST_PARAMS` applied unless ``test_params`` is False (the committed record's checks).
    In a test copy, whose committed params.yaml has them already, they stay as they are."""
    from families import committed_params_text

    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    params = committed_params_text()
    for old, new in TEST_PARAMS.items() if test_params else ():
        assert params.count(old) + params.count(new) == 1, f"params.yaml has no line {old!r}: update TEST_PARAMS"
        params = params.replace(old, new)
    (dest / "params.yaml").write_text(params)
    cache = ROOT / "work" / "jax_cache"
    cache.mkdir(parents=True, exist_ok=True)
    (dest / "work").mkdir(exist_ok=True)
    (dest / "work" / "jax_cache").symlink_to(cache)
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "commit", "-qm", "test copy")
    return dest


def fresh_clone(repo: Path, dest: Path) -> Path:
    """`git clone` of ``repo`` with its DVC outputs checked out: DVC's cache is shared, standing in
    for `dvc pull` from a remote; a warm XLA compile cache, as a set-up VM keeps."""
    git(dest.parent, "clone", "-q", str(repo), str(dest))
    dvc(dest, "cache", "dir", "--local", str(repo / ".dvc" / "cache"))
    dvc(dest, "checkout")
    (dest / "work").mkdir()
    (dest / "work" / "jax_cache").symlink_to(ROOT / "work" / "jax_cache")
    return dest


def md5_tree(root: Path, paths: list[str]) -> dict[str, str]:
    """md5 of every file under each of `paths` (files or directories), keyed by relative path."""
    import hashlib

    files = [f for rel in paths for f in ([root / rel] if not (root / rel).is_dir()
                                          else sorted((root / rel).rglob("*"))) if not f.is_dir()]
    return {str(f.relative_to(root)): hashlib.md5(f.read_bytes()).hexdigest() for f in files}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, env=env(), capture_output=True, text=True, check=True).stdout


def dvc(repo: Path, *args: str, check: bool = True, timeout: float = 1800,
        extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``dvc <args>`` in ``repo``; output is captured (stdout + stderr)."""
    proc = subprocess.run(["dvc", *args], cwd=repo, env={**env(), **(extra_env or {})}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"dvc {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    return proc


def ran_stages(output: str) -> set[str]:
    """The stages DVC says it ran (``Running stage 'x':``)."""
    return set(re.findall(r"Running stage '([^']+)'", output))


def reproduced_stages(output: str) -> set[str]:
    """Stages DVC ran or restored from its run-cache (``Stage 'x' is cached - skipping run``)."""
    return ran_stages(output) | set(re.findall(r"Stage '([^']+)' is cached - skipping run", output))


def export_logit_diff(repo: Path, branch: str, maxtext_name: str, tiny: str, n_tokens: int = 100) -> float:
    """Max |logit| difference: numpy forward of a branch's exported HF directory vs MaxText's own
    forward of the trained params it was exported from (docs/logit-check.md)."""
    import maxtext_forward
    import numpy as np
    from mtpipe.evaluation import numpy_forward

    import families
    from mtpipe.data import embedded

    ids = np.random.default_rng(0).integers(4, embedded.TINY_VOCAB, size=n_tokens)
    ours = maxtext_forward.logits(repo / f"artifacts/{branch}/trained/model_params", maxtext_name, ids,
                                  families.twins()[tiny].overrides)
    ref = numpy_forward.logits(repo / f"artifacts/{branch}/hf", ids, match_maxtext=True)
    assert ref.std() > 0.1, "degenerate logits would make the comparison meaningless"
    return float(np.abs(ours - ref).max())


def orbax_arrays(path: Path, strip: str, add: str) -> dict[str, np.ndarray]:
    """Leaves of an orbax pytree checkpoint as numpy, keyed by path with `strip` -> '' and `add` appended."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    ckptr = ocp.PyTreeCheckpointer()
    meta = ckptr.metadata(path).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    tree = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
    leaves = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}
    return {k.replace(strip, "").removesuffix(add): v for k, v in leaves.items() if k.startswith(strip)}


# --- Canary runs: the pipeline with a fake HF_TOKEN, on the code path a TPU VM takes (docs/secrets.md) ---

def take_vm_code_path(repo: Path) -> None:
    """In a test copy: drop DECOUPLE_GCLOUD from the CPU hardware preset, as on the VM (v6e-8 does not
    set it), so MaxText imports its Google Cloud modules and writes tensorboard (with its config dump)."""
    preset = repo / "conf" / "hardware" / "cpu.yaml"
    text = preset.read_text()
    assert "DECOUPLE_GCLOUD" in text, "the CPU preset no longer sets DECOUPLE_GCLOUD: update this helper"
    preset.write_text("".join(line for line in text.splitlines(keepends=True) if "DECOUPLE_GCLOUD" not in line))
    git(repo, "commit", "-qam", "MaxText not decoupled from Google Cloud (the VM's code path)")


@dataclass
class CanaryEnv:
    """A fake Hub token and the fresh HOME / TMPDIR / DVC site cache a canary run writes to."""

    canary: str
    home: Path
    tmpdir: Path
    dvc_site_cache: Path
    marker: str = field(default_factory=lambda: "MTPIPE_CANARY_RUN=" + secrets.token_hex(8))

    @classmethod
    def create(cls, base: Path) -> CanaryEnv:
        dirs = [base / name for name in ("home", "tmp", "dvc-site-cache")]
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        return cls("hf_canary" + secrets.token_hex(16), *dirs)

    def env(self) -> dict[str, str]:
        """What a canary run adds to :func:`env`; XDG / HF cache variables point into HOME.

        SHELL=/bin/sh: DVC runs each stage as `$SHELL -c CMD`; dash (Debian's /bin/sh, and what DVC
        gets where SHELL is unset, as in CI) stays the stage's parent, holding the token, unless the
        command starts with `exec`, while bash replaces itself and would hide a missing `exec`."""
        cache = self.home / ".cache"
        name, value = self.marker.split("=")
        return {name: value, "SHELL": "/bin/sh", "HF_TOKEN": self.canary, "HUGGING_FACE_HUB_TOKEN": self.canary, "HOME": str(self.home),
                "TMPDIR": str(self.tmpdir), "DVC_SITE_CACHE_DIR": str(self.dvc_site_cache),
                "XDG_CACHE_HOME": str(cache), "XDG_CONFIG_HOME": str(self.home / ".config"),
                "XDG_DATA_HOME": str(self.home / ".local" / "share"), "HF_HOME": str(cache / "huggingface")}

    def save(self, path: Path, findings: dict) -> None:
        """Keep the run's facts beside (not inside) the searched directories, for a reusing session."""
        path.write_text(json.dumps({**{k: str(v) for k, v in asdict(self).items()}, "findings": findings}))

    @classmethod
    def load(cls, path: Path) -> tuple[CanaryEnv, dict]:
        """The canary environment and the findings that :meth:`save` kept."""
        data = json.loads(path.read_text())
        findings = data.pop("findings")
        return cls(data.pop("canary"), **{k: Path(v) for k, v in data.items() if k != "marker"},
                   marker=data["marker"]), findings

    def searched_dirs(self, repo: Path) -> list[Path]:
        """Every place a run writes to: the repo (work/, .dvc/cache, .git), HOME, TMPDIR, DVC's site
        cache, and the tensorboard directory decoupled MaxText keeps inside its installation."""
        maxtext_tb = Path(sysconfig.get_paths()["purelib"]) / "local_tensorboard"  # see max_utils.py
        return [repo, self.home, self.tmpdir, self.dvc_site_cache, *([maxtext_tb] if maxtext_tb.is_dir() else [])]

    def search(self, repo: Path, watch: ProcessWatch) -> dict:
        """Findings of a run: the processes that held the canary and the files that hold it."""
        return {"processes": watch.record(), "files": files_containing(self.canary, self.searched_dirs(repo))}


def files_containing(needle: str, roots: list[Path]) -> dict:
    """``found``: every file under ``roots`` whose raw bytes contain ``needle``; ``files``/``bytes``:
    how much was searched. Symlinked directories are followed (work/jax_cache is one), each once."""
    data, found, seen, files, size = needle.encode(), [], set(), 0, 0
    for root in roots:
        for folder, dirs, names in os.walk(root, followlinks=True):
            real = os.path.realpath(folder)
            if real in seen:
                dirs.clear()
                continue
            seen.add(real)
            for name in names:
                path = os.path.join(folder, name)
                if os.path.isfile(path):
                    files, size = files + 1, size + os.path.getsize(path)
                    if _file_contains(path, data):
                        found.append(path)
    return {"found": found, "files": files, "bytes": size}


def _file_contains(path: str, data: bytes, chunk: int = 1 << 22) -> bool:
    """Chunked search, overlapping by len(data) so a match across a chunk boundary is found."""
    with open(path, "rb") as f:
        tail = b""
        while block := f.read(chunk):
            if data in tail + block:
                return True
            tail = block[-len(data):]
    return False


@dataclass
class ProcessSeen:
    """A process of a canary run that held the canary in its argv or its environment."""

    pid: int
    ppid: int
    cmdline: str          # with the canary replaced by <canary>
    in_argv: bool
    in_environ: bool
    has_children: bool


@dataclass
class ProcessWatch:
    """Samples /proc while a canary run goes on: every process holding ``marker`` (set only in the
    run's environment, so inherited by all its processes) or the canary, whatever its ancestry.

    ``commands`` collects the command lines of the run's processes (proof that MaxText was sampled);
    ``holders`` the processes that held the canary, each (pid, argv, environ) state once.
    """

    canary: str
    marker: str
    interval: float = 0.5  # one scan costs ~25 ms of CPU; MaxText processes live 10 s and more
    commands: set[str] = field(default_factory=set)
    holders: list[ProcessSeen] = field(default_factory=list)

    def __enter__(self) -> ProcessWatch:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        canary, marker = self.canary.encode(), self.marker.encode()
        procs: dict[int, tuple[int, bytes, bytes]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
                cmdline = Path(entry.path, "cmdline").read_bytes()
                environ = Path(entry.path, "environ").read_bytes()
            except OSError:  # gone, or not ours
                continue
            procs[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmdline, environ)
        parents = {ppid for ppid, _, _ in procs.values()}
        for pid, (ppid, cmdline, environ) in procs.items():
            if marker not in environ and canary not in environ and canary not in cmdline:
                continue
            shown = cmdline.replace(b"\0", b" ").decode(errors="replace").replace(self.canary, "<canary>").strip()
            self.commands.add(shown)
            if canary in cmdline or canary in environ:
                seen = ProcessSeen(pid, ppid, shown, canary in cmdline, canary in environ, pid in parents)
                if seen not in self.holders:
                    self.holders.append(seen)

    def record(self) -> dict:
        """What was seen, as JSON data (the canary itself never appears in it)."""
        return {"commands": sorted(self.commands), "holders": [asdict(h) for h in self.holders]}


# --- Interrupted runs: a kill point the test chooses, whatever the machine's speed (docs/testing.md) ---

HOLD_LINE = "mtpipe: holding after step {step} "


def start_held(repo: Path, target: str, step: int, log: Path, extra_env: dict[str, str] | None = None,
               timeout: float = 900, stdout: IO[str] | None = None) -> subprocess.Popen:
    """Start ``dvc repro -f -s --no-run-cache <target>`` (that stage alone) in a process group of its own, with MaxText
    holding after ``step`` (MTPIPE_HOLD_AFTER_STEP: that step's checkpoint and loss row are written);
    return once the stage's ``log`` says it holds. The caller kills the group. What DVC and the stage
    print goes to ``stdout`` (a file; discarded when None)."""
    offset = log.stat().st_size if log.exists() else 0
    proc = subprocess.Popen(["dvc", "repro", "-f", "-s", "--no-run-cache", target], cwd=repo,
                            env={**env(), **(extra_env or {}), "MTPIPE_HOLD_AFTER_STEP": str(step)},
                            stdout=stdout or subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    deadline, line = time.monotonic() + timeout, HOLD_LINE.format(step=step)
    while not (log.exists() and line in log.read_text(errors="replace")[offset:]):
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_group(proc)
            raise AssertionError(f"{target} never held after step {step} (exit {proc.returncode}); log: {log}")
        time.sleep(0.5)
    return proc


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``proc``'s whole process group (DVC, the stage, MaxText) and reap ``proc``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    proc.wait()


def group_alive(leader: subprocess.Popen) -> bool:
    """Whether any process of ``leader``'s process group still runs (the leader reaped if it ended:
    a zombie still counts as a member)."""
    leader.poll()
    try:
        os.killpg(leader.pid, 0)
    except ProcessLookupError:
        return False
    return True


def csv_rows(path: Path) -> list[dict[str, str]]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))
