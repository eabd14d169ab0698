"""GSM8K through lm-eval: the task, its data from the pinned local files, and the scores.

The task is lm-eval's ``gsm8k_cot_llama`` (the setup behind Meta's 84.5 for Llama-3.1-8B-Instruct:
chain-of-thought prompts through the chat template, few-shot examples as chat turns), with its
dataset pointed at the branch's pinned parquet test split instead of the Hub (``dataset_path:
parquet``). lm-eval talks to an OpenAI-compatible completions server (``local-completions``, as
MaxText's eval runner does on TPU); on the CPU that server is :mod:`mtpipe.evaluation.server`.

Two of the task's filters are reported: ``strict`` (the response ends with "The final answer is N",
the format the prompt asks for) and ``flexible`` (the last number in the response). The flexible one
is the headline score: it counts a right answer in any format, which is what a model fine-tuned on
another answer format (the embedded default's GRPO tags) can show.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TASK = "gsm8k_cot_llama"
LOCAL_TASK = "gsm8k_cot_llama_pinned"
FILTERS = {"flexible": "flexible-extract", "strict": "strict-match"}
Z95 = 1.959964  # two-sided 95% normal quantile


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


def write_task(test_files: list[Path], task_dir: Path) -> None:
    """lm-eval's gsm8k_cot_llama task, reading ``test_files`` (parquet), as ``LOCAL_TASK`` in ``task_dir``."""
    import lm_eval

    upstream = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k-cot-llama.yaml"
    files = "\n".join(f"      - {f}" for f in sorted(test_files))
    task_dir.mkdir(parents=True, exist_ok=True)
    (task_dir / f"{LOCAL_TASK}.yaml").write_text(
        f"include: {upstream}\ntask: {LOCAL_TASK}\ndataset_path: parquet\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test:\n{files}\ntest_split: test\n")


def evaluate(base_url: str, tokenizer_dir: Path, test_files: list[Path], work: Path, *, num_problems: int | None,
             num_fewshot: int, max_new_tokens: int) -> dict[str, Any]:
    """Score the model served at ``base_url`` on the first ``num_problems`` test problems (None: all)."""
    with _offline(work / "datasets"):
        write_task(test_files, work / "tasks")
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        results = simple_evaluate(
            model="local-completions",
            model_args=f"model=mtpipe,base_url={base_url},tokenizer_backend=huggingface,tokenizer={tokenizer_dir},"
                       "num_concurrent=1,max_retries=1",
            tasks=[LOCAL_TASK], task_manager=TaskManager(include_path=str(work / "tasks")),
            num_fewshot=num_fewshot, limit=num_problems, apply_chat_template=True,
            fewshot_as_multiturn=num_fewshot > 0, gen_kwargs=f"max_gen_toks={max_new_tokens}",
            log_samples=False, random_seed=0, numpy_random_seed=0, fewshot_random_seed=0,
        )
    return scores(results["results"][LOCAL_TASK], results["n-samples"][LOCAL_TASK]["effective"])


def scores(task_result: dict[str, Any], n: int) -> dict[str, Any]:
    """exact-match accuracy in percent per filter, each with its 95% interval half-width, and n."""
    out: dict[str, Any] = {"problems": n}
    for name, lm_eval_filter in FILTERS.items():
        acc, se = task_result[f"exact_match,{lm_eval_filter}"], task_result[f"exact_match_stderr,{lm_eval_filter}"]
        se = 0.0 if se in (None, "N/A") or (isinstance(se, float) and math.isnan(se)) else float(se)
        out[f"{name}_accuracy"] = round(100 * float(acc), 2)
        out[f"{name}_ci95"] = round(100 * Z95 * se, 2)
        out[f"{name}_stderr"] = se
    return out


def gain(base: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """trained - base per filter, with a 95% interval from both standard errors.

    The interval treats the two scores as independent; they are on the same problems, so the true
    interval is narrower (the paired one needs per-problem results, which MaxText's TPU runner does
    not keep): this one is conservative and the same on both backends."""
    if base["problems"] != trained["problems"]:
        raise ValueError(f"base scored on {base['problems']} problems, trained on {trained['problems']}: "
                         "evaluate both with the same evaluate.num_problems")
    out = {}
    for name in FILTERS:
        out[f"{name}_gain"] = round(trained[f"{name}_accuracy"] - base[f"{name}_accuracy"], 2)
        se = math.hypot(base[f"{name}_stderr"], trained[f"{name}_stderr"])
        out[f"{name}_gain_ci95"] = round(100 * Z95 * se, 2)
    return out
