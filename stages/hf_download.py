"""Stage hf_download@<branch>: the model and the dataset at pinned revisions, into DVC outputs.

Hub sources go through huggingface_hub (HF_TOKEN from the environment only); a local source (the
embedded default) is copied. Dataset rows are checked here, so a malformed row stops the pipeline
before any conversion or training starts, and the held-out split is compared with the training split:
metrics/<branch>/hf_download.json counts the held-out rows that also occur in training (a GSM8K question,
a whole conversation). Writes artifacts/<branch>/model/ and
artifacts/<branch>/dataset/, each stamped with its files (paths, sizes, sha256): the source and its
revision are the view's (dvc.lock), not the output's, so another source with the same files is the same output.
A source make_embedded writes (embedded/<name>) is not a dependency as a whole: each copied file must
have the sha256 artifacts/<branch>/source.json lists, the one input this stage declares besides its view.
Run: dvc repro hf_download@sft   (or: python -m stages.hf_download sft)
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # before huggingface_hub is imported

from mtpipe.data import datasets_check, hub
from mtpipe.errors import ConfigError
from mtpipe.pipeline.stage import ROOT, atomic_dir, is_embedded, open_stage, run_stage, write_json, write_stamp


def check_rows(cfg, files) -> int:
    """Validate every row of the training files against the dataset's schema."""
    if cfg.dataset.row_schema == "chat":
        return datasets_check.check_chat_rows(files, column=cfg.dataset.columns[0])
    return datasets_check.check_gsm8k_rows(files)


def overlap(cfg, out, train_files) -> dict[str, int]:
    """The held-out rows, and how many of them also occur in the training files."""
    if cfg.dataset.eval_files is None:
        return {}
    column = cfg.dataset.columns[0] if cfg.dataset.row_schema == "chat" else "question"
    return datasets_check.split_overlap(train_files, datasets_check.dataset_files(cfg, out, "eval_files"), column)


def check_declared(path: Path, role: str, source, manifest: dict) -> None:
    """A copy of embedded/<name> is what make_embedded hashed into the declared source.json, file by file,
    so no byte reaches the output that the stage's address does not hold."""
    if not is_embedded(source):
        return
    listed = json.loads(path.read_text()).get(role, {}) if path.is_file() else {}
    if stray := [f["path"] for f in manifest["files"] if listed.get(f["path"]) != f["sha256"]]:
        raise ConfigError(str(path.relative_to(ROOT)), f"does not list {source.path}/{stray[0]} as it is now "
                          f"({len(stray)} of {len(manifest['files'])} files differ)",
                          "run `dvc repro` (make_embedded rewrites both), not the stage by hand")


def main(branch: str) -> None:
    stage = open_stage("hf_download", branch)
    cfg, declared = stage.view, stage.reads["source"]
    with atomic_dir(stage.outs["dataset"], resume=True) as out:
        manifest = hub.fetch_dataset(cfg.dataset.source.model_dump(), out / "files")
        check_declared(declared, "dataset", cfg.dataset.source, manifest)
        files = datasets_check.dataset_files(cfg, out, "train_files")
        rows = check_rows(cfg, files)
        splits = {"train_rows": rows, **overlap(cfg, out, files)}
        write_stamp(out, "hf_download", hub.file_sha256(manifest), files=manifest["files"], rows=rows)
    with atomic_dir(stage.outs["model"], resume=True) as out:
        manifest = hub.fetch_model(cfg.model.source.model_dump(), out / "files")
        check_declared(declared, "model", cfg.model.source, manifest)
        write_stamp(out, "hf_download", hub.file_sha256(manifest), files=manifest["files"])
    write_json(stage.metrics, splits)
    print(f"  model: {len(manifest['files'])} files; dataset: {rows} training rows checked"
          + (f", {splits['eval_rows_in_train']} of {splits['eval_rows']} held-out rows also in training"
             if "eval_rows" in splits else ""))


if __name__ == "__main__":
    run_stage(main, sys.argv[1], hub_token=True)  # the one stage that holds HF_TOKEN
