"""Stage make_embedded: the embedded default (tiny models, tokenizers, datasets) into embedded/.

Deterministic and offline (see mtpipe/data/embedded.py): writes the twins its view names (``twins``: each
one's MaxText model and sizes, which configure copies from conf/model/<name>.yaml) and the data sets into
<out>.partial, then renames it to <out>.
Then, per branch, artifacts/<branch>/source.json beside <out>: the sha256 of each file of the directories its
hf_download copies (the view's ``sources``), so a branch's download reruns when its own twin or dataset
changes and not when another does.
Run: dvc repro make_embedded   (or: python -m stages.make_embedded embedded)
"""

import sys
from pathlib import Path

from mtpipe.data import embedded
from mtpipe.errors import ConfigError
from mtpipe.pipeline.stage import EMBEDDED_DIR, Timer, atomic_dir, run_stage, source_manifest, tree_sha256, write_json
from mtpipe.pipeline.view import load_stage


def main(out: str) -> None:
    cfg = load_stage("embedded", "make_embedded")  # fails if the code's fingerprints are stale
    if sorted(cfg.twins) != sorted(embedded.FAMILIES):
        raise ConfigError("views/embedded/make_embedded.yaml twins", f"names {sorted(cfg.twins)}, not the families "
                          f"{sorted(embedded.FAMILIES)}", "run `dvc repro` (it reruns configure first)")
    timer = Timer()
    with atomic_dir(Path(out)) as partial:
        embedded.write_all(partial, cfg.twins)
        manifests = {branch: {role: tree_sha256(partial / Path(path).relative_to(EMBEDDED_DIR))
                              for role, path in sources.items()}
                     for branch, sources in cfg.sources.items()}
    for branch, manifest in manifests.items():
        write_json(source_manifest(branch, root=Path(out).parent), manifest)
    print(f"  wrote {', '.join([*cfg.twins, *embedded.DATASETS])} into {out} in {timer.seconds()} s")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m stages.make_embedded <output dir, e.g. embedded>")
    run_stage(main, sys.argv[1])
