"""The run report: what a run measured and what made it, in markdown, with its curves as PNGs.

    python -m mtpipe.reporting.report [--out reports/latest] [--timings work/timings.jsonl]

From the workspace's record (metrics/, plots/, dvc.yaml, dvc.lock, params.yaml, views/run.yaml),
the stage times this machine recorded (work/timings.jsonl) and the VM ledger (.vm_state.json, when
a VM ran), it writes OUT/README.md: the headline figures (what README.md quotes), the curves of
dvc.yaml's plots as PNGs drawn with matplotlib (no browser, no network), the stage times, the scores
of base and trained model with their 95% intervals, every metric, the cost and the lineage (git
commit, params that differ from the presets, each stage's outputs from dvc.lock). `make demo` ends
with it; reports/embedded/ is the committed record's (docs/decisions/reporting.md).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import yaml

from mtpipe.cloud.settings import vm_state
from mtpipe.pipeline.trainers import TRAINERS
from mtpipe.pipeline.stage_table import BY_NAME, address

ROOT = Path(__file__).resolve().parents[2]
REPORT = "README.md"
TIMES = "timings.jsonl"
HEADLINES = "## Headline figures"
RECORD = ["dvc.lock", "params.yaml", "metrics", "plots", "views"]   # what the lineage's "uncommitted" names


def fixed(value: float, digits: int) -> str:
    """``value`` with ``digits`` decimals, halves rounded up as people do (31.25 -> 31.3)."""
    return str(Decimal(str(value)).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def signed(value: float, digits: int) -> str:
    """:func:`fixed` with its sign (4.16 -> +4.2)."""
    return ("+" if value >= 0 else "") + fixed(value, digits)


def short(value: float) -> str:
    """A loss to 2 significant digits (6.46889 -> 6.5, 0.11834 -> 0.12)."""
    return fixed(value, max(0, 1 - Decimal(str(abs(value))).adjusted()))


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested keys joined with dots: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def metrics(root: Path) -> dict[str, dict[str, Any]]:
    """``{"<stage>@<branch>": its metrics}`` from metrics/<branch>/<stage>.json."""
    return {f"{path.stem}@{path.parent.name}": json.loads(path.read_text())
            for path in sorted((root / "metrics").glob("*/*.json"))}


def headlines(m: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The figures people quote (README.md's stage table), keyed by stage; those of the stages that ran."""
    figures = {}
    for trainer in TRAINERS:
        for branch in BY_NAME[trainer.stage].branches:
            if trained := m.get(f"{trainer.stage}@{branch}"):
                figures[address(trainer.stage, branch)] = (rollout_figures if trainer.rollout else loss_figures)(trained)
    if gsm8k := m.get("evaluate@rl"):
        base, trained, gain = gsm8k["base"], gsm8k["trained"], gsm8k["gain"]
        warmup = f"warm-up {fixed(gsm8k['warmup']['flexible_accuracy'], 1)}%, " if "warmup" in gsm8k else ""
        figures["evaluate@rl"] = (f"base {fixed(base['flexible_accuracy'], 1)}%, {warmup}trained "
                                  f"{fixed(trained['flexible_accuracy'], 1)}% on {trained['problems']} problems, gain "
                                  f"{signed(gain['flexible_gain'], 1)} points [95%: +/-{fixed(gain['flexible_gain_ci95'], 1)}]")
        if "warmup" in gsm8k:
            figures["evaluate@rl stages"] = "; ".join(
                f"{who} {signed(g['flexible_gain'], 1)} [+/-{fixed(g['flexible_gain_ci95'], 1)}]"
                for who, g in (("warm-up over base", gsm8k["warmup_gain"]), ("GRPO over warm-up", gsm8k["grpo_gain"])))
        figures["evaluate@rl strict"] = (f"base {fixed(base['strict_accuracy'], 1)}%, "
                                         f"trained {fixed(trained['strict_accuracy'], 1)}%")
    if heldout := m.get("evaluate@sft"):
        base, trained, gain = heldout["base"], heldout["trained"], heldout["gain"]
        figures["evaluate@sft"] = (f"base {fixed(base['loss'], 2)}, trained {fixed(trained['loss'], 2)}, "
                                   f"gain {fixed(gain['loss_gain'], 2)} [+/-{fixed(gain['loss_gain_ci95'], 2)}]")
    return figures


def loss_figures(m: dict[str, Any]) -> str:
    """A training's loss, first and last step (and its eval loss, when it evaluated)."""
    figures = f"{m['steps']} steps: loss {short(m['loss_first'])} -> {short(m['loss_last'])}"
    if "eval_loss_first" in m:
        figures += f" (eval {short(m['eval_loss_first'])} -> {short(m['eval_loss_last'])})"
    return figures


def rollout_figures(m: dict[str, Any]) -> str:
    """A GRPO run's eval before and after, and its pass@k gains."""
    samples = m.get("eval_post_samples_per_prompt", 1)
    score, drawn = ("pass@1", f" x {samples} samples") if samples > 1 else ("accuracy", "")
    figures = (f"eval {score} {fixed(m['eval_pre_accuracy'], 1)}% before / "
               f"{fixed(m['eval_post_accuracy'], 1)}% after on {m['eval_post_total']} prompts{drawn}")
    if "eval_gain_pass_at_1" in m:
        k = max(int(key.rsplit("_", 1)[1]) for key in m if re.fullmatch(r"eval_gain_pass_at_\d+", key))
        figures += "".join(
            f"; pass@{j} gain {signed(m[f'eval_gain_pass_at_{j}'], 1)} [+/-{fixed(m[f'eval_gain_pass_at_{j}_ci95'], 1)}]"
            for j in sorted({1, k}))
    return figures


def read_headlines(report: Path) -> dict[str, str]:
    """The headline figures of a written report (its "Headline figures" list)."""
    section = report.read_text().split(HEADLINES, 1)[1].split("\n## ", 1)[0]
    return dict(line[3:].split("`: ", 1) for line in section.splitlines() if line.startswith("- `"))


def curve_files(root: Path) -> list[tuple[str, str, dict[str, list[str]]]]:
    """dvc.yaml's top-level plots: (title, x column, {csv path: y columns})."""
    plots = yaml.safe_load((root / "dvc.yaml").read_text())["plots"]
    return [(title, spec["x"], {path: [ys] if isinstance(ys, str) else ys for path, ys in spec["y"].items()})
            for (title, spec), in (p.items() for p in plots)]


def draw(root: Path, title: str, x: str, ys: dict[str, list[str]], out: Path) -> None:
    """One plot of dvc.yaml as a PNG (no timestamp in it: same data, same bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for path, columns in ys.items():
        rows = list(csv.DictReader((root / path).open()))
        for column in columns:
            points = [(float(r[x]), float(r[column])) for r in rows if r.get(column)]
            ax.plot(*zip(*points), marker="o" if len(points) <= 20 else None, markersize=3,
                    label=column if len(ys) == 1 else f"{path}: {column}")
    ax.set(title=title, xlabel=x)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)


def stage_times(timings: Path) -> dict[str, dict[str, Any]]:
    """The latest line of each stage in a timings file (work/timings.jsonl appends every run)."""
    if not timings.is_file():
        return {}
    lines = [json.loads(line) for line in timings.read_text().splitlines() if line.strip()]
    return {line["stage"]: line for line in lines}


def write_times(times: dict[str, dict[str, Any]], out: Path) -> None:
    """The stage times a report shows, beside it (OUT/timings.jsonl: ``--timings`` rebuilds it from them)."""
    out.write_text("".join(json.dumps(line) + "\n" for line in times.values()))


def overrides(params: dict[str, Any]) -> dict[str, Any]:
    """params.yaml's values that override the presets (non-null ones), flattened: ``{"sft.train_sft.steps": 300}``."""
    return {key: value for key, value in flatten(params).items() if value is not None and not key.endswith(".preset")}


def cost(root: Path) -> str:
    """What the run's machines cost: the VM ledger's spend, or none when every stage ran here."""
    state = vm_state.read_state(root)
    if state.get("vms"):
        s = vm_state.spend(state)
        paid = f"; {s.reserved_count} paid by reservation {', '.join(sorted(s.reservations))} " \
               f"({s.reserved_hours:.2f} h, {s.reserved_usd:.2f} USD on-demand equivalent)" if s.reserved_count else ""
        return f"{s.count} VM(s), {s.hours:.2f} h, {s.usd:.2f} USD billed{paid} (.vm_state.json, conf/prices.yaml)"
    run = yaml.safe_load((root / "views" / "run.yaml").read_text()) or {}
    hardware = sorted({view["hardware"]["name"] for branch in run.values() for view in branch.values()
                       if "hardware" in view})
    if hardware == ["cpu"]:
        return "none: every stage ran on this machine's CPU (hardware preset `cpu`)"
    return (f"not recorded here: hardware {', '.join(hardware)}, and this checkout holds no VM ledger "
            "(`doit vm_status` in the checkout that ran `doit vm_run` shows it)")


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def lineage(root: Path) -> list[str]:
    """Markdown lines: the commits, the params that differ from the presets, each stage's outputs."""
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    changed = git(root, "status", "--porcelain", "--", *RECORD).splitlines()
    params = yaml.safe_load((root / "params.yaml").read_text())
    presets = ", ".join(f"{branch}: `{params[branch]['preset']}`" for branch in ("sft", "rl"))
    lines = [f"- git HEAD: `{git(root, 'rev-parse', 'HEAD')}`"
             + (f", with uncommitted changes to {', '.join(sorted(c.split(maxsplit=1)[1] for c in changed))}" if changed else ""),
             f"- git dvc.lock: last committed in `{git(root, 'log', '-1', '--format=%H', '--', 'dvc.lock')}`",
             f"- presets: {presets}",
             f"- params that differ from the presets: `{json.dumps(overrides(params), sort_keys=True)}`", "",
             "| stage | outputs (dvc.lock md5) |", "| --- | --- |"]
    for name, stage in lock.items():
        outs = ", ".join(f"`{o['path']}` {o.get('md5', '?')}" for o in stage.get("outs", []))
        lines.append(f"| {name} | {outs} |")
    return lines


def scores(m: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown table: each model's score and each gain, paired on the same problems, with 95% intervals."""
    def cell(section: dict[str, Any] | None, value: str, ci: str) -> str:
        return f"{section[value]} +/- {section[ci]}" if section else "-"

    rows = []
    for stage, label, value, ci, gain, gain_ci in [
            ("evaluate@rl", "GSM8K flexible extraction (%)", "flexible_accuracy", "flexible_ci95", "flexible_gain",
             "flexible_gain_ci95"),
            ("evaluate@rl", "GSM8K strict (%)", "strict_accuracy", "strict_ci95", "strict_gain", "strict_gain_ci95"),
            ("evaluate@sft", "held-out loss (lower is better)", "loss", "loss_ci95", "loss_gain", "loss_gain_ci95")]:
        if stage in m:
            s = m[stage]
            rows.append(" | ".join([
                f"| {stage}", label, *(cell(s.get(who), value, ci) for who in ("base", "warmup", "trained")),
                *(cell(s.get(which), gain, gain_ci) for which in ("gain", "warmup_gain", "grpo_gain"))]) + " |")
    return ["| stage | score | base | warm-up | trained | gain: trained - base | warm-up - base | GRPO - warm-up |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |", *rows]


def write(out: Path, root: Path = ROOT, timings: Path | None = None) -> Path:
    """Write the report of ``root``'s workspace into ``out``; returns its README.md."""
    out.mkdir(parents=True, exist_ok=True)
    m = metrics(root)
    pictures = []
    for title, x, ys in curve_files(root):
        if not all((root / path).is_file() for path in ys):
            continue                         # a stage this run did not reach
        name = title.lower().replace(" ", "_").replace("-", "_") + ".png"
        draw(root, title, x, ys, out / name)
        pictures.append(f"![{title}]({name})")
    times = stage_times(timings or root / "work" / "timings.jsonl")
    write_times(times, out / TIMES)
    flat = [f"| {stage} | `{key}` | {value} |" for stage, values in m.items()
            for key, value in sorted(flatten(values).items())]
    lines = [
        "# Run report", "",
        "Written by `python -m mtpipe.reporting.report` from the workspace's metrics/, plots/, dvc.lock and params;",
        "README.md's figures come from here.", "",
        HEADLINES, "", *[f"- `{stage}`: {text}" for stage, text in headlines(m).items()], "",
        "## Curves", "", *pictures, "",
        "## Scores against the base model", "",
        "Every model of a branch is scored on the same held-out problems; a gain and its 95% interval are those "
        "of the per-problem differences (scores/<branch>/).", "", *scores(m), "",
        "## Stage times", "",
        "Wall time of each stage on the machine that ran it (work/timings.jsonl: not DVC outputs, they differ run "
        "to run).", "",
        *(["| stage | wall s | tokens/s | finished |", "| --- | --- | --- | --- |",
           *[f"| {s} | {t['wall_s']} | {t.get('tokens_per_s', '')} | {t['at']} |" for s, t in times.items()]]
          if times else ["No stage ran on this machine (no timings file)."]), "",
        "## Cost", "", cost(root), "",
        "## Lineage", "", *lineage(root), "",
        "## Every metric", "", "| stage | metric | value |", "| --- | --- | --- |", *flat, "",
    ]
    report = out / REPORT
    report.write_text("\n".join(lines))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "latest", help="the report's directory")
    parser.add_argument("--timings", type=Path, default=None, help="stage times (default: work/timings.jsonl)")
    args = parser.parse_args()
    print(f"run report: {write(args.out, ROOT, args.timings)}")


if __name__ == "__main__":
    main()
