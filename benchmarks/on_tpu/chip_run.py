"""Run groups of .tpu-chip/plan.json on the lent TPU chip (Python 3.11): each command in a process
of its own through measure.py (a group the plan lists as ``together``: all in one process), its log, metrics and final params kept, then each group packed into
``$OUT/<group>.tgz`` for benchmarks/on_tpu/collect.py. Called by chip.sh (docs/tpu-chip.md).

    python benchmarks/on_tpu/chip_run.py GROUP [GROUP ...] --out DIR [--deadline S] [--cpu]

``--deadline``: seconds from this start by which every run must have ended (a run that cannot start
with at least a minute left is recorded as skipped). ``--cpu``: the CPU rehearsal (no TPU check).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from mtpipe.maxtext.checkpoints import normalise_orbax_metadata  # noqa: E402  (Python 3.11 safe)

CHIP = ROOT / ".tpu-chip"
RUNS = Path("/tmp/mtpipe-chip-runs")
PACKAGES = ("jax", "jaxlib", "libtpu", "maxtext", "google-tunix", "flax", "orbax-checkpoint", "optax", "transformers")
KEEP_PARAMS = ("sft_a", "rl_warmup", "rl_grpo")  # exported and evaluated on the laptop


def versions() -> dict[str, str | None]:
    """Python and the packages that decide the numbers, as installed here."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def fill(value: str, start: str) -> str:
    """A planned argument with the chip's paths and the checkpoint a run starts from."""
    return value.replace("@CHIP@", str(CHIP)).replace("@RUNS@", str(RUNS)).replace("@START@", start)


def final_params(run_dir: Path) -> Path | None:
    """The newest checkpoint's model_params (train_rl: the actor's)."""
    base = run_dir / "checkpoints"
    base = base / "actor" if (base / "actor").is_dir() else base
    steps = sorted((int(p.name), p) for p in base.glob("*") if p.name.isdigit()) if base.is_dir() else []
    return steps[-1][1] / "model_params" if steps else None


def digest(directory: Path) -> str:
    """sha256 over every file's relative path and bytes, after the stages' own normalisation of what
    Orbax writes about the save itself: equal only for bitwise-equal params."""
    normalise_orbax_metadata(directory)
    h = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(directory)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def run_env(cpu: bool, run: dict) -> dict[str, str]:
    env = dict(os.environ, **run["env"])
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def start_args(run: dict) -> list[str] | None:
    """The run's arguments with the chip's paths; None when the checkpoint it starts from is missing."""
    start = ""
    if run.get("start_from"):
        params = final_params(RUNS / run["start_from"])
        if params is None:
            return None
        start = str(params)
    (RUNS / run["name"]).mkdir(parents=True, exist_ok=True)  # MaxText's pre-training trainer writes metrics_file there
    return [fill(a, start) for a in run["args"]]


def launch(argv: list[str], env: dict[str, str], log_path: Path, left_s: float) -> int | str:
    """``argv`` in a process of its own, its output in ``log_path``; its status or "timeout"."""
    with open(log_path, "w", encoding="utf8") as log:
        try:
            return subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=left_s).returncode
        except subprocess.TimeoutExpired:
            return "timeout"


def gather(name: str, work: Path, out: dict) -> dict:
    """``out`` with the run's measure.py record, its metrics, reward curve and final params kept."""
    record_path = work / f"{name}.measure.json"
    if record_path.is_file():
        out = out | json.loads(record_path.read_text()) | {"status": out["status"]}
    metrics = RUNS / name / "metrics.jsonl"
    if metrics.is_file():
        (work / f"{name}.metrics.jsonl").write_bytes(metrics.read_bytes())
    if (RUNS / name / "tensorboard").is_dir():  # train_rl's reward curve
        shutil.copytree(RUNS / name / "tensorboard", work / f"{name}.tensorboard", dirs_exist_ok=True)
    params = final_params(RUNS / name)
    if params is not None:
        out |= {"final_params": str(params.relative_to(RUNS / name)), "params_sha256": digest(params)}
        if name in KEEP_PARAMS:
            with tarfile.open(work / f"{name}.params.tgz", "w:gz") as tar:
                tar.add(params, arcname="model_params")
    return out


def run_one(run: dict, work: Path, left_s: float, cpu: bool) -> dict:
    """One planned command through measure.py; what it did, as a dict."""
    name = run["name"]
    args = start_args(run)
    if args is None:
        return {"name": name, "status": "skipped", "why": f"{run['start_from']} left no checkpoint"}
    argv = [sys.executable, str(HERE / "measure.py"), str(work / f"{name}.measure.json"), run["launcher"], run["module"],
            *args]
    (work / f"{name}.command.txt").write_text(" ".join(argv[2:]) + "\n")
    t0 = time.time()
    status = launch(argv, run_env(cpu, run), work / f"{name}.log", left_s)
    return gather(name, work, {"name": name, "status": status, "process_s": round(time.time() - t0, 1)})


def run_together(runs: list[dict], work: Path, left_s: float, cpu: bool) -> list[dict]:
    """The planned SFT commands in one measure.py process (``--together``); what each did."""
    spec = [{"record": str(work / f"{r['name']}.measure.json"), "module": r["module"], "args": start_args(r)}
            for r in runs]
    for run, one in zip(runs, spec):
        (work / f"{run['name']}.command.txt").write_text(" ".join([run["launcher"], run["module"], *one["args"]]) + "\n")
    (work / "together.json").write_text(json.dumps(spec, indent=1))
    t0 = time.time()
    status = launch([sys.executable, str(HERE / "measure.py"), "--together", str(work / "together.json")],
                    run_env(cpu, runs[0]), work / "together.log", left_s)
    process_s = round(time.time() - t0, 1)
    done = []
    for run in runs:
        record = work / f"{run['name']}.measure.json"
        own = json.loads(record.read_text())["status"] if record.is_file() else status if status != 0 else "not run"
        done.append(gather(run["name"], work, {"name": run["name"], "status": own, "process_s": process_s,
                                                "together": [r["name"] for r in runs]}))
    return done


def tpu_check() -> dict:
    """The TPU runtime check the VM runs after its setup (mtpipe.maxtext.tpu_check), for one v5e chip."""
    check = subprocess.run([sys.executable, "-m", "mtpipe.maxtext.tpu_check", "--devices", "1",
                            "--device-kind", "TPU v5 lite"],
                           capture_output=True, text=True, timeout=300)
    print(check.stdout + check.stderr, flush=True)
    return {"status": check.returncode, "output": (check.stdout + check.stderr)[-2000:]}


def run_group(group: str, runs: list[dict], began: float, opts: argparse.Namespace, head: dict) -> None:
    """Every run of ``group`` that can still finish before the deadline, then ``$OUT/<group>.tgz``."""
    work = Path("/tmp/mtpipe-chip") / group
    work.mkdir(parents=True, exist_ok=True)
    summary = head | {"group": group, "runs": []}
    left = opts.deadline - (time.time() - began)
    if group in opts.together and left >= 60 and not head.get("tpu_check", {}).get("status"):
        print(f"[{time.time() - began:6.0f}s] {group}: {', '.join(r['name'] for r in runs)} in one process", flush=True)
        summary["runs"] = run_together(runs, work, left - 15, opts.cpu)
        runs = []
        for done in summary["runs"]:
            print(f"[{time.time() - began:6.0f}s]   {done['name']}: status {done['status']}, peak HBM "
                  f"{(done.get('memory') or {}).get('peak_bytes_in_use')}", flush=True)
    for run in runs:
        left = opts.deadline - (time.time() - began)
        if left < 60 or head.get("tpu_check", {}).get("status"):
            summary["runs"].append({"name": run["name"], "status": "skipped",
                                    "why": "the TPU check failed" if left >= 60 else "deadline"})
            continue
        print(f"[{time.time() - began:6.0f}s] {group}: {run['name']} ({run['stage']})", flush=True)
        done = run_one(run, work, left - 15, opts.cpu)
        summary["runs"].append(done)
        print(f"[{time.time() - began:6.0f}s]   status {done['status']}, peak HBM "
              f"{(done.get('memory') or {}).get('peak_bytes_in_use')}", flush=True)
    (work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    opts.out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(opts.out / f"{group}.tgz", "w:gz") as tar:
        tar.add(work, arcname=group)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("groups", nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline", type=float, default=570.0)
    parser.add_argument("--cpu", action="store_true")
    opts = parser.parse_args()
    began = time.time()
    plan = json.loads((CHIP / "plan.json").read_text())
    head = {"smoke": plan["smoke"], "versions": versions(), "nproc": os.cpu_count()}
    opts.together = plan.get("together", [])
    if not opts.cpu:
        head["tpu_check"] = tpu_check()
    for group in opts.groups:
        run_group(group, plan["groups"][group], began, opts, head)


if __name__ == "__main__":
    main()
