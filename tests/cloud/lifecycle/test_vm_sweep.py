"""A sweep on one VM: `doit vm_run --queue --set=steps=A --set=steps=B ...`.

Each value of a `--set` key given several times is one experiment; vm_run creates and sets up one
VM, then runs the experiments one after another there (`run.command` once each, the repo reset to
the shipped commit first) and brings each back as it finishes, so the conversion runs once and
every experiment comes back to `dvc exp show` (a sweep that loses its VM: test_vm_recovery.py).
The end-to-end test runs the real embedded SFT branch up to training on the loopback VM (fake
Compute API, SSH server, GCS emulator as the bucket), starting from an empty bucket.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from fakes.gcs_emulator import GcsEmulator, add_dvc_remote
from omegaconf import OmegaConf
from pipeline import copy_project
from vm_world import assert_deleted, experiments, loopback_world, sh

from mtpipe.cloud.on_vm import dvc_experiments
from mtpipe.errors import ConfigError

pytestmark = pytest.mark.preemption


def test_repeated_keys_make_one_experiment_per_value() -> None:
    lr = "sft.train_sft.learning_rate=1e-4"
    assert dvc_experiments.experiments(["steps=4", lr, "steps=6"], queue=True) == [["steps=4", lr], ["steps=6", lr]]
    assert dvc_experiments.experiments(["a=1", "a=2", "+b=3", "b=4"], queue=True) == [   # two swept keys: a grid
        ["a=1", "+b=3"], ["a=1", "b=4"], ["a=2", "+b=3"], ["a=2", "b=4"]]
    assert dvc_experiments.experiments(["steps=4", lr], queue=False) == [["steps=4", lr]]
    assert dvc_experiments.experiments([], queue=True) == [[]]
    with pytest.raises(ConfigError, match="--set: steps is given 2 times. Fix: .* add --queue"):
        dvc_experiments.experiments(["steps=4", "steps=6"], queue=False)
    assert dvc_experiments.experiment_names("sweep", 3) == ["sweep-1", "sweep-2", "sweep-3"]
    assert dvc_experiments.experiment_names("one", 1) == ["one"] and dvc_experiments.experiment_names(None, 2) == [None, None]


def test_each_experiment_starts_from_the_shipped_commit() -> None:
    cfg = OmegaConf.create({"run": {"hardware": None, "env": {"MTPIPE_WORK_BUCKET": "gs://b/w"},
                                    "remote_dir": "mtpipe", "command": "dvc pull && {dvc} && dvc push"}})
    script = dvc_experiments.run_script(cfg, Path("."), dvc_experiments.dvc_command(None, ["steps=6"], "s-2"), [], "s-2")
    lines = script.splitlines()
    assert lines[-1] == "dvc pull && python -m mtpipe.cloud.on_vm.exp_run exp run --pull -S steps=6 --name s-2 && dvc push"
    assert lines.index("git reset -q --hard && git clean -fdq") < len(lines) - 1
    assert "export MTPIPE_WORK_BUCKET=gs://b/w" in lines


@pytest.mark.slow
def test_sweep_on_one_vm(tmp_path: Path, gcs_emulator: GcsEmulator,
                         local_env: dict[str, str]) -> None:
    """Two `steps` values of the embedded SFT branch: one VM, one conversion, two trainings, two
    experiments in `dvc exp show`, nothing left after the run. (Two are enough to show what the
    later experiments reuse; docs/vm-sweep.md's measurement used three and the export.)"""
    repo = copy_project(tmp_path / "repo")
    add_dvc_remote(repo, gcs_emulator, local_env, prefix=tmp_path.name, local=False)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "remote"], repo, local_env)
    with loopback_world(tmp_path, repo, local_env) as w:
        w.configure(run__command='source "$HOME/venv/bin/activate" && '
                                 'dvc pull --allow-missing && {dvc} && dvc push')
        start = time.monotonic()
        out = w.doit("vm_run", "--queue", "--set=steps=4", "--set=steps=6",
                     "--target=train_sft@sft", "--exp-name=sweep").stdout
        wall_s = time.monotonic() - start
        assert len(w.fake.inserts()) == 1
        assert out.count("mtpipe: VM set up") == 1 and "experiment 2 of 2: steps=6" in out
        ran = Counter(re.findall(r"Running stage '([^']+)'", out))
        assert ran["to_maxtext@sft"] == 1 and ran["hf_download@sft"] == 1, ran
        assert ran["train_sft@sft"] == 2 and "to_huggingface@sft" not in ran, ran
        timings = [json.loads(line) for line in
                   (w.sshd.home / "mtpipe" / "work" / "timings.jsonl").read_text().splitlines()]
        assert Counter(t["stage"] for t in timings if t["stage"].endswith("@sft")) == {
            "to_maxtext@sft": 1, "train_sft@sft": 2}
        shown = experiments(w)
        assert {name: shown[name]["metrics"]["metrics/sft/train_sft.json"]["steps"]
                for name in ("sweep-1", "sweep-2")} == {"sweep-1": 4, "sweep-2": 6}
        assert_deleted(w)
    # For docs/vm-sweep.md: stage wall times on the loopback VM.
    print(json.dumps({"vm_run_wall_s": round(wall_s, 1), "timings": timings}), file=sys.stderr)
