"""Stage hf_download@<branch>: the model and the dataset at pinned revisions, into DVC outputs.

Hub sources go through huggingface_hub (HF_TOKEN from the environment only); a local source (the
embedded default) is copied. Dataset rows are checked here, so a malformed row stops the pipeline
before any conversion or training starts, and the held-out split is compared with the training split:
metrics/<branch>/hf_download.json counts the held-out rows that also occur in training (a GSM8K question,
a whole conversation). Writes artifacts/<branch>/model/ and
artifacts/<branch>/dataset/, each stamped with its files (paths, sizes, sha256): the source and its
revision are the view's (dvc.lock), not the output's, so another source with the same files is the same output.
Run: dvc repro hf_download@sft   (or: python -m stages.hf_download sft)
"""

import os
import sys

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # before huggingface_hub is imported

from mtpipe.data import datasets_check, hub
from mtpipe.pipeline.config import load_stage
from mtpipe.pipeline.stage import ROOT, artifact, atomic_dir, run_stage, write_json, write_stamp


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


def main(branch: str) -> None:
    cfg = load_stage(branch, "hf_download")
    with atomic_dir(artifact(branch, "dataset"), resume=True) as out:
        manifest = hub.fetch_dataset(cfg.dataset.source.model_dump(), out / "files")
        files = datasets_check.dataset_files(cfg, out, "train_files")
        rows = check_rows(cfg, files)
        splits = {"train_rows": rows, **overlap(cfg, out, files)}
        write_stamp(out, "hf_download", hub.file_sha256(manifest), files=manifest["files"], rows=rows)
    with atomic_dir(artifact(branch, "model"), resume=True) as out:
        manifest = hub.fetch_model(cfg.model.source.model_dump(), out / "files")
        write_stamp(out, "hf_download", hub.file_sha256(manifest), files=manifest["files"])
    write_json(ROOT / "metrics" / branch / "hf_download.json", splits)
    print(f"  model: {len(manifest['files'])} files; dataset: {rows} training rows checked"
          + (f", {splits['eval_rows_in_train']} of {splits['eval_rows']} held-out rows also in training"
             if "eval_rows" in splits else ""))


if __name__ == "__main__":
    run_stage(main, sys.argv[1], hub_token=True)  # the one stage that holds HF_TOKEN
