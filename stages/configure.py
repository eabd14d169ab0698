"""Stage configure: compose params.yaml with conf/ presets, validate, write views/<branch>/<stage>.yaml.

Every later stage reads only its own resolved file (and DVC hashes it), so a value reruns exactly
the stages that read it. Bad values stop here, before any download, conversion or VM: the schema's
checks, then the values passed to MaxText against MaxText's own types (mtpipe.pipeline.maxtext_check).
Run: dvc repro configure   (or: python -m stages.configure)
"""

from pathlib import Path

from mtpipe.data import embedded
from mtpipe.evaluation.cpu_backend import check_cpu_forward
from mtpipe.pipeline.config import BRANCH_STAGES, load_params, twin_confs, write_resolved
from mtpipe.pipeline.maxtext_check import compose_checked
from mtpipe.pipeline.stage import run_stage
from mtpipe.pipeline.view import ROOT


def write_views(root: Path = ROOT) -> list[Path]:
    """Compose and check every branch from the project's params.yaml and conf/, and write each stage's view
    under ``root`` (the project's config/; `python -m mtpipe.pipeline.why` writes them elsewhere to compare
    them with the ones dvc.lock recorded)."""
    params = load_params()
    composed = {branch: compose_checked(branch, params) for branch in BRANCH_STAGES}
    for cfg in composed.values():
        check_cpu_forward(cfg)  # the CPU model server can run the model
    return write_resolved(composed, twin_confs(embedded.FAMILIES), root)


def main() -> None:
    for path in write_views():
        print(f"  {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    run_stage(main)
