"""Preflight of the full-size tutorial presets: AOT compile for v6e-8 on this CPU, then the table.

    python benchmarks/preflight_full.py [--branch sft|rl] [--set KEY=VALUE ...]

Compiles Gemma 3 4B (SFT tutorial) and Llama 3.1 8B Instruct (GRPO tutorial) for a TPU v6e-8 with
MaxText's train_compile (about 10 minutes per model on 2 busy cores, several GiB of host memory),
prints mtpipe.planning.preflight's table and the wall time of each compile. Results are cached in
work/preflight/: a second run prints the same table at once. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtpipe.cloud.settings import prices, vm_config  # noqa: E402
from mtpipe.planning import preflight  # noqa: E402

TUTORIALS = {"sft": "sft.preset=gemma3-4b-ultrachat-v6e8", "rl": "rl.preset=llama3.1-8b-gsm8k-v6e8"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--branch", choices=sorted(TUTORIALS), action="append",
                        help="only this branch (repeatable; default: sft, then rl)")
    parser.add_argument("--set", action="append", default=[], help="more params overrides, KEY=VALUE")
    args = parser.parse_args()
    cfg = vm_config.load_config()
    rows, rate, machine = [], prices.vm_rate(cfg), vm_config.budget_machine(cfg)
    for branch in args.branch or ["sft", "rl"]:
        start = time.monotonic()
        # check reports, it never raises on a misfit
        rows += preflight.check([TUTORIALS[branch], *args.set], rate.price.usd, machine, branches=(branch,),
                                price_basis=rate.per_chip())
        print(f"{branch}: preflight took {time.monotonic() - start:.0f} s", flush=True)
    print("\nfull-size tutorial presets, AOT-compiled for v6e-8 on this CPU:")
    print(preflight.table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
