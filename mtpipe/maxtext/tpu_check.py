"""Prove the TPU runtime before anything long starts: JAX sees the expected number and generation of
chips, and a small computation on every one of them gives the right answer.

    python -m mtpipe.maxtext.tpu_check --chips 8 --generation v6e

Exit 0 with one line naming the chips, or 1 with what was found and what to do. Runs on the TPU VM
(and on the lent chip, Python 3.11): nothing here needs the project's other modules.
"""

from __future__ import annotations

import argparse
import sys
import time

# jax.Device.device_kind of each TPU generation (what libtpu reports)
DEVICE_KINDS = {"v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}
SIDE = 256


def accelerator(accelerator_type: str) -> tuple[str, int]:
    """(generation, chips) of a Cloud TPU accelerator type as TPU_ACCELERATOR_TYPE and conf/hardware
    spell it: ``v6e-8`` -> ("v6e", 8). A v5e VM's type is spelled ``v5litepod-8`` -> ("v5e", 8); the
    number of a v5p type counts TensorCores, two per chip: ``v5p-8`` -> ("v5p", 4). Raise ValueError
    for a type whose generation :data:`DEVICE_KINDS` does not know."""
    name, _, count = accelerator_type.partition("-")
    generation = {"v5litepod": "v5e"}.get(name, name)
    if generation not in DEVICE_KINDS or not count.isdigit() or int(count) < 1:
        raise ValueError(f"TPU accelerator type {accelerator_type!r} is none of "
                         f"{', '.join(sorted(DEVICE_KINDS))} (v5e spelled v5litepod) followed by -<count>")
    return generation, int(count) // 2 if generation == "v5p" else int(count)


def check(chips: int, generation: str) -> str:
    """The line to print when the runtime is right; raise RuntimeError naming what is wrong."""
    t0 = time.time()
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    try:
        devices = jax.devices()
    except RuntimeError as err:  # libtpu failed to open the chips (another process holds them, a driver fault)
        raise RuntimeError(f"JAX could not open the TPU: {err}") from err
    backend, kinds = jax.default_backend(), sorted({d.device_kind for d in devices})
    want = DEVICE_KINDS[generation]
    if backend != "tpu" or len(devices) != chips or kinds != [want]:
        raise RuntimeError(f"expected {chips} x {want!r} on backend tpu, found {len(devices)} x {kinds} on backend "
                           f"{backend!r} (JAX {jax.__version__})")
    ones = jnp.ones((len(devices), SIDE, SIDE), jnp.float32)
    sums = jax.pmap(lambda a: (a @ a).sum())(ones)
    if not bool((sums == float(SIDE**3)).all()):
        raise RuntimeError(f"a {SIDE}x{SIDE} matmul on each chip gave {sums.tolist()}, not {float(SIDE**3)}")
    return f"TPU runtime ok: {chips} x {want}, JAX {jax.__version__}, a matmul on each chip ({time.time() - t0:.1f} s)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", type=int, required=True)
    parser.add_argument("--generation", choices=sorted(DEVICE_KINDS), required=True)
    opts = parser.parse_args()
    try:
        print(check(opts.chips, opts.generation), flush=True)
    except RuntimeError as err:
        print(f"TPU runtime check failed: {err}\n  fix: check the VM's accelerator type and software version "
              "(conf/hardware), and that no other process holds the chips (`sudo lsof -w /dev/vfio/*`)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
