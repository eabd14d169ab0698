"""GSM8K through lm-eval: the task, its data from the pinned local files, and the scores.

Two tasks (``evaluate.task``), each reading the branch's pinned parquet test split instead of the Hub
(``dataset_path: parquet``):

* ``gsm8k_cot_llama``: lm-eval's own (the setup behind Meta's 84.5 for Llama-3.1-8B-Instruct:
  chain-of-thought prompts through the chat template, few-shot examples as chat turns). The GRPO
  tutorial's score.
* ``gsm8k_rl_format``: the project's, in the prompt and answer format train_rl trains and grades in
  (rl.yml's template, ``<reasoning>..</reasoning><answer>N</answer>``), greedy, generation stopped at
  ``</answer>``. What a model trained in that format can show; the embedded default's score.

lm-eval talks to an OpenAI-compatible completions server (``local-completions``, as MaxText's eval
runner does on TPU); on the CPU that server is :mod:`mtpipe.evaluation.server`.

Two answer extractions are reported: ``strict`` (the task's format: "The final answer is N", or the
number inside ``<answer>``) and ``flexible`` (the last number in the response), the headline score.
Each problem's result is kept (lm-eval's logged samples), so two models scored on the same problems
compare problem by problem: :func:`gain` is the paired difference with its 95% interval.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mtpipe.pipeline.stats import mean_ci

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

TASKS = ("gsm8k_cot_llama", "gsm8k_rl_format")
FILTERS = {"flexible": "flexible-extract", "strict": "strict-match"}


@contextmanager
def _offline(cache: Path) -> Iterator[None]:
    """While the block runs: no network, the datasets cache under the stage's work dir (lm-eval
    loads the parquet files), and lm-eval's requests to the server on 127.0.0.1 past any proxy the
    environment names; the environment as it was afterwards."""
    settings = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache),
                "TOKENIZERS_PARALLELISM": "false"}
    for key in ("NO_PROXY", "no_proxy"):
        settings[key] = ",".join(filter(None, [os.environ.get(key), "127.0.0.1", "localhost"]))
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def upstream_task_file() -> Path:
    """lm-eval's own gsm8k-cot-llama.yaml, in the installed lm-eval."""
    import lm_eval

    return Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k-cot-llama.yaml"


def rl_format_task(test_files: list[Path]) -> dict[str, Any]:
    """``gsm8k_rl_format``: train_rl's prompt (rl.yml's template, as the warm-up and GRPO see it) and
    its answer, the number inside ``<answer>``; lm-eval's GSM8K target, flexible extraction and
    exact-match normalisation, taken from its gsm8k_cot_llama task."""
    from mtpipe.data.gsm8k_chat import rl_prompt_format

    template, tokens = rl_prompt_format()
    upstream = yaml.safe_load(upstream_task_file().read_text())
    flexible = next(f for f in upstream["filter_list"] if f["name"] == FILTERS["flexible"])
    answer = re.escape(tokens["solution_start_token"])
    return {
        "task": "gsm8k_rl_format", "output_type": "generate_until", "test_split": "test",
        "dataset_path": "parquet", "dataset_name": None,
        "dataset_kwargs": {"data_files": {"test": [str(f) for f in sorted(test_files)]}},
        "doc_to_text": template.replace("{question}", "{{question}}"),
        "doc_to_target": upstream["doc_to_target"], "target_delimiter": "",
        "generation_kwargs": {"do_sample": False, "until": [tokens["solution_end_token"]]},
        "filter_list": [
            {"name": FILTERS["strict"], "filter": [
                {"function": "regex", "regex_pattern": answer + r"\s*(-?[$0-9.,]+)", "group_select": 0},
                {"function": "take_first"}]},
            flexible,
        ],
        "metric_list": upstream["metric_list"], "repeats": 1, "num_fewshot": 0, "metadata": {"version": 1.0},
    }  # fmt: skip


def write_task(task: str, test_files: list[Path], task_dir: Path) -> str:
    """``task`` reading ``test_files`` (parquet), written to ``task_dir``; returns the name to run."""
    task_dir.mkdir(parents=True, exist_ok=True)
    if task == "gsm8k_rl_format":
        (task_dir / f"{task}.yaml").write_text(yaml.safe_dump(rl_format_task(test_files), sort_keys=False))
        return task
    upstream = upstream_task_file()
    local = f"{task}_pinned"
    files = "\n".join(f"      - {f}" for f in sorted(test_files))
    (task_dir / f"{local}.yaml").write_text(
        f"include: {upstream}\ntask: {local}\ndataset_path: parquet\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test:\n{files}\ntest_split: test\n")
    return local


def task_manager(task_dir: Path) -> TaskManager:
    """lm-eval's index of the tasks :func:`write_task` wrote to ``task_dir``, and of nothing else: its
    ~14,700 bundled task files took 7 s to index in every evaluation (benchmarks/lm_eval_tasks.py). A task
    includes an upstream file by its path."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir), include_defaults=False)


def evaluate(base_url: str, tokenizer_dir: Path, test_files: list[Path], work: Path, *, task: str,
             num_problems: int | None, num_fewshot: int, max_new_tokens: int) -> list[dict[str, Any]]:
    """Each of the first ``num_problems`` test problems (None: all), scored on the model served at
    ``base_url``: ``{"problem", "target", "<filter>": 0 or 1, ...}`` in the test split's order."""
    with _offline(work / "datasets"):
        name = write_task(task, test_files, work / "tasks")
        from lm_eval import simple_evaluate

        results = simple_evaluate(
            model="local-completions",
            model_args=f"model=mtpipe,base_url={base_url},tokenizer_backend=huggingface,tokenizer={tokenizer_dir},"
                       "num_concurrent=1,max_retries=1",
            tasks=[name], task_manager=task_manager(work / "tasks"),
            num_fewshot=num_fewshot, limit=num_problems, apply_chat_template=True,
            fewshot_as_multiturn=num_fewshot > 0, gen_kwargs=f"max_gen_toks={max_new_tokens}",
            log_samples=True, random_seed=0, numpy_random_seed=0, fewshot_random_seed=0,
        )
    return problems(results["samples"][name])


def problems(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """lm-eval's logged samples (one per problem and filter) as one row per problem."""
    names = {lm_eval_filter: name for name, lm_eval_filter in FILTERS.items()}
    rows: dict[int, dict[str, Any]] = {}
    for sample in samples:
        if sample["filter"] in names:
            row = rows.setdefault(sample["doc_id"], {"problem": sample["doc_id"], "target": str(sample["target"])})
            row[names[sample["filter"]]] = int(sample["exact_match"])
    return [rows[i] for i in sorted(rows)]


def scores(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Exact-match accuracy in percent per extraction, each with its 95% interval half-width, and n."""
    out: dict[str, Any] = {"problems": len(rows)}
    for name in FILTERS:
        mean, ci, se = mean_ci([row[name] for row in rows])
        out[f"{name}_accuracy"] = round(100 * mean, 2)
        out[f"{name}_ci95"] = round(100 * ci, 2)
        out[f"{name}_stderr"] = round(se, 6)
    return out


def gain(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    """after - before per extraction in points, with the 95% interval of the paired difference: both
    models answered the same problems, so the interval is that of the per-problem differences."""
    if [(r["problem"], r["target"]) for r in before] != [(r["problem"], r["target"]) for r in after]:
        raise ValueError(f"scored on different problems ({len(before)} and {len(after)}): evaluate both with "
                         "the same test split and evaluate.num_problems")
    out = {}
    for name in FILTERS:
        mean, ci, _ = mean_ci([a[name] - b[name] for a, b in zip(after, before)])
        out[f"{name}_gain"] = round(100 * mean, 2)
        out[f"{name}_gain_ci95"] = round(100 * ci, 2)
    return out
