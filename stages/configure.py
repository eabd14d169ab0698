"""Stage configure: compose params.yaml with conf/ presets, validate, write config/<branch>/<stage>.yaml.

Every later stage reads only its own resolved file (and DVC hashes it), so a value reruns exactly
the stages that read it. Bad values stop here, before any download, conversion or VM.
Run: dvc repro configure   (or: python -m stages.configure)
"""

from mtpipe.pipeline.config import load_params, write_resolved
from mtpipe.pipeline.stage import run_stage


def main() -> None:
    for path in write_resolved(load_params()):
        print(f"  {path.relative_to(path.parents[2])}")


if __name__ == "__main__":
    run_stage(main)
