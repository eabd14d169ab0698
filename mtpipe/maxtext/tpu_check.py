"""Prove the TPU runtime before anything long starts: JAX sees the expected number and kind of
devices (a chip is one device, a TPU7x chip two), and a small computation on every one of them gives
the right answer.

    python -m mtpipe.maxtext.tpu_check --devices 8 --device-kind "TPU v6 lite"

The caller names the devices it expects as libtpu reports them (``jax.Device.device_kind``, one
``--device-kind`` for each spelling a generation has: conf/generations.yaml). Exit 0 with one line
naming the chips, or 1 with what was found and what to do. Runs on the TPU VM (and on the lent chip,
Python 3.11): nothing here needs the project's other modules.
"""

from __future__ import annotations

import argparse
import sys
import time

SIDE = 256


def check(count: int, device_kinds: list[str]) -> str:
    """The line to print when the runtime is right; raise RuntimeError naming what is wrong."""
    t0 = time.time()
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    try:
        devices = jax.devices()
    except RuntimeError as err:  # libtpu failed to open the chips (another process holds them, a driver fault)
        raise RuntimeError(f"JAX could not open the TPU: {err}") from err
    backend, kinds = jax.default_backend(), sorted({d.device_kind for d in devices})
    want = " or ".join(repr(kind) for kind in device_kinds)
    if backend != "tpu" or len(devices) != count or len(kinds) != 1 or kinds[0] not in device_kinds:
        raise RuntimeError(f"expected {count} x {want} on backend tpu, found {len(devices)} x {kinds} on backend "
                           f"{backend!r} (JAX {jax.__version__})")
    ones = jnp.ones((len(devices), SIDE, SIDE), jnp.float32)
    sums = jax.pmap(lambda a: (a @ a).sum())(ones)
    if not bool((sums == float(SIDE**3)).all()):
        raise RuntimeError(f"a {SIDE}x{SIDE} matmul on each device gave {sums.tolist()}, not {float(SIDE**3)}")
    return f"TPU runtime ok: {count} x {kinds[0]}, JAX {jax.__version__}, a matmul on each device ({time.time() - t0:.1f} s)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--device-kind", action="append", required=True, dest="device_kinds",
                        help="jax.Device.device_kind of the expected devices (again for another spelling)")
    opts = parser.parse_args()
    try:
        print(check(opts.devices, opts.device_kinds), flush=True)
    except RuntimeError as err:
        print(f"TPU runtime check failed: {err}\n  fix: check the VM's accelerator type and software version "
              "(conf/hardware), and that no other process holds the chips (`sudo lsof -w /dev/vfio/*`)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
