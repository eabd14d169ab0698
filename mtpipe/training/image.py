"""The Docker image an xpk workload runs, tagged by its content (docs/multihost.md, "The image").

The image is the TPU VM's environment (``requirements-vm.lock``, installed as ``vm_setup`` installs
it) plus the ``mtpipe`` package, which the pod runs: MaxText through ``mtpipe.maxtext.adapter.training`` (the
same patches as on a VM) under the pod side, ``mtpipe.training.xpk_pod``. Its content is exactly
:data:`FILES` and the package's ``.py`` files; stages, configs, tests and docs are not in it, so
editing them (or a ``dvc exp run -S`` value) builds nothing. The tag is ``sha-`` and 12 hex digits of
a sha256 over those files' paths and bytes: the same code and lock give the same tag on every
machine, and :func:`ensure` builds and pushes only a tag the registry does not have yet.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from mtpipe.errors import ConfigError
from mtpipe.pipeline.stage import HUB_TOKEN_ENV, ROOT

FILES = ("Dockerfile", "requirements-vm.lock")
PACKAGE = "mtpipe"
PLATFORM = "linux/amd64"  # the lock pins x86_64 wheels (libtpu, jax); an arm64 laptop cross-builds


def files(root: Path = ROOT) -> list[Path]:
    """What the image is built from, relative to ``root``: :data:`FILES`, then the package's .py files."""
    package = sorted(p.relative_to(root) for p in (root / PACKAGE).rglob("*.py") if "__pycache__" not in p.parts)
    return [Path(name) for name in FILES] + package


def tag(root: Path = ROOT) -> str:
    """``sha-<12 hex>``: a digest of :func:`files`' paths and bytes."""
    h = hashlib.sha256()
    for rel in files(root):
        data = (root / rel).read_bytes()
        h.update(f"{rel.as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return f"sha-{h.hexdigest()[:12]}"


def ensure(repository: str, root: Path = ROOT) -> str:
    """``<repository>:<tag>``, built and pushed first unless the registry already has it."""
    ref = f"{repository}:{tag(root)}"
    docker = shutil.which("docker")
    if docker is None:
        raise ConfigError("docker", "not found on PATH, but the xpk backend builds and pushes the workload's image",
                          "install Docker (https://docs.docker.com/engine/install/) and run `gcloud auth "
                          "configure-docker REGION-docker.pkg.dev` once for the registry of hardware.xpk.docker_image")
    if _docker(docker, "manifest", "inspect", ref, quiet=True) == 0:
        print(f"  image {ref}: in the registry")
        return ref
    print(f"  image {ref}: not in the registry, building it (the first build takes a while) and pushing it",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="mtpipe-image-") as context:
        for rel in files(root):
            (Path(context) / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, Path(context) / rel)
        if _docker(docker, "build", "--platform", PLATFORM, "--tag", ref, context) != 0:
            raise RuntimeError(f"`docker build` of {ref} failed (its output is above). Fix: the Dockerfile's steps "
                               "need Ubuntu's mirrors, ghcr.io, PyPI and GitHub; see the failing step")
    if _docker(docker, "push", ref) != 0:
        raise RuntimeError(f"`docker push {ref}` failed (its output is above). Fix: run `gcloud auth "
                           "configure-docker <registry host>` and check that hardware.xpk.docker_image is a "
                           "repository you may write (roles/artifactregistry.writer)")
    return ref


def _docker(docker: str, *args: str, quiet: bool = False) -> int:
    """Run docker without Hub tokens in its environment (a build must not bake one into a layer)."""
    env = {name: value for name, value in os.environ.items() if name not in HUB_TOKEN_ENV}
    return subprocess.run([docker, *args], env=env, capture_output=quiet).returncode
