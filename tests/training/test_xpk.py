"""The xpk backend (mtpipe/training/xpk.py) and the workload's image (mtpipe/training/image.py), without GKE.

* Golden command lines: the SFT tutorial on v6e-32 (`xpk workload create`, multi-controller JAX)
  and GRPO on v6e-32 (`xpk workload create-pathways`), built from the presets' resolved configs. The
  MaxText module and arguments inside `--command` are the stage's own command (what the local
  runner would run for the same config) except the documented mapping of local paths and, for
  Pathways, MaxText's Pathways flags.
* The same lines, the `workload list` / `workload delete` calls and the documented `xpk cluster`
  commands read by xpk's own argument parser (the pinned release, in a side environment:
  tests/xpk_parser.py).
* The lifecycle against tests/fakes/fake_xpk.py (a stand-in `xpk` and `docker` on PATH) and the GCS
  emulator as the work bucket: completed, failed, restarted, out of restarts, a leftover workload
  of the same name; errors that stop the stage before any xpk or docker call; a canary HF_TOKEN
  that must appear in no xpk command line, environment, log or console line.
* The pod side (`python3 -m mtpipe.training.xpk_pod`, mtpipe/training/xpk_pod.py) with a tiny command
  instead of MaxText.
* Image tags: they change with the lock and the package's code, and only with them.
No MaxText runs here; the module takes seconds.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import gcsfs
import pytest
from omegaconf import OmegaConf

import xpk_parser
from fakes.gcs_emulator import GCS_TEST_ENV
from mtpipe.training import image, xpk, xpk_pod
from mtpipe.errors import ConfigError
from mtpipe.maxtext import commands, training_commands
from mtpipe.pipeline import config, rules, schema

pytestmark = pytest.mark.multihost

ROOT = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).parents[1] / "fakes" / "fake_xpk.py"
BUCKET = "gs://bkt/work"
SFT_RUN, RL_RUN = "train_sft-sft-0123456789ab", "train_rl-0123456789ab"
FILLED = {"cluster": "mtpipe-c", "project": "my-project", "zone": "us-east5-b",
          "docker_image": "us-docker.pkg.dev/my-project/mtpipe/mtpipe"}
CANARY = "hf_CanaryCanaryCanaryCanary42"


# ---- configs, inputs and commands --------------------------------------------------------------

def resolved(branch: str, preset: str, stage: str, **xpk_keys) -> OmegaConf:
    """A stage's resolved view of ``preset``, with the xpk placeholders filled in (or ``xpk_keys``)."""
    params = OmegaConf.create({"steps": None, "sft": {"preset": "embedded-sft"}, "rl": {"preset": "embedded-rl"}})
    params[branch].preset = preset
    cfg = config.compose(branch, params)
    if cfg.hardware.xpk is not None:
        xpk = cfg.hardware.xpk.model_copy(update={**FILLED, **xpk_keys})
        cfg = cfg.model_copy(update={"hardware": cfg.hardware.model_copy(update={"xpk": xpk})})
    return config.stage_view(cfg, stage)


def make_inputs(root: Path) -> dict[str, Path]:
    """Small stand-ins for the stage's local inputs: converted checkpoint, dataset files, model files."""
    files = {
        "maxtext/0/items/_METADATA": b"{}", "maxtext/0/items/params/0": b"weights",
        "dataset/files/data/train-00000.parquet": b"rows-a", "dataset/files/data/train-00001.parquet": b"rows-b",
        "dataset/files/data/test-00000.parquet": b"rows-t",
        "model/files/tokenizer.json": b"{}", "model/files/tokenizer_config.json": b"{}",
        "model/files/config.json": b"{}", "model/files/model-00001.safetensors": b"big weights",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "scratch").mkdir()
    return {"ckpt": root / "maxtext/0/items", "data": root / "dataset/files/data", "tok": root / "model/files",
            "metrics": root / "scratch/metrics.jsonl", "cache": root / "jax_cache"}


def sft_command(cfg, paths: dict[str, Path], bucket: str = BUCKET) -> commands.MaxTextCommand:
    return training_commands.train_sft(
        cfg, ckpt=paths["ckpt"], train_files=str(paths["data"] / "train-*.parquet"), eval_files=None,
        columns=["messages"], tokenizer_dir=paths["tok"], base_output=f"{bucket}/train_sft", run_name=SFT_RUN,
        metrics_file=paths["metrics"], jax_cache_dir=paths["cache"])


def rl_command(cfg, paths: dict[str, Path], bucket: str = BUCKET) -> commands.MaxTextCommand:
    return training_commands.train_rl(
        cfg, ckpt=paths["ckpt"], train_files=str(paths["data"] / "train-*.parquet"),
        eval_files=str(paths["data"] / "test-00000.parquet"), tokenizer_dir=paths["tok"],
        base_output=f"{bucket}/train_rl", run_name=RL_RUN, jax_cache_dir=paths["cache"])


DIGEST = re.compile(r"/inputs/[0-9a-f]{16}/")


def normalised(words: list[str]) -> list[str]:
    """Input digests replaced by <d> (their content addressing is tested on its own)."""
    return [DIGEST.sub("/inputs/<d>/", w) for w in words]


def split_command(command: str) -> tuple[list[str], list[str], list[str]]:
    """`--command` as (environment prefix, pod side, MaxText command)."""
    words = normalised(shlex.split(command))
    start, end = words.index("python3"), words.index("--")
    return words[:start], words[start:end], words[end + 1:]


def mapped(args: list[str], mapping: dict[str, str]) -> list[str]:
    return [f"{k}={mapping[k]}" if k in mapping else f"{k}={v}" for k, v in (a.split("=", 1) for a in args)]


def golden(cfg, cmd, pathways: bool) -> list[str]:
    p = xpk.plan(cmd, BUCKET, pathways)
    run_url = f"{BUCKET}/{'train_rl' if pathways else 'train_sft'}/{RL_RUN if pathways else SFT_RUN}"
    command = xpk.workload_command(cmd, p, run_url, pathways)
    name = xpk.workload_name(RL_RUN if pathways else SFT_RUN)
    return xpk.create_args(xpk.target(cfg), name, "REPO:sha-0123456789ab", command, dict(cmd.env), pathways, BUCKET)


# ---- golden command lines ----------------------------------------------------------------------

def test_sft_tutorial_on_v6e32_is_an_xpk_workload_running_the_stage_command(tmp_path):
    cfg = resolved("sft", "gemma3-4b-ultrachat-v6e32", "train_sft")
    paths = make_inputs(tmp_path)
    single = sft_command(cfg, paths)  # what the local runner would run for this config
    args = golden(cfg, single, pathways=False)

    assert args[:args.index("--command")] == [
        "workload", "create", "--cluster", "mtpipe-c", "--project", "my-project", "--zone", "us-east5-b",
        "--workload", "train-sft-sft-4db9e0d0", "--docker-image", "REPO:sha-0123456789ab", "--tpu-type", "v6e-32",
        "--num-slices", "1", "--max-restarts", "3", "--priority", "medium"]
    assert args[-2] == "--command"
    env, pod, main = split_command(args[-1])
    assert env == []
    assert pod == ["python3", "-m", "mtpipe.training.xpk_pod", "--run-dir", f"{BUCKET}/train_sft/{SFT_RUN}",
                   "--fetch", f"{BUCKET}/inputs/<d>/files=/tmp/mtpipe/inputs/<d>/files",
                   "--metrics", "/tmp/mtpipe/metrics.jsonl"]
    assert main == ["python3", "-m", "mtpipe.maxtext.adapter.training", commands.TRAIN_SFT, *mapped(single.args, {
        "load_parameters_path": f"{BUCKET}/inputs/<d>/items",
        "hf_train_files": f"{BUCKET}/inputs/<d>/train-*.parquet",
        "tokenizer_path": "/tmp/mtpipe/inputs/<d>/files",
        "metrics_file": "/tmp/mtpipe/metrics.jsonl",
        "jax_cache_dir": f"{BUCKET}/jax-cache",
    })]
    assert main[4:7] == [f"run_name={SFT_RUN}", f"base_output_directory={BUCKET}/train_sft", "model_name=gemma3-4b"]


def test_grpo_on_v6e32_is_a_pathways_workload_running_the_stage_command(tmp_path):
    cfg = resolved("rl", "llama3.1-8b-gsm8k-v6e32", "train_rl")
    paths = make_inputs(tmp_path)
    single = rl_command(cfg, paths)
    args = golden(cfg, single, pathways=True)

    assert args[:args.index("--command")] == [
        "workload", "create-pathways", "--cluster", "mtpipe-c", "--project", "my-project", "--zone", "us-east5-b",
        "--workload", "train-rl-0123456789ab", "--docker-image", "REPO:sha-0123456789ab", "--tpu-type", "v6e-32",
        "--num-slices", "1", "--max-restarts", "3", "--priority", "medium",
        "--pathways-gcs-location", f"{BUCKET}/pathways"]
    env, pod, main = split_command(args[-1])
    assert env == ["JAX_PLATFORMS=proxy", "JAX_BACKEND_TARGET=grpc://127.0.0.1:29000", "ENABLE_PATHWAYS_PERSISTENCE=1"]
    assert pod == ["python3", "-m", "mtpipe.training.xpk_pod", "--run-dir", f"{BUCKET}/train_rl/{RL_RUN}",
                   "--fetch", f"{BUCKET}/inputs/<d>/files=/tmp/mtpipe/inputs/<d>/files"]
    assert main == ["python3", "-m", "mtpipe.maxtext.adapter.training", commands.TRAIN_RL, *mapped(single.args, {
        "load_parameters_path": f"{BUCKET}/inputs/<d>/items",
        "hf_train_files": f"{BUCKET}/inputs/<d>/train-*.parquet",
        "hf_eval_files": f"{BUCKET}/inputs/<d>/test-00000.parquet",
        "tokenizer_path": "/tmp/mtpipe/inputs/<d>/files",
        "jax_cache_dir": f"{BUCKET}/jax-cache",
        # Pathways (MaxText's rl_on_multi_host.md / sft_on_multi_host.md): no OCDBT, no zarr3
        "checkpoint_storage_use_zarr3": "false", "checkpoint_storage_use_ocdbt": "false",
    }), "enable_single_controller=true"]
    assert "rollout_data_parallelism=-1" in main and "rollout_tensor_parallelism=4" in main


def test_the_v6e32_presets_train_as_the_v6e8_tutorial_presets(tmp_path):
    """Same MaxText arguments as the single-VM tutorials, except GRPO's layout on 4-chip hosts."""
    paths = make_inputs(tmp_path)
    sft32, sft8 = (sft_command(resolved("sft", p, "train_sft"), paths)
                   for p in ("gemma3-4b-ultrachat-v6e32", "gemma3-4b-ultrachat-v6e8"))
    assert sft32.args == sft8.args and sft32.env == {} and sft8.env["TPU_ACCELERATOR_TYPE"] == "v6e-8"
    rl32, rl8 = (rl_command(resolved("rl", p, "train_rl"), paths)
                 for p in ("llama3.1-8b-gsm8k-v6e32", "llama3.1-8b-gsm8k-v6e8"))
    differ = {a.split("=")[0] for a in set(rl32.args) ^ set(rl8.args)}
    assert differ == {"chips_per_vm", "rollout_data_parallelism", "rollout_tensor_parallelism"}


def test_inputs_are_addressed_by_content(tmp_path):
    paths = make_inputs(tmp_path)
    cfg = resolved("sft", "gemma3-4b-ultrachat-v6e32", "train_sft")
    first = xpk.plan(sft_command(cfg, paths), BUCKET, False)
    assert xpk.plan(sft_command(cfg, paths), BUCKET, False).uploads.keys() == first.uploads.keys()
    tokenizer = next(i for i in first.uploads.values() if "files/tokenizer.json" in i.files)
    assert "files/model-00001.safetensors" not in tokenizer.files, "weights are not the tokenizer"
    (paths["ckpt"] / "params/0").write_bytes(b"other weights")
    second = xpk.plan(sft_command(cfg, paths), BUCKET, False)
    assert len(set(first.uploads) - set(second.uploads)) == 1, "only the checkpoint's address changed"


def test_workload_names_fit_xpk_and_pathways():
    names = {xpk.workload_name(r) for r in (SFT_RUN, "train_sft-rl-0123456789ab", RL_RUN)}
    assert len(names) == 3
    for name in names:
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 22
    assert xpk.workload_name(SFT_RUN) == xpk.workload_name(SFT_RUN)


def test_backend_xpk_needs_its_section_and_one_process_per_host():
    params = OmegaConf.create({"steps": None, "sft": {"preset": "gemma3-4b-ultrachat-v6e32"},
                               "rl": {"preset": "embedded-rl"}})
    composed = config.compose("sft", params).model_dump(by_alias=True)
    with pytest.raises(ConfigError, match=r"^sft.hardware.xpk: is missing.*Fix: add an xpk: section to "
                                          r"conf/hardware/v6e-32.yaml"):
        rules.check_branch({**composed, "hardware": {**composed["hardware"], "xpk": None}}, "p")
    with pytest.raises(ConfigError, match=r"^sft.hardware.processes: is 2.*Fix: set processes: 1"):
        rules.check_branch({**composed, "hardware": {**composed["hardware"], "processes": 2}}, "p")


# ---- the command lines as xpk's own parser reads them ---------------------------------------------

@pytest.fixture(scope="session")
def xpk_python() -> Path:
    """The side environment with the pinned xpk, made once (about 10 s) and kept in work/xpk_env."""
    return xpk_parser.side_env()


def parsed_by_xpk(python: Path, lines: list[list[str]], home: Path) -> list[dict]:
    """Each line's parsed arguments (plus the xpk function it runs); every line must parse."""
    results = xpk_parser.parse(python, lines, home)
    refused = [f"xpk {shlex.join(line)}\n{r['error'][-800:]}" for line, r in zip(lines, results) if not r["ok"]]
    assert not refused, "xpk's own parser refuses:\n" + "\n\n".join(refused)
    return [{**r["args"], "function": r["function"]} for r in results]


@pytest.mark.cloud_contract
@pytest.mark.slow
def test_the_golden_command_lines_parse_with_xpks_own_parser(xpk_python, tmp_path, monkeypatch):
    paths = make_inputs(tmp_path)
    sft_cfg, rl_cfg = resolved("sft", "gemma3-4b-ultrachat-v6e32", "train_sft"), resolved(
        "rl", "llama3.1-8b-gsm8k-v6e32", "train_rl")
    sft, rl = golden(sft_cfg, sft_command(sft_cfg, paths), False), golden(rl_cfg, rl_command(rl_cfg, paths), True)
    t = schema.Xpk(**{**FILLED, "tpu_type": "v6e-16", "num_slices": 2, "max_restarts": 0, "priority": "low",
                      "provisioning": "reservation", "reservation": "r1", "pathways": False})
    variants = [xpk.create_args(t, "w", "img:t", "cmd", {"A": "1"}, False, BUCKET),
                *(xpk.create_args(t.model_copy(update={"provisioning": mode}), "w", "img:t", "cmd", {}, pathways,
                                  BUCKET) for mode, pathways in (("spot", True), ("on-demand", False)))]
    polls = []   # the list and delete calls the lifecycle makes, as it makes them
    workload = xpk.Workload("xpk", t, "w", f"{BUCKET}/run", tmp_path / "log")
    monkeypatch.setattr(workload, "xpk", lambda *args, **_: polls.append(list(args)) or
                        subprocess.CompletedProcess(args, 0, "", ""))
    workload.status()
    workload.delete()
    got = parsed_by_xpk(xpk_python, [sft, rl, *variants, *polls], tmp_path)

    expected = {"cluster": "mtpipe-c", "project": "my-project", "zone": "us-east5-b", "num_slices": 1,
                "docker_image": "REPO:sha-0123456789ab", "tpu_type": "v6e-32", "max_restarts": "3",
                "priority": "medium"}
    assert got[0] | expected == got[0] and got[1] | expected == got[1]
    assert (got[0]["function"], got[0]["workload"], got[0]["command"]) == ("workload_create", "train-sft-sft-4db9e0d0",
                                                                         sft[-1])
    assert (got[1]["function"], got[1]["workload"], got[1]["command"]) == ("workload_create_pathways",
                                                                         "train-rl-0123456789ab", rl[-1])
    assert got[1]["pathways_gcs_location"] == f"{BUCKET}/pathways"
    reservation, spot, on_demand, listing, delete = got[2:]
    assert (reservation["reservation"], reservation["env"], reservation["num_slices"]) == ("r1", ["A=1"], 2)
    assert spot["spot"] and spot["function"] == "workload_create_pathways" and not spot["reservation"]
    assert on_demand["on_demand"] and on_demand["function"] == "workload_create"
    assert (listing["function"], listing["filter_by_job"]) == ("workload_list", "w")
    assert (delete["function"], delete["workload"], delete["cluster"]) == ("workload_delete", "w", "mtpipe-c")


# The docs' placeholders as values xpk accepts (a cluster name is lowercase, like a Kubernetes name).
DOC_VALUES = {"C": "mtpipe-c", "P": "my-project", "Z": "us-east5-b", "R": "my-reservation"}


def documented_cluster_commands() -> list[tuple[str, list[str]]]:
    """(file, argv after `xpk`) of each `xpk cluster ...` command in README.md and docs/: inline code
    with flags, not a mention of the subcommand nor a synopsis with `...`."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for span in re.findall(r"`(xpk cluster [^`]+)`", path.read_text()):
            if " --" in span and "..." not in span:
                found.append((path.name, [DOC_VALUES.get(w, w) for w in shlex.split(span)[1:]]))
    return found


@pytest.mark.cloud_contract
def test_the_documented_cluster_commands_parse_with_xpks_own_parser(xpk_python, tmp_path):
    """The cluster a reader makes from the docs takes both workloads: `create-pathways` (GRPO's
    `workload create-pathways` needs its CPU node pool), with the capacity flags the docs name."""
    documented = documented_cluster_commands()
    creates = [(name, argv) for name, argv in documented if argv[:2] == ["cluster", "create-pathways"]]
    assert {name for name, _ in creates} >= {"README.md", "multihost.md"}, documented
    capacity = [["--reservation", "my-reservation"], ["--spot"], ["--on-demand"]]
    base = next(argv for name, argv in creates if name == "multihost.md")   # "with one of" the capacity flags
    lines = [argv for _, argv in documented] + [base + flags for flags in capacity]
    got = parsed_by_xpk(xpk_python, lines, tmp_path)
    for (name, argv), args in zip(documented, got):
        assert args["cluster"] == "mtpipe-c", (name, argv)
        if argv[:2] == ["cluster", "create-pathways"]:
            assert (args["function"], args["tpu_type"]) == ("cluster_create_pathways", "v6e-32"), (name, args)
    assert [(a["reservation"], a["spot"], a["on_demand"]) for a in got[-3:]] == [
        ("my-reservation", False, False), (None, True, False), (None, False, True)]
    assert f"xpk=={xpk_parser.XPK_VERSION}" in (ROOT / "docs" / "multihost.md").read_text()


# ---- the lifecycle against the fake xpk ----------------------------------------------------------

class Fake:
    """tests/fakes/fake_xpk.py as `xpk` and `docker` on PATH, and its records."""

    def __init__(self, root: Path) -> None:
        self.dir, bin_dir = root / "fake", root / "bin"
        self.dir.mkdir()
        bin_dir.mkdir()
        for tool in ("xpk", "docker"):
            (bin_dir / tool).write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" {tool} "$@"\n')
            (bin_dir / tool).chmod(0o755)
        self.bin = bin_dir
        (self.dir / "image-present").touch()
        self.scenario("success")

    def scenario(self, outcome: str, **extra) -> None:
        (self.dir / "scenario.json").write_text(json.dumps({"outcome": outcome, **extra}))

    def calls(self, tool: str | None = None) -> list[dict]:
        path = self.dir / "calls.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [r for r in records if tool in (None, r["tool"])]

    def xpk_commands(self) -> list[str]:
        return [" ".join(c["argv"][:2]) for c in self.calls("xpk")]


@pytest.fixture
def fake(tmp_path, monkeypatch) -> Fake:
    f = Fake(tmp_path)
    monkeypatch.setenv("PATH", f"{f.bin}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_XPK_DIR", str(f.dir))
    monkeypatch.delenv(xpk.XPK_ENV, raising=False)
    monkeypatch.setattr(xpk, "POLL_S", 0.0)
    return f


@pytest.fixture
def bucket(gcs_emulator, monkeypatch, request) -> str:
    """A fresh prefix of the emulator's bucket as MTPIPE_WORK_BUCKET."""
    for key, value in GCS_TEST_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    url = f"gs://{gcs_emulator.bucket}/{re.sub(r'[^A-Za-z0-9_]+', '-', request.node.name).strip('-')}"
    monkeypatch.setenv(xpk.WORK_BUCKET_ENV, url)
    return url


def emulator_fs() -> gcsfs.GCSFileSystem:
    return gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)


def run_sft(tmp_path: Path, bucket: str, **xpk_keys) -> tuple[commands.MaxTextCommand, Path, dict[str, Path]]:
    cfg = resolved("sft", "gemma3-4b-ultrachat-v6e32", "train_sft", **xpk_keys)
    paths = make_inputs(tmp_path / "inputs")
    cmd = sft_command(cfg, paths, bucket)
    log = tmp_path / "logs" / "train_sft.log"
    xpk.run(cfg, cmd, log, total_steps=6)
    return cmd, log, paths


@pytest.mark.slow
def test_a_completed_workload_returns_with_its_log_and_metrics(fake, bucket, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", CANARY)
    cmd, log, paths = run_sft(tmp_path, bucket)

    assert fake.xpk_commands() == ["workload list", "workload create", "workload list", "workload list",
                                   "workload list", "workload delete"]
    assert [c["argv"][:2] for c in fake.calls("docker")] == [["manifest", "inspect"]]
    text = log.read_text()
    assert text.startswith(f"$ {cmd.as_tutorial()}\n# as xpk workload train-sft-sft-4db9e0d0 on cluster mtpipe-c\n")
    assert "# attempt 1 of 1: gs://" in text and "completed step: 5," in text and "# exit 0\n" in text
    assert [json.loads(line)["step"] for line in paths["metrics"].read_text().splitlines()] == list(range(6))
    out = capsys.readouterr().out
    assert "queued for 1 x v6e-32 (QuotaReserved)" in out and "running on 8 TPU VMs" in out
    assert "step 5/6  loss 2.500" in out and "done in" in out
    fs = emulator_fs()
    uploaded = fs.find(f"{bucket}/inputs")
    assert sum(p.endswith("/.complete") for p in uploaded) == 3  # checkpoint, dataset, tokenizer
    assert not any(p.endswith(".safetensors") for p in uploaded)

    # The canary: the token reached no xpk command line or environment, no log, no console line.
    assert not any(CANARY in " ".join(c["argv"]) or c["hub_token_in_env"] for c in fake.calls())
    assert CANARY not in text and CANARY not in out


@pytest.mark.slow
def test_a_failed_workload_raises_naming_it_its_state_and_the_log(fake, bucket, tmp_path, capsys):
    fake.scenario("failure")
    with pytest.raises(xpk.WorkloadFailed) as err:
        run_sft(tmp_path, bucket)
    assert err.value.workload == "train-sft-sft-4db9e0d0" and isinstance(err.value, RuntimeError)
    assert str(err.value) == ("xpk workload train-sft-sft-4db9e0d0 failed after 0 restarts (hardware.xpk."
                              "max_restarts: 3): jobset failed due to one or more job failures; log: "
                              f"{tmp_path / 'logs' / 'train_sft.log'}")
    assert "ValueError: bad" in err.value.log_path.read_text()
    assert fake.xpk_commands()[-1] == "workload list", "a failed workload is kept for inspection"
    assert "kept for inspection" in capsys.readouterr().out


@pytest.mark.slow
def test_a_restarted_workload_completes_and_the_log_says_so(fake, bucket, tmp_path, capsys):
    fake.scenario("restart")
    _, log, paths = run_sft(tmp_path, bucket)
    text = log.read_text()
    assert "# attempt 1 of 2: gs://" in text and "# attempt 2 of 2 (restarted): gs://" in text
    assert "MaxText starting (attempt 2)" in text and "completed step: 5," in text
    assert "restarted (attempt 2)" in capsys.readouterr().out
    assert fake.xpk_commands()[-1] == "workload delete"


@pytest.mark.slow
def test_a_few_failed_polls_do_not_stop_the_wait(fake, bucket, tmp_path):
    fake.scenario("success", flaky_lists=2)
    _, log, _ = run_sft(tmp_path, bucket)
    assert log.read_text().count("terminated with code `1`") == 2


@pytest.mark.slow
def test_ctrl_c_deletes_the_workload(fake, bucket, tmp_path, monkeypatch):
    def interrupt(self, total_steps):
        raise KeyboardInterrupt

    monkeypatch.setattr(xpk.Workload, "progress", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_sft(tmp_path, bucket)
    assert fake.xpk_commands() == ["workload list", "workload create", "workload list", "workload delete"]


@pytest.mark.slow
def test_a_workload_out_of_restarts_raises(fake, bucket, tmp_path):
    fake.scenario("exhausted")
    with pytest.raises(xpk.WorkloadFailed, match=r"failed after 1 restarts \(hardware.xpk.max_restarts: 3\): "
                                                  r"jobset failed due to reaching max number of restarts"):
        run_sft(tmp_path, bucket)


@pytest.mark.slow
def test_a_leftover_workload_of_the_same_name_is_replaced(fake, bucket, tmp_path, capsys):
    fake.scenario("success", existing=True, existing_name="train-sft-sft-4db9e0d0")
    run_sft(tmp_path, bucket)
    assert fake.xpk_commands()[:3] == ["workload list", "workload delete", "workload create"]
    assert "a workload of that name exists" in capsys.readouterr().out


@pytest.mark.slow
def test_inputs_already_in_the_bucket_are_not_uploaded_again(fake, bucket, tmp_path, capsys):
    run_sft(tmp_path, bucket)
    assert capsys.readouterr().out.count("uploading") == 3
    cfg = resolved("sft", "gemma3-4b-ultrachat-v6e32", "train_sft")
    same = make_inputs(tmp_path / "same")  # the same bytes elsewhere: the same addresses
    xpk.upload_inputs(xpk.plan(sft_command(cfg, same, bucket), bucket, False).uploads)
    out = capsys.readouterr().out
    assert out.count("already in the bucket") == 3 and "uploading" not in out


@pytest.mark.parametrize("case", ["no xpk binary", "no work bucket", "cluster unset", "reservation unset"])
def test_errors_stop_the_stage_before_any_xpk_or_docker_call(case, fake, bucket, tmp_path, monkeypatch):
    keys, expected = {}, {
        "no xpk binary": (xpk.XPK_ENV, r"'/nowhere/xpk' is not an executable.*pip install xpk"),
        "no work bucket": (xpk.WORK_BUCKET_ENV, r"is not set, but an xpk workload keeps.*export MTPIPE_WORK_BUCKET="),
        "cluster unset": ("hardware.xpk.cluster", r"is not set. Fix: set cluster: <the name of the cluster .*> in "
                          r"the xpk: section of conf/hardware/v6e-32.yaml"),
        "reservation unset": ("hardware.xpk.reservation", r"is not set. Fix: set reservation:"),
    }[case]
    if case == "no xpk binary":
        monkeypatch.setenv(xpk.XPK_ENV, "/nowhere/xpk")
    elif case == "no work bucket":
        monkeypatch.delenv(xpk.WORK_BUCKET_ENV)
    elif case == "cluster unset":
        keys = {"cluster": None}
    else:
        keys = {"provisioning": "reservation"}
    with pytest.raises(ConfigError, match=expected[1]) as err:
        run_sft(tmp_path, bucket, **keys)
    assert err.value.key == expected[0]
    assert fake.calls() == [], "nothing reached xpk or docker"
    assert emulator_fs().find(f"{bucket}/inputs") == [], "nothing was uploaded"


def test_provisioning_and_environment_become_xpk_flags():
    t = schema.Xpk(**{**FILLED, "tpu_type": "v6e-16", "num_slices": 2, "max_restarts": 0, "priority": "low",
                      "provisioning": "reservation", "reservation": "r1", "pathways": False})
    args = xpk.create_args(t, "w", "img:t", "cmd", {"A": "1"}, False, BUCKET)
    assert args[args.index("--num-slices"):] == ["--num-slices", "2", "--max-restarts", "0", "--priority", "low",
                                                 "--reservation", "r1", "--env", "A=1", "--command", "cmd"]
    spot = xpk.create_args(t.model_copy(update={"provisioning": "spot"}), "w", "i", "c", {}, False, BUCKET)
    assert "--spot" in spot and "--reservation" not in spot


# ---- the pod side -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_pod_side_fetches_runs_and_mirrors_on_the_first_host(bucket, tmp_path, monkeypatch, capsys):
    fs = emulator_fs()
    fs.pipe(f"{bucket}/inputs/abc/files/tokenizer.json", b'{"tok": 1}')
    monkeypatch.setattr(xpk_pod, "POD_DIR", str(tmp_path / "pod"))
    monkeypatch.delenv("TPU_WORKER_ID", raising=False)
    tok, metrics = tmp_path / "pod/inputs/abc/files", tmp_path / "pod/metrics.jsonl"
    fs.pipe(f"{bucket}/train_sft/r/metrics.jsonl", b'{"step": 0.0}\n')  # from an earlier attempt
    child = (f"import pathlib; print(pathlib.Path({str(tok)!r}, 'tokenizer.json').read_text()); "
             f"open({str(metrics)!r}, 'a').write('{{\"step\": 1.0}}\\n'); print('completed step: 1'); exit(3)")
    code = xpk_pod.main(["--run-dir", f"{bucket}/train_sft/r", "--fetch", f"{bucket}/inputs/abc/files={tok}",
                         "--metrics", str(metrics), "--", sys.executable, "-c", child])
    assert code == 3
    assert '{"tok": 1}' in capsys.readouterr().out
    (log,) = fs.glob(f"{bucket}/train_sft/r/{xpk_pod.LOG_DIR}/*.log")
    assert fs.cat(log).decode() == '{"tok": 1}\ncompleted step: 1\n# exit 3\n'
    assert fs.cat(f"{bucket}/train_sft/r/metrics.jsonl") == b'{"step": 0.0}\n{"step": 1.0}\n'

    assert xpk_pod.main(["--run-dir", f"{bucket}/train_sft/r2", "--fetch", f"{bucket}/inputs/none={tmp_path}/x",
                         "--", sys.executable, "-c", "pass"]) == 1
    (log,) = fs.glob(f"{bucket}/train_sft/r2/{xpk_pod.LOG_DIR}/*.log")
    assert "FileNotFoundError" in fs.cat(log).decode(), "a failed fetch is in the log the laptop reads"

    monkeypatch.setenv("TPU_WORKER_ID", "1")  # another host: runs, mirrors nothing
    assert xpk_pod.main(["--run-dir", f"{bucket}/train_sft/r", "--", sys.executable, "-c", "pass"]) == 0
    assert len(fs.glob(f"{bucket}/train_sft/r/{xpk_pod.LOG_DIR}/*.log")) == 1


# ---- the image ----------------------------------------------------------------------------------------

def image_tree(root: Path) -> Path:
    for rel, text in {"Dockerfile": "FROM ubuntu:22.04\n", "requirements-vm.lock": "jax==0.11.0 \\\n",
                      "mtpipe/__init__.py": "", "mtpipe/training/xpk.py": "X = 1\n", "docs/multihost.md": "# doc\n",
                      "tests/test_a.py": "", "stages/train_sft.py": "", "params.yaml": "steps: null\n",
                      "conf/hardware/v6e-32.yaml": "backend: xpk\n", "README.md": "hi\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize("edit,rebuilds", [
    ("docs/multihost.md", False), ("tests/test_a.py", False), ("stages/train_sft.py", False),
    ("params.yaml", False), ("conf/hardware/v6e-32.yaml", False), ("README.md", False),
    ("mtpipe/__pycache__/xpk.cpython-312.pyc", False),
    ("mtpipe/training/xpk.py", True), ("mtpipe/cloud/new.py", True), ("requirements-vm.lock", True),
    ("Dockerfile", True),
])
def test_the_image_tag_changes_with_the_lock_and_the_code_only(edit, rebuilds, tmp_path):
    root = image_tree(tmp_path)
    before = image.tag(root)
    assert re.fullmatch(r"sha-[0-9a-f]{12}", before) and image.tag(root) == before
    (root / edit).parent.mkdir(parents=True, exist_ok=True)
    with open(root / edit, "a") as f:
        f.write("# changed\n")
    assert (image.tag(root) != before) == rebuilds


def test_the_image_is_built_and_pushed_only_when_the_registry_lacks_its_tag(fake, tmp_path):
    root = image_tree(tmp_path / "src")
    ref = f"reg/mtpipe:{image.tag(root)}"
    assert image.ensure("reg/mtpipe", root) == ref
    assert [c["argv"] for c in fake.calls("docker")] == [["manifest", "inspect", ref]]

    (fake.dir / "image-present").unlink()
    assert image.ensure("reg/mtpipe", root) == ref
    build, push = fake.calls("docker")[2:]
    assert build["argv"][:5] == ["build", "--platform", "linux/amd64", "--tag", ref] and push["argv"] == ["push", ref]
    assert image.files(root) == [Path("Dockerfile"), Path("requirements-vm.lock"), Path("mtpipe/__init__.py"),
                                 Path("mtpipe/training/xpk.py")]


def test_the_project_dockerfile_installs_the_vm_lock_and_copies_the_package():
    text = (config.ROOT / "Dockerfile").read_text()
    assert "uv pip sync --require-hashes" in text and "install_tpu_post_train_extra_deps" in text
    assert "UV_COMPILE_BYTECODE=1" in text  # the image's imports read .pyc files, not sources
    assert "COPY mtpipe /app/mtpipe" in text and "FROM ubuntu:22.04" in text
    assert re.fullmatch(r"sha-[0-9a-f]{12}", image.tag())
