"""Make MaxText 0.2.5 (written for Python >= 3.12 and JAX 0.11) import on the lent chip's Python 3.11
and JAX 0.10.2, by three source edits in an installed site folder. Safe to run twice.

    python benchmarks/on_tpu/patch_maxtext.py SITE

1. PEP 695 ``type X = ...`` aliases (3.12 syntax) become plain assignments.
2. ``jax.experimental.xla_metadata.must_fuse_call`` (new in JAX 0.11, a fusion hint) becomes a no-op.
3. ``typing.override`` (3.12) comes from typing_extensions.
None of them changes what a training step computes.
"""

from __future__ import annotations

import sys
from pathlib import Path

FUSE_HINT = ("from jax.experimental.xla_metadata import must_fuse_call\n",
             "try:\n  from jax.experimental.xla_metadata import must_fuse_call\n"
             "except ImportError:  # JAX < 0.11: the fusion hint does nothing\n"
             "  def must_fuse_call(identifier):\n    del identifier\n    return lambda f: f\n")
OVERRIDE = ("from typing import override\n", "from typing_extensions import override\n")
EDITS = {
    "maxtext/kernels/mhc/api.py": [("\ntype Implementation = ", "\nImplementation = ")],
    "maxtext/kernels/mhc/common.py": [("\ntype KernelContext = ", "\nKernelContext = ")],
    "maxtext/kernels/attention/jax_flash_attention.py": [FUSE_HINT],
    "maxtext/trainers/post_train/hooks.py": [OVERRIDE],
    "maxtext/trainers/post_train/sft/hooks.py": [OVERRIDE],
    "maxtext/trainers/post_train/dpo/hooks.py": [OVERRIDE],
}


def patch(site: Path) -> None:
    for rel, edits in EDITS.items():
        path = site / rel
        text = path.read_text()
        for old, new in edits:
            if new in text:
                continue
            if old not in text:
                sys.exit(f"patch_maxtext.py: {rel} has no {old.strip()!r}: another MaxText than 0.2.5?")
            text = text.replace(old, new, 1)
            print(f"patched {rel}")
        path.write_text(text)


if __name__ == "__main__":
    patch(Path(sys.argv[1]))
