"""The pipeline on the VM as DVC experiments: HEAD shipped as a git bundle, the run script
(secrets on stdin, the hardware's environment, `dvc exp run`), the experiments it made brought back."""

from __future__ import annotations

import itertools
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from mtpipe.cloud.on_vm.ssh import Remote, check
from mtpipe.cloud.settings.vm_config import VmConfig, VmError
from mtpipe.errors import ConfigError


def repo_root() -> Path:
    """The git work tree doit runs in (the code vm_run ships)."""
    out = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if out.returncode != 0:
        raise VmError(f"{Path.cwd()} is not a git repository: run doit from the project checkout")
    return Path(out.stdout.strip())


def hardware_env(root: Path, hardware: str | None) -> dict[str, str]:
    """`env:` of conf/hardware/<hardware>.yaml in the shipped repo ({} when hardware is null)."""
    if not hardware:
        return {}
    path = root / "conf" / "hardware" / f"{hardware}.yaml"
    if not path.exists():
        raise ConfigError("vm.run.hardware", f"{path} does not exist",
                          "name a file of conf/hardware/ (e.g. v6e-8), or null for none")
    return {k: str(v) for k, v in (OmegaConf.load(path).get("env") or {}).items()}


def run_env(cfg: VmConfig, root: Path) -> dict[str, str]:
    """What vm_run exports on the VM: `env:` of `run.hardware`'s preset, then `run.env`."""
    return {**hardware_env(root, cfg.run.hardware), **{k: str(v) for k, v in cfg.run.env.items()}}


def export_lines(env: dict[str, str]) -> list[str]:
    """`export` lines; the hardware presets' "@hostname" becomes the VM's hostname."""
    return [f'export {k}="$(hostname)"' if v == "@hostname" else f"export {k}={shlex.quote(v)}"
            for k, v in env.items()]


def secrets_stdin(names: list[str]) -> tuple[list[str], bytes]:
    """Shell lines reading the secrets set locally, and the stdin bytes that feed them."""
    lines, data = [], b""
    for name in names:
        value = os.environ.get(name)
        if not value:
            continue
        if "\n" in value:
            raise ConfigError(name, "contains a newline", f"export {name} as a single line")
        lines += [f"IFS= read -r {name}", f"export {name}"]
        data += value.encode() + b"\n"
    return lines, data


def set_key(value: str) -> str:
    """The params key a `--set` value sets (`+a.b=1` and `a.b=2` set the same key)."""
    return value.partition("=")[0].lstrip("+~")


def experiments(sets: list[str], queue: bool) -> list[list[str]]:
    """The `--set` values of each experiment of a vm_run.

    Without --queue: one experiment, and a key given twice is an error (dvc would keep one value).
    With --queue: a key given several times is swept, a key given once applies to every
    experiment, two swept keys make a grid (`--set=steps=100 --set=steps=200` is two experiments).
    """
    values: dict[str, list[str]] = {}
    for value in sets:
        values.setdefault(set_key(value), []).append(value)
    if not queue:
        for key, given in values.items():
            if len(given) > 1:
                raise ConfigError("--set", f"{key} is given {len(given)} times",
                                  "give it once, or add --queue to run one experiment per value")
        return [list(sets)]
    return [list(point) for point in itertools.product(*values.values())]


def experiment_names(exp_name: str | None, count: int) -> list[str | None]:
    """`--exp-name` for each experiment: NAME for one, NAME-1, NAME-2, ... for a sweep."""
    if count == 1 or not exp_name:
        return [exp_name] * count
    return [f"{exp_name}-{i}" for i in range(1, count + 1)]


def dvc_command(target: str | None, sets: list[str], exp_name: str | None) -> str:
    """`dvc exp run --pull [-S a=1 ...] [--name NAME] [TARGET]` through mtpipe.cloud.on_vm.exp_run: every VM
    run is a DVC experiment; each stage reaches the remote when it ends, and a stage another VM
    finished is pulled (from the remote's run-cache), not rerun."""
    words = ["python", "-m", "mtpipe.cloud.on_vm.exp_run", "exp", "run", "--pull", *[w for s in sets for w in ("-S", s)]]
    words += ["--name", exp_name] if exp_name else []
    words += [target] if target else []
    return " ".join(shlex.quote(w) for w in words)


EXPS_BEFORE = ".git/mtpipe-exps-before"   # in the VM's repo: the experiment refs before the run


def experiment_ref(baseline: str, name: str) -> str:
    """The git ref where DVC keeps experiment ``name`` of the commit ``baseline`` (its full sha); with
    ``name`` empty, the prefix of all of ``baseline``'s."""
    return f"refs/exps/{baseline[:2]}/{baseline[2:]}/{name}"


def check_exp_name(root: Path, name: str | None) -> None:
    """`--exp-name` must be a valid ref name not yet used by an experiment of HEAD (checked here:
    on the VM, `dvc exp run --name` would fail only after the setup)."""
    if not name:
        return
    head = _git(root, "rev-parse", "HEAD").strip()
    ref = experiment_ref(head, name)
    if subprocess.run(["git", "check-ref-format", ref], cwd=root).returncode != 0 or "/" in name:
        raise ConfigError("--exp-name", f"{name!r} is not a valid experiment name",
                          "use letters, digits, dashes and dots")
    if subprocess.run(["git", "show-ref", "--verify", "--quiet", ref], cwd=root).returncode == 0:
        raise ConfigError("--exp-name", f"HEAD already has an experiment {name!r}",
                          f"pick another name, or `dvc exp remove {name}` first")


def _forget_on_vm(exp_name: str | None) -> list[str]:
    """Drop a same-named experiment of HEAD left on the VM (the laptop has none: check_exp_name)."""
    if not exp_name:
        return []
    return ['b=$(git rev-parse HEAD)',
            f'git update-ref -d "refs/exps/${{b:0:2}}/${{b:2}}/"{shlex.quote(exp_name)} || true']


def run_script(cfg: VmConfig, root: Path, dvc: str, secret_lines: list[str],
               exp_name: str | None = None) -> str:
    """One experiment on the VM: secrets from stdin, env, cd into the repo, the command.

    The repo first goes back to the shipped commit (`git reset --hard`; DVC's outputs, its cache and
    work/ stay), so that each experiment of a sweep is HEAD plus its own `--set` values and reuses
    what the previous ones computed. The experiment refs present before the run are noted, so that
    :func:`fetch_experiments` brings back only the one this run made.
    """
    return "\n".join([
        "set -eo pipefail",
        *secret_lines,
        *export_lines(run_env(cfg, root)),
        f'cd "$HOME"/{shlex.quote(cfg.run.remote_dir)}',
        "git reset -q --hard && git clean -fdq",
        *_forget_on_vm(exp_name),
        f"git for-each-ref --format='%(refname)' refs/exps/ > {EXPS_BEFORE}",
        cfg.run.command.replace("{dvc}", dvc),
    ])


def ship(remote: Remote, root: Path, remote_dir: str) -> str:
    """Bring the VM's repo to local HEAD with a git bundle; return the commit shipped."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode != 0:
        raise VmError("the repository has no commit yet: commit the code to run (vm_run ships HEAD)")
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        print("mtpipe: uncommitted changes are NOT shipped (vm_run runs the committed HEAD)")
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "head.bundle"
        subprocess.run(["git", "bundle", "create", "-q", str(bundle), "HEAD"], cwd=root, check=True)
        data = bundle.read_bytes()
    d = f'"$HOME"/{shlex.quote(remote_dir)}'
    check(remote, "\n".join([
        "set -eo pipefail",
        f"mkdir -p {d} && cd {d}",
        "[ -d .git ] || git init -q .",
        "git config user.name mtpipe && git config user.email mtpipe@localhost",
        "cat > .git/mtpipe.bundle",
        "git fetch -q .git/mtpipe.bundle HEAD",
        "git checkout -q -f -B mtpipe-run FETCH_HEAD",
        "git clean -fdq",
    ]), "shipping the code", stdin=data)
    return head.stdout.strip()


def fetch_experiments(remote: Remote, root: Path, remote_dir: str, baseline: str) -> list[str]:
    """Bring the experiments this run made on the VM into the local refs/exps; return their names.

    The VM bundles the new refs/exps/<baseline>/<name> refs without the baseline commit (the laptop
    has it: it shipped it), the way `dvc exp push` / `dvc exp pull` move experiments through git.
    Locally only refs and objects in .git change; `dvc exp apply NAME` brings one into the workspace.
    """
    prefix = experiment_ref(baseline, "")
    out = check(remote, "\n".join([
        "set -eo pipefail",
        f'cd "$HOME"/{shlex.quote(remote_dir)}',
        f"new=$(git for-each-ref --format='%(refname)' {prefix} | grep -vxFf {EXPS_BEFORE} || true)",
        '[ -n "$new" ] || exit 0',
        f"git bundle create -q .git/mtpipe-exps.bundle $new ^{baseline}",
        "cat .git/mtpipe-exps.bundle",
    ]), "collecting the experiment", stream=False)
    if not out:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "exps.bundle"
        bundle.write_bytes(out)
        heads = _git(root, "bundle", "list-heads", str(bundle)).split()
        refs = [r for r in heads[1::2] if r.startswith(prefix)]
        _git(root, "fetch", "-q", "--no-write-fetch-head", str(bundle), *[f"+{r}:{r}" for r in refs])
    return [r.removeprefix(prefix) for r in refs]


def _git(root: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise VmError(f"git {' '.join(args[:2])} failed locally: {proc.stderr.strip()}")
    return proc.stdout
