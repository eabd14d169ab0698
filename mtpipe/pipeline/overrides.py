"""params.yaml with ``--set`` values applied exactly as ``dvc exp run -S`` applies them.

doit's ``vm_run`` passes its ``--set`` values to ``dvc exp run -S`` on the VM; the checks before
spending and ``doit preflight`` apply the same values here with DVC's own code (Hydra's override
grammar), so a value that would fail on the VM fails on the laptop first.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from omegaconf import DictConfig

from mtpipe.errors import ConfigError
from mtpipe.pipeline.config import load_params


def committed_params(root: Path) -> bytes:
    """HEAD's params.yaml: what vm_run ships."""
    shown = subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=root, capture_output=True)
    if shown.returncode != 0:
        raise ConfigError("params.yaml", "is not committed (vm_run ships HEAD)",
                          "commit params.yaml (restore it from the project if it is gone)")
    return shown.stdout


def apply_sets(params_yaml: bytes, sets: list[str]) -> DictConfig:
    """Load ``params_yaml`` with ``sets`` (``KEY=VALUE``, ``+KEY=VALUE``) applied as ``dvc exp run -S`` does."""
    # DVC is imported here: it takes a second, and most doit tasks do not need it.
    from dvc.exceptions import InvalidArgumentError
    from dvc.utils.cli_parse import to_path_overrides
    from dvc.utils.hydra import apply_overrides

    overrides = to_path_overrides(sets)
    others = sorted(set(overrides) - {"params.yaml"})
    if others:
        raise ConfigError("--set", f"sets values in {others}; only params.yaml feeds the pipeline",
                          "write --set=KEY=VALUE (params.yaml is the default file)")
    with tempfile.TemporaryDirectory() as tmp:
        params_file = Path(tmp) / "params.yaml"
        params_file.write_bytes(params_yaml)
        if overrides:
            try:
                apply_overrides(str(params_file), overrides["params.yaml"])
            except InvalidArgumentError as err:   # what `dvc exp run -S` would fail with on the VM
                why = str(err.__cause__ or err).splitlines()[0]
                raise ConfigError("--set", f"{' '.join(sets)}: {why}",
                                  "write KEY=VALUE with a key of params.yaml, +KEY=VALUE for one it "
                                  "lacks (Hydra's override grammar, as `dvc exp run -S`)") from err
        return load_params(params_file)
