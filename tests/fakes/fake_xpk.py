"""Stand-ins for the `xpk` and `docker` executables, for tests/training/test_xpk.py.

`tests/training/test_xpk.py` puts two wrappers on PATH (`xpk`, `docker`) that run this file with the tool's
name first. State lives in $FAKE_XPK_DIR: `calls.jsonl` gets one record per call (tool, argv, and
whether a Hugging Face token was in its environment), `scenario.json` says what the workload does,
`workload.json` is the submitted workload.

xpk (the subcommands mtpipe.training.xpk uses, with the output format of xpk v1.13's
`workload list`: "[XPK]" lines around a fixed-width table, commands/workload.py, core/workload.py):
* `workload create` / `create-pathways`: records the workload; `--command` is not run. Instead each
  later `workload list` advances one step of the scenario and writes what the pod side
  (mtpipe.training.xpk_pod) would have written into the bucket (STORAGE_EMULATOR_HOST): the first host's log
  of each attempt under `<run dir>/xpk-logs/`, and MaxText's metrics file.
* `workload list --filter-by-job NAME`: the table, with Kueue's state for the current step.
* `workload delete --workload NAME`: forgets it.
Scenarios (`outcome`): `success` (queued, running, completed), `failure` (a traceback, then
JobSet's "failed due to one or more job failures"), `restart` (attempt 1 dies at step 2, attempt 2
resumes and completes), `exhausted` (every attempt dies; "reaching max number of restarts").
`existing: true` in the scenario lists a workload before anything was created; `flaky_lists: n`
makes the next n `workload list` calls of a submitted workload fail.

docker: `manifest inspect` exits 0 when $FAKE_XPK_DIR/image-present exists; build and push succeed.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

STATE = Path(os.environ["FAKE_XPK_DIR"])
COLUMNS = ("Jobset Name", "Created Time", "Priority", "TPU/GPU VMs Needed", "TPU/GPU VMs Running/Ran",
           "TPU/GPU VMs Done", "Status", "Status Message", "Status Time")
TIME = "2026-07-01T10:00:00Z"


def record(tool: str, argv: list[str]) -> None:
    secret = any(os.environ.get(k) for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"))
    with open(STATE / "calls.jsonl", "a") as f:
        f.write(json.dumps({"tool": tool, "argv": argv, "hub_token_in_env": secret}) + "\n")


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def step_line(step: int, loss: float) -> str:
    return (f"completed step: {step}, seconds: 0.500, TFLOP/s/device: 10.0, Tokens/s/device: 2048.000, "
            f"total_weights: 4096, loss: {loss:.3f}\n")


def write_attempt(run_dir: str, attempt: int, steps: range, end: str, metrics: str | None) -> None:
    """What the pod side writes: the first host's log of one attempt, and the metrics file."""
    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)
    log = f"MaxText starting (attempt {attempt})\n" + "".join(step_line(s, 3.0 - 0.1 * s) for s in steps) + end
    fs.pipe(f"{run_dir}/xpk-logs/20260701T10000{attempt}Z-host-0.log", log.encode())
    if metrics:
        rows = [{"step": float(s), "learning/loss": 3.0 - 0.1 * s} for s in range(steps.stop)]
        fs.pipe(f"{run_dir}/{Path(metrics).name}", "".join(json.dumps(r) + "\n" for r in rows).encode())


FINISHED_OK = ("Finished", "jobset completed successfully", 8)


def advance(workload: dict, scenario: dict) -> tuple[str, str, int]:
    """One poll further: write what the pod wrote meanwhile; (Kueue state, message, VMs running)."""
    run_dir, metrics, step = workload["run_dir"], workload["metrics"], workload["polls"]
    outcome = scenario["outcome"]
    if outcome == "success":
        if step == 0:
            return "QuotaReserved", "Quota reserved in ClusterQueue cluster-queue", 0
        if step == 1:
            write_attempt(run_dir, 1, range(0, 3), "", metrics)
            return "Admitted", "The workload is admitted", 8
        write_attempt(run_dir, 1, range(0, 6), "# exit 0\n", metrics)
        return FINISHED_OK
    if outcome == "failure":
        if step == 0:
            write_attempt(run_dir, 1, range(0, 1), "Traceback (most recent call last):\nValueError: bad\n# exit 1\n",
                          metrics)
            return "Admitted", "The workload is admitted", 8
        return "Finished", "jobset failed due to one or more job failures", 8
    if outcome == "restart":
        if step == 0:
            write_attempt(run_dir, 1, range(0, 3), "", metrics)
            return "Admitted", "The workload is admitted", 8
        if step == 1:
            write_attempt(run_dir, 2, range(3, 6), "# exit 0\n", metrics)
            return "Admitted", "The workload is admitted", 8
        return FINISHED_OK
    if outcome == "exhausted":
        if step < 2:
            write_attempt(run_dir, step + 1, range(0, 2), "# exit 143\n", metrics)
            return "Admitted", "The workload is admitted", 8
        return "Finished", "jobset failed due to reaching max number of restarts", 8
    raise ValueError(outcome)


def table(rows: list[tuple[str, ...]]) -> str:
    """xpk's _render_workloads: columns padded to their widest cell, three spaces apart."""
    widths = [max(len(c) for c in col) for col in zip(COLUMNS, *rows)]
    fmt = "   ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*row) for row in [COLUMNS, *rows])


def xpk(argv: list[str]) -> int:
    scenario = json.loads((STATE / "scenario.json").read_text())
    path = STATE / "workload.json"
    workload = json.loads(path.read_text()) if path.exists() else None
    if workload is None and scenario.get("existing"):
        workload = {"name": scenario["existing_name"], "existing": True}
    command = argv[:2]
    if command in (["workload", "create"], ["workload", "create-pathways"]):
        pod = shlex.split(flag(argv, "--command"))
        pod = pod[pod.index("python3"):]
        workload = {"name": flag(argv, "--workload"), "run_dir": flag(pod, "--run-dir"),
                    "metrics": flag(pod, "--metrics"), "polls": 0}
        path.write_text(json.dumps(workload))
        print(f"[XPK] Starting workload create\n[XPK] Follow your workload here: https://console.cloud.google.com/"
              f"kubernetes/service/zone/cluster/default/{workload['name']}/details\n[XPK] Exiting XPK cleanly")
        return 0
    if command == ["workload", "delete"]:
        path.unlink(missing_ok=True)
        if scenario.get("existing"):
            scenario["existing"] = False
            (STATE / "scenario.json").write_text(json.dumps(scenario))
        print("[XPK] Starting Workload delete\n[XPK] Exiting XPK cleanly")
        return 0
    if command == ["workload", "list"]:
        if workload and scenario.get("flaky_lists", 0) > 0:  # e.g. the cluster's API did not answer
            scenario["flaky_lists"] -= 1
            (STATE / "scenario.json").write_text(json.dumps(scenario))
            print("[XPK] Task: `List Jobs` terminated with code `1`", file=sys.stderr)
            return 1
        rows = []
        if workload and workload.get("existing"):
            rows.append((workload["name"], TIME, "medium", "8", "8", "<none>", "Admitted", "The workload is admitted",
                         TIME))
        elif workload and (flag(argv, "--filter-by-job") or "") in workload["name"]:  # xpk: a substring match
            state, message, running = advance(workload, scenario)
            workload["polls"] += 1
            path.write_text(json.dumps(workload))
            rows.append((workload["name"], TIME, "medium", "8", str(running) if running else "<none>",
                         "<none>", state, message, TIME))
        print(f"[XPK] Starting workload list\n[XPK] Workload List Output:\n{table(rows)}\n"
              "[XPK] See your workloads in Cloud Console: https://console.cloud.google.com/kubernetes/aiml/"
              "deployments/jobs?project=p\n[XPK] Exiting XPK cleanly")
        return 0
    print(f"fake xpk: unsupported {argv}", file=sys.stderr)
    return 2


def docker(argv: list[str]) -> int:
    if argv[:2] == ["manifest", "inspect"]:
        return 0 if (STATE / "image-present").exists() else 1
    return 0 if argv[:1] in (["build"], ["push"]) else 2


if __name__ == "__main__":
    tool, args = sys.argv[1], sys.argv[2:]
    record(tool, args)
    sys.exit(xpk(args) if tool == "xpk" else docker(args))
