"""The TPU VM's environment: one hash-pinned lock, resolved here, installed by the real setup commands.

`doit vm_setup` runs conf/vm.yaml's `setup.commands` on the VM (mtpipe.cloud.on_vm.setup.setup_script). The slow
test runs that same script on this machine, in a scratch HOME, so a typo or a broken pin fails here
and not on a VM that bills by the hour. Three commands cannot run here and are replaced, by name, with
shell functions defined before the script (the script itself is unchanged):

* `sudo` (the apt-get and systemctl lines): would change this machine's system packages and services;
  the calls are recorded and must be stopping the apt-daily jobs, then apt-get only.
* `curl` (uv's installer from astral.sh, unreachable here): serves an installer that puts the uv of
  the same pinned version (from PyPI) in ~/.local/bin and writes ~/.local/bin/env, as the real one does.
* `install_tpu_post_train_extra_deps` (MaxText's installer of vLLM for TPU, tpu-inference and a tunix
  commit, all from GitHub, unreachable here and TPU-only): checks that the real entry point is in the
  venv instead; MaxText pins what it installs by commit (checked below).

Everything else runs for real: `uv venv`, and `uv pip sync --require-hashes` of the whole lock (libtpu
included: it installs anywhere) into a fresh venv, then `pip check`; in that venv ray starts and stops.
uv installs from its cache only (`UV_OFFLINE=1`): `make test` fills it first (tests/prefetch.py,
about 3.5 GB the first time); the install then takes about two minutes.

The lock keeps MaxText's floors and takes the newest release of what MaxText does not choose
(mtpipe.pipeline.requirement_locks): the tests check the floors and the rule, without an index;
`make lock-check` asks PyPI whether the committed locks are still what it resolves.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from packaging.requirements import Requirement
from packaging.version import Version

from mtpipe.cloud.on_vm import setup
from mtpipe.pipeline import requirement_locks
from mtpipe.pipeline.requirement_locks import VM_LOCK, uv
from mtpipe.pipeline.toolchain import lock_pins

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.preflight


def vm_config():
    return OmegaConf.load(ROOT / "conf" / "vm.yaml")


def test_one_maxtext_version_for_laptop_and_vm():
    """pyproject.toml pins MaxText; the laptop lock, the VM lock and the installed package agree."""
    from importlib import metadata

    version = requirement_locks.maxtext_version()
    vm_pins = lock_pins(VM_LOCK.read_text())
    assert lock_pins((ROOT / "requirements.lock").read_text())["maxtext"] == version
    assert vm_pins["maxtext"] == version == metadata.version("maxtext")
    header = VM_LOCK.read_text().split("\n#\n", 1)[0]
    assert f"step 1 (--resolution lowest-direct): maxtext[tpu-post-train]=={version} and its floors" in header
    # No other file names a MaxText version: conf/vm.yaml installs the lock.
    assert not re.search(r"maxtext\S*==", (ROOT / "conf" / "vm.yaml").read_text())


def test_vm_lock_pins_what_the_vm_needs():
    text = VM_LOCK.read_text()
    pins = lock_pins(text)
    project = requirement_locks.project_pins()
    for name in requirement_locks.VM_PACKAGES:
        assert pins[name] == next(iter(project[name].specifier)).version, name
    # MaxText's floors, as the tutorial's lowest resolution takes them (jax>=0.11.0 -> 0.11.0).
    assert pins["jax"] == "0.11.0" and pins["google-tunix"] == "0.1.7" and "libtpu" in pins
    # PyPI's torch at MaxText's version instead of the PyTorch index's +cpu build.
    assert requirement_locks.torch_overrides() == ["torch==2.11.0", "torchvision==0.26.0"]
    assert (pins["torch"], pins["torchvision"]) == ("2.11.0", "0.26.0")
    assert (pins["uv"], pins["pip"]) == (requirement_locks.UV_VERSION, requirement_locks.PIP_VERSION)
    # Every pinned package carries hashes (uv pip sync --require-hashes refuses the lock otherwise).
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    entries = re.split(r"\n(?=[A-Za-z0-9])", body.strip())
    assert len(entries) == len(pins) > 400
    assert all("--hash=sha256:" in e for e in entries)


@pytest.mark.first_contact
def test_vm_lock_keeps_maxtexts_floors_except_those_that_bound_nothing():
    """MaxText's floors are MaxText's own lock, what the tutorial installs: the VM lock keeps them, except
    the floors at a package's first release (ray's unbounded colorful, smart-open, opencensus and
    aiohttp-cors; ray cannot start with colorful 0.0.0) and the lifted ones (grpcio)."""
    text = VM_LOCK.read_text()
    pins, floors = lock_pins(text), requirement_locks.maxtext_floors()
    above = {name for name, floor in floors.items() if pins[name] != floor}
    # xprof: tokamax 0.0.14 requires xprof>=2.23.1, above MaxText's floor
    assert above == {"aiohttp-cors", "colorful", "opencensus", "smart-open", "grpcio", "xprof"}
    assert all(Version(pins[name]) > Version(floors[name]) for name in above)
    assert Version(pins["grpcio"]) >= Version("1.83")   # what google-api-core and google-auth accept
    assert list(requirement_locks.LIFTED_FLOORS) == ["grpcio"]
    header = text.split("\n#\n", 1)[0]
    assert f"floors lifted (LIFTED_FLOORS): grpcio>={floors['grpcio']}" in header
    assert "colorful>=0.0.0" in header and "smart-open>=0.1.0" in header


def test_the_newest_release_rule_names_what_nothing_holds_back():
    """The rule `make lock-check` applies to the VM lock (it asks PyPI for the newest releases): a package
    below its newest release is named unless a package the lock names holds it back."""
    text = VM_LOCK.read_text()
    pins = lock_pins(text)
    newest = {"semver": "99.0", "chardet": "99.0", "nvidia-cublas": "99.0", "colorful": pins["colorful"]}
    assert requirement_locks.behind(text, newest) == {"semver": (pins["semver"], "99.0")}
    # a holder the lock does not name holds nothing back
    unheld = text.replace("    #   mbstrdecoder\n", "").replace("# via mbstrdecoder\n", "")
    assert "chardet" in requirement_locks.behind(unheld, newest)


def test_lock_check_names_each_moved_pin_and_how_to_relock():
    """What `make lock-check` prints when the index resolves another version than the committed one."""
    committed = VM_LOCK.read_text()
    version = lock_pins(committed)["semver"]
    moved = committed.replace(f"\nsemver=={version} ", "\nsemver==99.0 ")
    assert requirement_locks.lock_diff(committed, committed) == []
    assert requirement_locks.lock_diff(committed, moved) == [f"semver: {version} -> 99.0"]
    assert requirement_locks.lock_diff(committed, committed + "#\n") == ["the same versions, other hashes or comments"]
    assert requirement_locks.report({"requirements-vm.lock": [], "requirements.lock": []}) == ""
    text = requirement_locks.report({"requirements-vm.lock": requirement_locks.lock_diff(committed, moved)})
    assert f"requirements-vm.lock:\n  semver: {version} -> 99.0\n" in text
    assert "`make lock`" in text and "`dvc repro`" in text


def test_vm_setup_installs_the_lock_with_hashes():
    cfg = vm_config()
    commands = list(cfg.setup.commands)
    assert list(cfg.setup.files) == ["requirements-vm.lock"]
    assert 'uv pip sync --require-hashes "$HOME/.mtpipe/setup/requirements-vm.lock"' in commands
    assert f"curl -LsSf https://astral.sh/uv/{requirement_locks.UV_VERSION}/install.sh | sh" in commands
    # The files travel on stdin and count in the marker: a new lock reruns the setup.
    files = setup.setup_files(cfg, ROOT)
    other = files.replace(b"maxtext==", b"maxtext===")
    assert setup.setup_script(cfg, files) != setup.setup_script(cfg, other)


def test_maxtext_pins_its_github_dependencies_by_commit():
    """What install_tpu_post_train_extra_deps adds (not in the lock) is pinned by MaxText, by commit."""
    from importlib import metadata

    dist = metadata.distribution("maxtext")
    text = dist.locate_file("dependencies/extra_deps/post_train_github_deps.txt").read_text()
    names = {}
    for line in text.splitlines():
        if line.strip():
            req = Requirement(line)
            names[req.name] = req.url
    assert set(names) == {"google-tunix", "tpu-inference", "vllm"}
    assert all(re.search(r"[0-9a-f]{40}", url) for url in names.values()), names


# Stand-ins for the three commands that cannot run here (see the module docstring).
STANDINS = r"""
sudo() { echo "$*" >> "$HOME/sudo.log"; }
curl() {
  local url="${@: -1}"
  if [ "$url" != "https://astral.sh/uv/$TEST_UV_VERSION/install.sh" ]; then
    echo "test: no installer for $url" >&2; return 22
  fi
  cat <<EOF
mkdir -p "\$HOME/.local/bin" && cp "$TEST_UV" "\$HOME/.local/bin/uv"
printf '%s\n' 'case ":\${PATH}:" in *:"\$HOME/.local/bin":*) ;; *) export PATH="\$HOME/.local/bin:\$PATH" ;; esac' > "\$HOME/.local/bin/env"
EOF
}
install_tpu_post_train_extra_deps() {
  test -x "$VIRTUAL_ENV/bin/install_tpu_post_train_extra_deps" && echo "$VIRTUAL_ENV" > "$HOME/extra_deps.log"
}
"""


def run_setup(home: Path, script: str, files: bytes) -> subprocess.CompletedProcess:
    python312 = Path(sys.base_prefix) / "bin"  # uv venv --python 3.12 finds it here (no download)
    inherited = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}  # proxy, CA
    env = inherited | {
        "HOME": str(home), "PATH": f"{python312}:/usr/local/bin:/usr/bin:/bin",
        "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR", str(Path.home() / ".cache" / "uv")),
        "UV_PYTHON_DOWNLOADS": "never", "TEST_UV": str(uv()), "TEST_UV_VERSION": requirement_locks.UV_VERSION,
        "UV_OFFLINE": "1",   # every file from uv's cache, which tests/prefetch.py filled before the tests
    }  # fmt: skip
    return subprocess.run(["bash", "-c", STANDINS + script], input=files, env=env, capture_output=True)


def pip_check_problems(output: str, venv: Path) -> list[str]:
    """`pip check`'s complaints, minus its false "not supported on this platform" for a malformed WHEEL.

    cmake 3.26.1 (MaxText's lower bound) has a blank line before the `Tag:` lines of its WHEEL file
    (written by skbuild 0.16.7), so pip's header parser finds no tags there; its tags are
    manylinux_2_17_x86_64, which this machine and the VM support, and `uv pip check` accepts it.
    """
    problems = []
    for line in output.splitlines():
        m = re.fullmatch(r"(\S+) (\S+) is not supported on this platform", line)
        wheel = next(venv.glob(f"lib/python*/site-packages/{m[1]}-{m[2]}.dist-info/WHEEL"), None) if m else None
        if not (wheel and "\n\nTag:" in wheel.read_text()):
            problems.append(line)
    return problems


@dataclass
class SetupRun:
    """The real setup commands, run once in a scratch HOME (see the module docstring)."""
    home: Path
    script: str
    files: bytes
    proc: subprocess.CompletedProcess

    @property
    def python(self) -> Path:
        return self.home / "maxtext_venv" / "bin" / "python"


@pytest.fixture(scope="module")
def setup_run(tmp_path_factory) -> SetupRun:
    """The VM's venv as `doit vm_setup` makes it: the whole lock installed (about a minute with uv's cache
    warm). The tests that use it share one xdist group, so it is made once."""
    cfg = vm_config()
    files = setup.setup_files(cfg, ROOT)
    script = setup.setup_script(cfg, files)
    home = tmp_path_factory.mktemp("vm_setup") / "home"
    home.mkdir()
    return SetupRun(home, script, files, run_setup(home, script, files))


@pytest.mark.slow
@pytest.mark.xdist_group("vm-setup")
def test_the_setup_commands_install_the_lock_into_a_fresh_venv(setup_run: SetupRun):
    home, python = setup_run.home, setup_run.python
    venv = python.parents[1]
    out = (setup_run.proc.stdout + setup_run.proc.stderr).decode(errors="replace")
    assert setup_run.proc.returncode == 0, out[-5000:]
    assert "mtpipe: VM set up" in out

    assert (home / "extra_deps.log").read_text().strip() == str(venv)
    sudo_lines = (home / "sudo.log").read_text().splitlines()
    assert sudo_lines[:2] == ["systemctl disable --now apt-daily.timer apt-daily-upgrade.timer",
                              "systemctl stop apt-daily.service apt-daily-upgrade.service"]   # stop_auto_upgrades
    sudo = [re.fullmatch(r"DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=\d+ (\w+)( .*)?", line)
            for line in sudo_lines[2:]]   # apt_get: apt waits for the lock; no upgrade
    assert [m and m[1] for m in sudo] == ["update", "install"]

    version = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                             text=True, check=True).stdout.split()
    assert version == ["3", "12"]
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    assert not pip_check_problems(check.stdout, venv), check.stdout + check.stderr
    assert subprocess.run([uv(), "pip", "check", "--python", python]).returncode == 0
    freeze = subprocess.run([uv(), "pip", "freeze", "--python", python], capture_output=True, text=True,
                            check=True).stdout
    assert lock_pins(freeze) == lock_pins(VM_LOCK.read_text())
    imports = "import dvc.repo, dvc_gs, doit, omegaconf, jax, flax, transformers, tunix, torch, maxtext"
    proc_imports = subprocess.run([python, "-c", imports], capture_output=True, text=True,
                                  env={"JAX_PLATFORMS": "cpu", "HOME": str(home), "PATH": "/usr/bin:/bin"}, cwd=home)
    assert proc_imports.returncode == 0, proc_imports.stderr[-3000:]

    again = run_setup(home, setup_run.script, setup_run.files)
    assert again.returncode == 0 and b"already set up" in again.stdout


@pytest.mark.slow
@pytest.mark.first_contact
@pytest.mark.xdist_group("vm-setup")
def test_ray_starts_in_the_vm_venv(setup_run: SetupRun):
    """`ray.init()` in the venv the setup made, in a child process: ray and what it imports at the
    lock's versions (with colorful 0.0.0: `cannot import name 'ColorfulString'`), and the dashboard's
    packages import. Without the dashboard: it adds about 30 s on 2 cores and is not on the VM's path."""
    assert setup_run.proc.returncode == 0, setup_run.proc.stderr.decode(errors="replace")[-3000:]
    script = ("import aiohttp_cors, colorful, opencensus, ray, smart_open\n"
              "ray.init(num_cpus=1, include_dashboard=False)\n"
              "assert ray.get(ray.put(41)) == 41\n"
              "ray.shutdown()\n"
              "print('ray', ray.__version__, 'started and stopped')\n")
    env = {"HOME": str(setup_run.home), "PATH": f"{setup_run.python.parent}:/usr/bin:/bin"}
    proc = subprocess.run([setup_run.python, "-c", script], capture_output=True, text=True, env=env,
                          cwd=setup_run.home, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"ray {lock_pins(VM_LOCK.read_text())['ray']} started and stopped" in proc.stdout
