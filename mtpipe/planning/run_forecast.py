"""The whole run's forecast: every phase a TPU VM run bills, one line each with its range and source.

preflight forecasts the training step from the compile (:mod:`mtpipe.planning.preflight`); a run on
the VM also sets the VM up, downloads the model and the dataset, converts the checkpoint to MaxText
and back, and scores the base and the trained model with vLLM. This module puts a time on each of
those for the stages the run's DVC target reaches (``doit vm_run --target``; none: the whole
pipeline), from:

* **setup, conversions, training**: preflight's own row (``est_vm_setup_s``, ``est_convert_s``,
  ``est_export_s``, ``est_train_s`` with ``est_step_s_range``);
* **downloads**: the model's and the dataset's sizes (:func:`mtpipe.planning.budget.model_size`,
  :func:`~mtpipe.planning.budget.dataset_bytes`: the Hub index's ``total_size`` the project pins)
  over :data:`HUB_MB_S`;
* **evaluation**: per evaluation stage, vLLM's start (:data:`VLLM_START_S`) and the scorer's requests
  one at a time (``num_concurrent=1``): the problem count, the prompt tokens (prefill at a stated
  fraction of the chips' peak FLOP/s, :data:`PREFILL_EFFICIENCY`) and the generated tokens (each a
  read of the weights each chip holds, at :data:`DECODE_EFFICIENCY` of its HBM bandwidth: vLLM's on
  v6e, derived from a cited vLLM-on-TPU run, the figures GRPO's rollout takes too).

Every estimate is a (low, mid, high) triple. The total's interval is the sum of the phases' lows and
the sum of their highs: it holds whenever each phase falls in its own range, with no assumption that
their errors cancel (docs/preflight.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from mtpipe.errors import ConfigError
from mtpipe.pipeline.trainers import in_branch
from mtpipe.pipeline.config import ROOT
from mtpipe.pipeline.stage_table import BRANCH_STAGES, address
from mtpipe.planning import budget, step_model

Range = tuple[float, float, float]   # (low, mid, high)

# Assumptions (estimated, none measured on a TPU VM yet); each is printed as its line's source.
HUB_MB_S: Range = (40.0, 100.0, 250.0)       # the VM's download rate from the Hub, MB/s
SETUP_SCALE: Range = (0.67, 1.0, 2.0)        # the VM setup's range around preflight's est_vm_setup_s
CONVERSION_SCALE: Range = (0.5, 1.0, 2.0)    # to_maxtext's / to_huggingface's range around preflight's
VLLM_START_S: Range = (120.0, 300.0, 900.0)  # vLLM loading the model and compiling its TPU graphs, per stage
PREFILL_EFFICIENCY: Range = (0.15, 0.3, 0.5)  # of the chips' peak FLOP/s, a prompt at batch 1 (assumed)
# of the HBM bandwidth per new token: vLLM's on v6e, the figures GRPO's rollout takes (step_model: cited)
DECODE_EFFICIENCY: Range = step_model.VLLM_DECODE_EFFICIENCY
REQUEST_OVERHEAD_S: Range = (0.02, 0.05, 0.2)  # per request: HTTP, tokenizing, the scorer's bookkeeping
# GSM8K under lm-eval's gsm8k-cot-llama.yaml: each few-shot example is a user turn (the instruction
# template, 230 characters, around a question of 127 on average) and an answer (137 on average), the
# test problem one more user turn (a GSM8K test question averages ~240 characters); at ~4 characters
# per Llama 3 token, with the chat template's headers: ~130 tokens per shot, ~120 for the problem.
GSM8K_SHOT_TOKENS = 130
GSM8K_PROBLEM_TOKENS = 120
GSM8K_ANSWER_TOKENS: Range = (35.0, 100.0, 250.0)  # low: the few-shot answers' length; capped at max_new_tokens
HELDOUT_CONVERSATION_TOKENS: Range = (800.0, 1300.0, 2048.0)  # an UltraChat conversation, capped at max_length
# Test rows of the datasets the tutorials score (num_problems: null scores them all), from their dataset cards.
TEST_ROWS = {"openai/gsm8k": 1319, "HuggingFaceH4/ultrachat_200k": 23110}

# What each kind of phase is called where the total says what it holds, in run order.
KINDS = ("VM setup", "downloads", "conversion", "training", "export", "evaluation")


class Chip(Protocol):
    """What the evaluation's estimate reads of a TPU chip (mtpipe.planning.preflight.CHIPS)."""

    peak_tflops: float
    hbm_gbps: float


@dataclass(frozen=True)
class Phase:
    """One line of the forecast: a stage (or the VM setup), its kind (:data:`KINDS`), seconds, source."""

    name: str
    kind: str
    low_s: float
    mid_s: float
    high_s: float
    source: str


@dataclass(frozen=True)
class RunForecast:
    """The phases of one VM run (the setup once, then each branch's), at the VM's rate."""

    phases: list[Phase]
    usd_per_hour: float

    def total_s(self) -> Range:
        """(low, mid, high) seconds: each the sum of the phases' own."""
        return (sum(p.low_s for p in self.phases), sum(p.mid_s for p in self.phases),
                sum(p.high_s for p in self.phases))

    def usd(self) -> Range:
        return tuple(s / 3600 * self.usd_per_hour for s in self.total_s())  # type: ignore[return-value]

    def kinds(self) -> list[str]:
        """The kinds of phase the total holds, in run order."""
        return [k for k in KINDS if any(p.kind == k for p in self.phases)]

    def hours_text(self) -> str:
        low, mid, high = self.total_s()
        return f"about {mid / 3600:.2f} h ({low / 3600:.2f}-{high / 3600:.2f} h)"

    def usd_text(self) -> str:
        usd_low, usd, usd_high = self.usd()
        return f"{usd:.2f} USD ({usd_low:.2f}-{usd_high:.2f}) at {self.usd_per_hour:.2f} USD/h"

    def total_line(self) -> str:
        """The total as `doit preflight` prints it (vm_run's question: the same two parts)."""
        return f"{self.hours_text()}, {self.usd_text()}"

    def holds(self) -> str:
        """What the total counts, and what it does not."""
        return (f"{', '.join(self.kinds())}; not counted: DVC's uploads to the bucket and bringing the "
                "experiment back")

    def table(self) -> str:
        """One line per phase (minutes, their range, the source), then the total."""
        lines = [("phase", "min", "range", "source")]
        lines += [(p.name, f"{p.mid_s / 60:.1f}", f"{p.low_s / 60:.1f}-{p.high_s / 60:.1f}", p.source)
                  for p in self.phases]
        widths = [max(len(line[i]) for line in lines) for i in range(3)]
        rows = ["  ".join([*(v.ljust(w) for v, w in zip(line[:3], widths)), line[3]]) for line in lines]
        return "\n".join(rows + [f"total: {self.total_line()} (the range: the phases' lows summed, and their "
                                 f"highs); it holds {self.holds()}"])


def stages_of(target: str | None, root: Path = ROOT) -> set[str]:
    """The stage addresses (``train_sft@sft``, ``train_rl``) `dvc exp run <target>` runs on a first run:
    the target and every stage upstream of it, by DVC's own graph; None: every stage."""
    if target is None:
        return {address(stage, branch) for branch, stages in BRANCH_STAGES.items() for stage in stages}
    from dvc.repo import Repo   # DVC's graph of dvc.yaml: imported only when a target asks for it

    if not ((root / ".dvc").is_dir() and (root / "dvc.yaml").is_file()):   # no pipeline of its own (tests' repos
        root = ROOT                                                         # of params alone): the project's
    with Repo(str(root)) as repo:
        try:
            # by dvc.yaml's path: DVC reads a bare target relative to the working directory
            found = repo.stage.collect(f"{root / 'dvc.yaml'}:{target}", with_deps=True)
        except Exception as e:  # DVC's own errors (no such stage) have no common public base
            raise ConfigError("--target", f"{target!r} is no stage of {root / 'dvc.yaml'} ({e})",
                              "name a stage as `dvc repro` does, e.g. evaluate@sft or train_rl") from e
    return {stage.name for stage in found}   # name: train_sft@sft (addressing is relative to the cwd)


def scaled(seconds: float, scale: Range) -> tuple[float, float, float]:
    return seconds * scale[0], seconds * scale[1], seconds * scale[2]


def setup_phase(row: dict[str, Any]) -> Phase:
    """The VM's creation, boot and `doit vm_setup`, once per run, from preflight's row."""
    low, mid, high = scaled(row["est_vm_setup_s"], SETUP_SCALE)
    return Phase("VM setup", "VM setup", low, mid, high,
                 f"the tutorials' boot + install, {mid / 60:.0f} min (x{SETUP_SCALE[0]:g}-{SETUP_SCALE[2]:g}: "
                 "not measured on Google Cloud)")


def branch_phases(cfg: Any, row: dict[str, Any], chip: Chip, stages: set[str], root: Path = ROOT) -> list[Phase]:
    """The phases of one TPU branch (``cfg``: its composed config; ``row``: preflight's report of it)
    that ``stages`` (:func:`stages_of`) holds, in run order."""
    branch = cfg.branch
    phases: list[Phase] = []

    def add(stage: str, kind: str, seconds: Range, source: str) -> None:
        if address(stage, branch) in stages:
            phases.append(Phase(address(stage, branch), kind, *seconds, source))

    add("hf_download", "downloads", *_download(cfg, root))
    add("to_maxtext", "conversion", scaled(row["est_convert_s"], CONVERSION_SCALE),
        f"{row['param_count'] / 1e9:.2f} B parameters x {row['est_convert_s'] * 1e9 / row['param_count']:.0f} s "
        f"per billion: the tutorials' ~5 min for Gemma 3 4B (x{CONVERSION_SCALE[0]:g}-{CONVERSION_SCALE[2]:g})")
    for trainer in in_branch(BRANCH_STAGES[branch]):   # the training stages before the one preflight compiles
        steps = getattr(getattr(cfg, trainer.stage), trainer.steps_key)
        if trainer.stage != row["stage"] and steps:
            add(trainer.stage, "training", (0.0, 0.0, 0.0),
                f"NOT counted: the warm-up's {steps} steps (preflight compiles {row['stage']} only)")
    start, ckpt, wall = row["est_startup_s"], row["est_checkpoint_s"], row["wall_clock_factor"]
    add(row["stage"], "training", tuple(row["est_train_s_range"]),
        f"preflight: {row['steps']} steps x {row['est_step_s']:.3f} s "
        f"({row['est_step_s_range'][0]:.3f}-{row['est_step_s_range'][1]:.3f}) x{wall[1]:.2f} wall clock "
        f"({wall[0]:.2f}-{wall[2]:.2f}, the chip's stalls) + {start[1]:.0f} s ({start[0]:.0f}-{start[2]:.0f}) start-up"
        f"{' with vLLM' if row['stage'] == 'train_rl' else ''} + {row['checkpoint_saves']} checkpoint saves "
        f"{ckpt[1]:.0f} s ({ckpt[0]:.0f}-{ckpt[2]:.0f})")
    export = scaled(row["est_export_s"], CONVERSION_SCALE)
    add("to_huggingface", "export", export, f"like the conversion (x{CONVERSION_SCALE[0]:g}-{CONVERSION_SCALE[2]:g})")
    score, how = _evaluation(cfg, row["param_count"], chip)
    add("evaluate_base", "evaluation", score, f"the base model: {how}")
    if "evaluate_warmup" in BRANCH_STAGES[branch]:
        if cfg.train_sft.steps:
            add("evaluate_warmup", "evaluation", tuple(e + s for e, s in zip(export, score)),
                f"the warm-up exported, then {how}")
        else:
            add("evaluate_warmup", "evaluation", (0.0, 0.0, 0.0), "skipped: no warm-up (train_sft.steps 0)")
    add("evaluate", "evaluation", score, f"the trained model: {how}")
    return phases


def forecast(rows: list[dict[str, Any]]) -> RunForecast:
    """The run of preflight's ``rows`` (one per TPU branch, from one or several experiments on one
    VM): the VM setup once, then each row's phases (``run_phases``)."""
    phases = [setup_phase(rows[0])] + [Phase(**p) for r in rows for p in r["run_phases"]]
    return RunForecast(phases, rows[0]["usd_per_hour"])


def as_row(phases: list[Phase]) -> list[dict[str, Any]]:
    """The phases as they go into preflight's JSON row (``run_phases``)."""
    return [asdict(p) for p in phases]


def _download(cfg: Any, root: Path) -> tuple[Range, str]:
    """(seconds, source) of hf_download: the Hub's model and dataset files at :data:`HUB_MB_S`; a
    local source (the embedded twins) is copied from the checkout, not downloaded."""
    if cfg.model.source.kind != "hub":
        return (0.0, 0.0, 0.0), "local source: copied from the checkout, nothing downloaded"
    files = budget.model_size(cfg, root).files_bytes
    data = budget.dataset_bytes(cfg, root) if cfg.dataset.source.kind == "hub" else 0
    seconds = tuple((files + data) / (rate * 1e6) for rate in reversed(HUB_MB_S))
    return seconds, (f"{cfg.model.source.repo_id} {_size(files)} + {_dataset_name(cfg)} {_size(data)} at "
                     f"{HUB_MB_S[1]:g} MB/s ({HUB_MB_S[0]:g}-{HUB_MB_S[2]:g}, assumed)")


def _share(efficiency: Range) -> str:
    return f"{efficiency[1] * 100:g}% ({efficiency[0]:.0%}-{efficiency[2]:.0%})"


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.0f} MB"


def _dataset_name(cfg: Any) -> str:
    source = cfg.dataset.source
    return source.repo_id if source.kind == "hub" else "the dataset"


def _problems(cfg: Any) -> int:
    """How many test problems (conversations) an evaluation stage scores."""
    count = cfg.evaluate.num_problems
    if count is not None:
        return count
    source = cfg.dataset.source
    if source.kind == "hub" and source.repo_id in TEST_ROWS:
        return TEST_ROWS[source.repo_id]
    raise ConfigError(f"{cfg.branch}.evaluate.num_problems", "is null (all test rows), and the forecast knows no "
                      f"row count of {_dataset_name(cfg)}",
                      "set it to the number of problems to score, or add the dataset's test rows to "
                      "mtpipe/planning/run_forecast.py TEST_ROWS")


def _evaluation(cfg: Any, lm_params: int, chip: Chip) -> tuple[Range, str]:
    """(seconds, how) of one evaluation stage: vLLM's start, then the scorer's requests one at a time."""
    e = cfg.evaluate
    if e.backend != "vllm":
        return (0.0, 0.0, 0.0), f"NOT counted: evaluate.backend {e.backend} (the forecast knows vLLM's only)"
    problems = _problems(cfg)
    chips = e.tensor_parallel_size
    if cfg.dataset.row_schema == "gsm8k":
        prompt = GSM8K_PROBLEM_TOKENS + e.num_fewshot * GSM8K_SHOT_TOKENS
        answers = tuple(min(t, e.max_new_tokens) for t in GSM8K_ANSWER_TOKENS)
        what = (f"{problems} problems {e.num_fewshot}-shot: ~{prompt} prompt + {answers[1]:.0f} "
                f"({answers[0]:.0f}-{answers[2]:.0f}) new tokens each")
    else:
        prompt_range = tuple(min(t, e.max_length) for t in HELDOUT_CONVERSATION_TOKENS)
        answers = (1.0, 1.0, 1.0)
        what = (f"{problems} held-out conversations of ~{prompt_range[1]:.0f} "
                f"({prompt_range[0]:.0f}-{prompt_range[2]:.0f}) tokens")
    def token_s(efficiency: float) -> float:   # decode at batch 1: each chip reads its bf16 weights once
        return 2 * lm_params / chips / (chip.hbm_gbps * 1e9 * efficiency)

    seconds = []
    for i, j in ((0, 2), (1, 1), (2, 0)):   # low: short answers at the high efficiency, and so on
        tokens = prompt if cfg.dataset.row_schema == "gsm8k" else prompt_range[i]
        prefill_s = 2 * lm_params * tokens / (chips * chip.peak_tflops * 1e12 * PREFILL_EFFICIENCY[j])
        request_s = REQUEST_OVERHEAD_S[i] + prefill_s + answers[i] * token_s(DECODE_EFFICIENCY[j])
        seconds.append(VLLM_START_S[i] + problems * request_s)
    if cfg.dataset.row_schema == "gsm8k":
        rate = (f"decoding {token_s(DECODE_EFFICIENCY[1]) * 1e3:.1f} ms/token: {_share(DECODE_EFFICIENCY)} of the "
                "HBM bandwidth (vLLM on v6e, cited)")
    else:
        rate = f"prefill at {_share(PREFILL_EFFICIENCY)} of the peak FLOP/s (assumed)"
    how = (f"vLLM start {VLLM_START_S[1] / 60:.0f} min ({VLLM_START_S[0] / 60:.0f}-{VLLM_START_S[2] / 60:.0f}) + "
           f"{what}, one at a time, {rate}")
    return (seconds[0], seconds[1], seconds[2]), how
