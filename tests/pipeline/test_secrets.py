"""The Hub token exists only where it is needed: hf_download (docs/secrets.md).

Canary runs set HF_TOKEN (and HUGGING_FACE_HUB_TOKEN) to a random value made at run time, a fresh
HOME, TMPDIR and DVC site cache, and take the TPU VM's code path: MaxText is not decoupled from
Google Cloud, so it writes tensorboard, config dump included. After each run every file under the
repo copy (work/, .dvc/cache, .git), HOME, TMPDIR and DVC's site cache is searched byte for byte,
and the argv and environment of every process of the run were sampled from /proc while it ran.
The full run is the session's `pipeline_run` (tests/conftest.py): it costs no extra pipeline run.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import PipelineRun, restore
from pipeline import ROOT, CanaryEnv, ProcessWatch, dvc, env, files_containing

from mtpipe.maxtext.adapter.training import HOLD_ENV

pytestmark = pytest.mark.secrets

STAGE = re.compile(r"-m stages\.(\w+)")
# Every MaxText entry point of the pipeline, as the runner launches it.
MAXTEXT_CHILDREN = ("mtpipe.maxtext.adapter.conversion maxtext.checkpoint_conversion.to_maxtext",
                    "mtpipe.maxtext.adapter.training maxtext.trainers.post_train.sft.train_sft",
                    "mtpipe.maxtext.launch_rl_cpu maxtext.trainers.post_train.rl.train_rl",
                    "mtpipe.maxtext.adapter.conversion maxtext.checkpoint_conversion.to_huggingface")


def leaks(processes: dict) -> list[str]:
    """The samples where a process held the canary although it must not.

    Allowed: DVC (the user handed it the token, it hands it to hf_download), hf_download, and a
    stage process before `mtpipe.pipeline.stage.drop_hub_token` restarts it, i.e. before it started anything.
    Never allowed: the canary in any argv; in the environment of a stage that has started a child,
    of MaxText, or of anything below it.
    """
    found = []
    for seen in processes["holders"]:
        argv, stage = seen["cmdline"].split(), STAGE.search(seen["cmdline"])
        if seen["in_argv"]:
            found.append(f"argv: {seen['cmdline']}")
        elif "dvc" in [os.path.basename(a) for a in argv[:2]]:
            continue
        elif stage and (stage[1] == "hf_download" or not seen["has_children"]):
            continue
        else:
            found.append(f"environment: {seen['cmdline']}")
    return found


def assert_nowhere(findings: dict, expected_children: tuple[str, ...]) -> None:
    """No file, no argv, no forbidden environment held the canary, and the run's MaxText processes
    were really sampled (else the process check would prove nothing)."""
    files = findings["files"]
    assert files["files"] > 100 and files["bytes"] > 10_000_000, files  # the trees were really there
    assert files["found"] == [], f"the canary is in {files['found']}"
    assert leaks(findings["processes"]) == []
    commands = "\n".join(findings["processes"]["commands"])
    for child in expected_children:
        assert child in commands, f"{child} was never sampled:\n{commands}"


@pytest.mark.parametrize("hub_token", [False, True])
def test_a_stage_restarts_without_the_token_unless_it_downloads(hub_token):
    """/proc/self/environ, not only os.environ: a process keeps the environment it was started with."""
    canary = "hf_canary" + secrets.token_hex(8)
    code = ("import os; from mtpipe.pipeline.stage import run_stage; run_stage(lambda: print("
            f"open('/proc/self/environ', 'rb').read().count({canary.encode()!r}), os.environ.get('HF_TOKEN')), "
            f"hub_token={hub_token})")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_TOKEN": canary, "HUGGING_FACE_HUB_TOKEN": canary}).stdout
    assert out.split() == (["2", canary] if hub_token else ["0", "None"])


def test_only_hf_download_keeps_the_token():
    """Every stage script runs through run_stage (which drops the token); only hf_download opts out."""
    for script in sorted((ROOT / "stages").glob("*.py")):
        main = script.read_text().split('if __name__ == "__main__":')[1]
        assert "run_stage(main" in main, f"{script.name} does not start through mtpipe.pipeline.stage.run_stage"
        assert ("hub_token=True" in main) == (script.stem == "hf_download"), script.name


def test_the_process_watch_catches_a_process_holding_the_canary(tmp_path):
    """The /proc sampler and :func:`leaks` see the canary in an argv and in an environment."""
    canary = CanaryEnv.create(tmp_path)
    sleep = [sys.executable, "-c", "import time; time.sleep(1)"]
    with ProcessWatch(canary.canary, canary.marker, interval=0.05) as watch:
        subprocess.run([*sleep, canary.canary], env={**os.environ, **canary.env()}, check=True)
        subprocess.run([*sleep, "x"], env={**os.environ, **canary.env()}, check=True)
    assert leaks(watch.record()) == [f"argv: {' '.join(sleep)} <canary>", f"environment: {' '.join(sleep)} x"]


@pytest.mark.slow
def test_the_search_finds_the_token_maxtext_writes_into_tensorboard(tmp_path):
    """Why the token must not reach MaxText: with HF_TOKEN set and tensorboard on (the VM's code path),
    MaxText's config dump writes it into the event file, and the search used above finds it there."""
    canary = "hf_canary" + secrets.token_hex(8)
    code = (
        "import os, sys\n"
        "from maxtext.configs import pyconfig\n"
        "from maxtext.utils import max_utils, maxtext_utils\n"
        "base = os.path.join(os.path.dirname(pyconfig.__file__), 'base.yml')\n"
        "config = pyconfig.initialize([sys.argv[0], base, 'run_name=canary',\n"
        f"    'base_output_directory={tmp_path}', 'skip_jax_distributed_system=true', 'hardware=cpu'])\n"
        "writer = max_utils.initialize_summary_writer(config.tensorboard_dir, config.run_name)\n"
        "maxtext_utils.add_config_to_summary_writer(config, writer)\n"
        "writer.close()\n")
    environ = {k: v for k, v in os.environ.items() if k != "DECOUPLE_GCLOUD"}
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, timeout=300,
                   env={**environ, "HF_TOKEN": canary, "JAX_PLATFORMS": "cpu"})
    found = files_containing(canary, [tmp_path])["found"]
    assert [Path(f).name.startswith("events.out") for f in found] == [True], found


@pytest.mark.slow
def test_the_full_run_leaves_the_token_nowhere(pipeline_run: PipelineRun):
    """`dvc repro` of both branches: no file, no argv, no MaxText environment holds the canary, and
    hf_download had it (the token reaches the one place that needs it)."""
    findings = pipeline_run.findings
    assert_nowhere(findings, MAXTEXT_CHILDREN)
    assert any(STAGE.search(p["cmdline"])[1] == "hf_download" and p["in_environ"]
               for p in findings["processes"]["holders"] if STAGE.search(p["cmdline"])), findings["processes"]


def start_dvc(repo: Path, canary: CanaryEnv, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(["dvc", *args], cwd=repo, env={**env(), **canary.env(), **(extra_env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def events_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("tensorboard/**/events.out*"))


def holds_config_dump(events: Path) -> bool:
    """MaxText wrote its config (which has an hf_access_token key) into this TensorBoard event file."""
    return b"hf_access_token" in events.read_bytes()


def config_dumped(run_dir: Path) -> bool:
    return any(holds_config_dump(f) for f in events_files(run_dir))


def tensorboard_listing(run_dirs: set[Path]) -> dict[str, list[tuple[str, int, bool]]]:
    """Each run directory's event files: (name, size, holds the config dump), for a failure message."""
    return {d.name: [(f.name, f.stat().st_size, holds_config_dump(f)) for f in events_files(d)]
            for d in sorted(run_dirs)}


@pytest.mark.slow
def test_killed_and_failed_training_leave_the_token_nowhere(pipeline_repo: Path, tmp_path: Path):
    """train_sft killed by SIGKILL once it trains, then train_sft failing after MaxText ran (an
    empty `metrics_file` in extra_args: the stage finds no metrics to check); both keep their MaxText
    run directory, tensorboard included, for a resume. Nothing anywhere holds the canary."""
    canary, runs = CanaryEnv.create(tmp_path), pipeline_repo / "work" / "train_sft"
    before = set(runs.iterdir()) if runs.is_dir() else set()
    preset = pipeline_repo / "conf" / "preset" / "embedded-sft.yaml"
    cfg, proc = yaml.safe_load(preset.read_text()), None
    try:
        # tensorboardX flushes every 120 s (flush_secs) or on close; a run can end before the first
        # flush, so the killed run is held after its first step's checkpoint (MTPIPE_HOLD_AFTER_STEP:
        # waiting, not training) until its config dump is flushed. Its 6 steps and the failed run's 4
        # are the sweeps' (tests/pipeline/test_invalidation.py, tests/cloud/lifecycle/test_vm_sweep.py): one
        # compile each.
        cfg["train_sft"].update(steps=6)
        preset.write_text(yaml.safe_dump(cfg, sort_keys=False))
        with ProcessWatch(canary.canary, canary.marker) as watch:
            # Not --single-item: `configure` must rerun to resolve the 6 steps into the stage's config.
            # --no-run-cache: a sweep's 6-step run of the same recipe may have been cached on this worker.
            proc = start_dvc(pipeline_repo, canary, "repro", "--no-run-cache", "train_sft@sft",
                             extra_env={HOLD_ENV: "1"})
            deadline, training = time.monotonic() + 600, None
            while training is None and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.2)
                training = next((d for d in set(runs.glob("train_sft-*")) - before  # with its config dump
                                 if config_dumped(d) and next(d.glob("checkpoints/*/model_params"), None)), None)
            assert proc.poll() is None, f"train_sft ended before it could be killed:\n{proc.communicate()[0]}"
            assert training is not None, ("no run with a config dump and a checkpoint in 600 s: "
                                          f"{tensorboard_listing(set(runs.glob('train_sft-*')) - before)}")
            os.killpg(proc.pid, signal.SIGKILL)
            assert " steps=6 " in proc.communicate()[0], "the killed run did not get the edited preset"
            killed = set(runs.glob("train_sft-*")) - before

            cfg["train_sft"].update(steps=4, extra_args={"metrics_file": ""})  # MaxText writes none
            preset.write_text(yaml.safe_dump(cfg, sort_keys=False))
            failed = dvc(pipeline_repo, "repro", "train_sft@sft", check=False, extra_env=canary.env())
            assert failed.returncode != 0 and "MaxText metrics_file missing" in failed.stdout, failed.stdout[-3000:]
            kept = set(runs.glob("train_sft-*")) - before - killed
        assert len(killed) == 1 and len(kept) == 1, (killed, kept)
        assert all(config_dumped(d) for d in killed | kept), \
            f"no config dump in tensorboard: not the VM's code path: {tensorboard_listing(killed | kept)}"
        assert_nowhere(canary.search(pipeline_repo, watch), MAXTEXT_CHILDREN[1:2])
    finally:
        if proc is not None and proc.poll() is None:  # a failed check before the kill
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for run_dir in set(runs.glob("train_sft-*")) - before:
            shutil.rmtree(run_dir)
        restore(pipeline_repo)
