"""GSM8K rows as chat conversations in the exact prompt format of MaxText's GRPO trainer.

The RL branch can warm its model up with a few SFT steps before GRPO (``rl.train_sft.steps``): the
tiny model first learns the answer format (``<reasoning>...</reasoning><answer>N</answer>``), then
GRPO raises the reward. The user turn is built the way train_rl builds its prompts
(``utils_rl.format_maxtext_messages``: rl.yml's ``data_template_path`` template and tokens), so the
SFT prompt and the RL prompt are the same tokens after the tokenizer's chat template.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

CALCULATOR = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations: 3*4=<<3*4=12>>12


def rl_prompt_format() -> tuple[str, dict[str, str]]:
    """(TEMPLATE with {system_prompt} filled in, tokens) from MaxText's installed rl.yml."""
    import maxtext

    root = Path(maxtext.__file__).parent
    rl = yaml.safe_load((root / "configs" / "post_train" / "rl.yml").read_text())
    template = json.loads((root.parent / rl["data_template_path"]).read_text())
    tokens = {k: rl[k] for k in ("reasoning_start_token", "reasoning_end_token",
                                  "solution_start_token", "solution_end_token")}
    system = template["SYSTEM_PROMPT"].format(**tokens)
    return template["TEMPLATE"].replace("{system_prompt}", system), tokens


def to_messages(question: str, answer: str, template: str, tokens: dict[str, str]) -> list[dict[str, str]]:
    """One GSM8K row as [user: RL prompt, assistant: <reasoning>..</reasoning><answer>N</answer>]."""
    reasoning, _, final = answer.rpartition("####")
    reasoning = CALCULATOR.sub("", reasoning).strip()
    reply = (f"{tokens['reasoning_start_token']}{reasoning}{tokens['reasoning_end_token']}"
             f"{tokens['solution_start_token']}{final.strip()}{tokens['solution_end_token']}")
    return [{"role": "user", "content": template.replace("{question}", question)},
            {"role": "assistant", "content": reply}]


def write_chat_parquet(gsm8k_files: list[Path], out: Path) -> int:
    """Convert GSM8K parquet files into one chat parquet file (column ``messages``); return rows."""
    template, tokens = rl_prompt_format()
    rows = [to_messages(r["question"], r["answer"], template, tokens)
            for f in gsm8k_files for r in pq.read_table(f, columns=["question", "answer"]).to_pylist()]
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"messages": rows}), out)
    return len(rows)


def prompt_lengths(gsm8k_files: list[Path], tokenizer_dir: Path) -> list[int]:
    """Token length of each question's GRPO prompt, built as train_rl builds it (chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    template, _ = rl_prompt_format()
    questions = [q for f in gsm8k_files for q in pq.read_table(f, columns=["question"]).column("question").to_pylist()]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": template.replace("{question}", q)}],
                                             tokenize=False, add_generation_prompt=True) for q in questions]
    return [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
