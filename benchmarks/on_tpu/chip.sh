#!/bin/bash
# On the lent TPU chip's machine, from the repository root (docs/tpu-chip.md): install what
# requirements-chip.txt pins (the machine's own index + the carried .tpu-chip/wheels) into a site
# folder, then run groups of .tpu-chip/plan.json (chip_run.py). Safe to run twice.
#   bash benchmarks/on_tpu/chip.sh "GROUP [GROUP ...]" [DEADLINE_S] [--cpu]
set -euo pipefail
groups=$1 deadline=${2:-570} mode=${3:-}
here=benchmarks/on_tpu site=${CHIP_SITE:-/tmp/mtpipe-chip-site} out=${OUT:-/tmp/mtpipe-chip-out} py=${PY:-python3}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$site:$PWD PYTHONUNBUFFERED=1 HF_HOME=/tmp/mtpipe-hf-home
if [ ! -f "$site/.installed" ]; then
  echo "installing $(grep -c '==' $here/requirements-chip.txt) pins into $site"
  PIP_CONFIG_FILE=/dev/null "$py" -m pip install --isolated --quiet --no-deps --no-compile --no-cache-dir \
    --only-binary=:all: --ignore-requires-python --index-url "${CHIP_INDEX:-file:///opt/pypi/simple}" \
    --find-links .tpu-chip/wheels --target "$site" -r $here/requirements-chip.txt > "$out/install.log" 2>&1 \
    || { tail -20 "$out/install.log"; exit 1; }
  "$py" $here/patch_maxtext.py "$site" >> "$out/install.log"
  touch "$site/.installed"
fi
exec "$py" $here/chip_run.py $groups --out "$out" --deadline "$deadline" ${mode:+"$mode"}
