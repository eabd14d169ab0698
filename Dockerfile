# The image of an xpk workload (mtpipe/training/image.py builds it as <hardware.xpk.docker_image>:sha-<digest>;
# docs/multihost.md): the TPU VM's environment, installed as `doit vm_setup` installs it on a VM
# (conf/vm.yaml setup.commands, docs/tpu-vm.md "The VM's environment"), plus the mtpipe package.
# Built from a context holding only this file, requirements-vm.lock and mtpipe/**/*.py (image.files).
FROM ubuntu:22.04

# The VM's image is Ubuntu 22.04 (glibc 2.35, what the lock's wheels are resolved for); gcc 11 builds vLLM.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       build-essential cmake ninja-build git ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# uv at the VM's pinned version; Python 3.12 as uv fetches it on the VM.
COPY --from=ghcr.io/astral-sh/uv:0.13.9 /uv /usr/local/bin/uv
# UV_COMPILE_BYTECODE: every uv install below writes the .pyc files, so that a container does not
# compile JAX and MaxText from source at each start (docs/testing.md, "Bytecode compiled at install").
ENV UV_PYTHON_INSTALL_DIR=/opt/uv-python \
    VIRTUAL_ENV=/opt/maxtext_venv \
    PATH=/opt/maxtext_venv/bin:$PATH \
    UV_COMPILE_BYTECODE=1
RUN uv venv --python 3.12 /opt/maxtext_venv

# Every package with its sha256 (uv refuses anything else), then MaxText's vLLM / tpu-inference / tunix
# from the GitHub commits MaxText 0.2.5 pins, as on the VM.
COPY requirements-vm.lock /opt/mtpipe/requirements-vm.lock
RUN uv pip sync --require-hashes /opt/mtpipe/requirements-vm.lock \
    && install_tpu_post_train_extra_deps \
    && rm -rf /root/.cache

# The project's code last: a code change rebuilds only this layer.
WORKDIR /app
COPY mtpipe /app/mtpipe
ENV PYTHONPATH=/app \
    PYTHONUNBUFFERED=1
