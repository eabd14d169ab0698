"""Stage make_embedded: the embedded default (tiny models, tokenizers, datasets) into embedded/.

Deterministic and offline (see mtpipe/data/embedded.py): writes <out>.partial, then renames it to <out>.
Run: dvc repro make_embedded   (or: python -m stages.make_embedded embedded)
"""

import sys
from pathlib import Path

from mtpipe.data import embedded
from mtpipe.errors import ConfigError
from mtpipe.pipeline.config import load_stage
from mtpipe.pipeline.stage import Timer, atomic_dir, run_stage


def main(out: str) -> None:
    cfg = load_stage("embedded", "make_embedded")  # fails if the code's fingerprints are stale
    if cfg.twins != embedded.twin_confs():
        raise ConfigError("config/embedded/make_embedded.yaml", "names other twin sizes than conf/model/*-tiny.yaml",
                          "run `dvc repro` (it reruns configure first), or `dvc repro configure`")
    timer = Timer()
    with atomic_dir(Path(out)) as partial:
        embedded.write_all(partial)
    print(f"  wrote {', '.join(embedded.WRITERS)} into {out} in {timer.seconds()} s")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m stages.make_embedded <output dir, e.g. embedded>")
    run_stage(main, sys.argv[1])
