"""GRPO with TRL's GRPOTrainer (torch + transformers on the CPU): the independent reference for
MaxText's GRPO path. Runs in the TRL side environment (benchmarks/grpo_trl.py builds it and writes
the spec); imports nothing from mtpipe or MaxText.

    <side env>/bin/python benchmarks/trl_reference.py SPEC.json OUT.json

SPEC.json (written by benchmarks/grpo_trl.py): the HF model directory (the exported warm-up), the
training prompts in MaxText's order, the held-out prompts, and MaxText's settings (group size,
learning rate and schedule, beta, clip, sampling, reward weights). The reward functions below are
written from MaxText's description (utils_rl.match_format_exactly, match_format_approximately,
check_numbers), not imported: tests/maxtext/test_grpo_trl.py checks that both score hand-written
completions alike. OUT.json: the held-out eval before and after (greedy accuracy, sampled pass@1,
format share, reward under sampling) and the reward per GRPO step; with 0 steps, the eval of the
model alone (grpo_trl.py --model: MaxText's GRPO result under the same evaluator).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def completion_text(completion) -> str:
    """A TRL completion: a string, or (conversational prompts) a list of messages."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def answer_of(text: str, tokens: dict[str, str]) -> str | None:
    """The content of the last <answer>...</answer>, or None."""
    found = re.findall(rf"{re.escape(tokens['solution_start_token'])}(.+?){re.escape(tokens['solution_end_token'])}",
                       text, re.DOTALL)
    return found[-1].strip() if found else None


def is_right(text: str, gold: str, tokens: dict[str, str]) -> bool:
    """The last answer tag holds a number equal to the gold answer (GSM8K's answers are numbers)."""
    guess = (answer_of(text, tokens) or "").replace(",", "")
    return NUMBER.fullmatch(guess) is not None and float(guess) == float(gold.replace(",", ""))


def make_rewards(tokens: dict[str, str], weights: dict[str, float]) -> list:
    """MaxText's three GSM8K rewards, reimplemented: exact format, partial format, right answer."""
    r_start, r_end, s_start, s_end = (re.escape(tokens[k]) for k in ("reasoning_start_token", "reasoning_end_token",
                                                                      "solution_start_token", "solution_end_token"))
    exact_format = re.compile(rf"{r_start}.*?{r_end}.*?{s_start}(.+?){s_end}", re.DOTALL)

    def match_format_exactly(completions, **_) -> list[float]:
        return [weights["reward_exact_format_match"] if exact_format.search(completion_text(c)) else 0.0
                for c in completions]

    def match_format_approximately(completions, **_) -> list[float]:
        def score(text: str) -> float:
            return sum(weights["reward_partial_format_match"] if text.count(tokens[k]) == 1
                       else weights["penalty_incorrect_format"]
                       for k in ("reasoning_start_token", "reasoning_end_token", "solution_start_token", "solution_end_token"))
        return [score(completion_text(c)) for c in completions]

    def check_numbers(completions, answer, **_) -> list[float]:
        texts = [completion_text(c) for c in completions]
        return [weights["penalty_incorrect_format"] if answer_of(text, tokens) is None
                else weights["reward_exact_answer"] if is_right(text, gold, tokens)
                else weights["penalty_incorrect_answer"] for text, gold in zip(texts, answer)]

    return [match_format_exactly, match_format_approximately, check_numbers]


def evaluate(model, tokenizer, prompts: list[dict], rewards: list, spec: dict) -> dict:
    """Greedy accuracy, and pass@1 / format share / reward per completion under the eval's sampling."""
    import torch

    settings, right, fmt, reward, greedy_right, total = spec["eval"], 0, 0, 0.0, 0, 0
    model.eval()  # the trainer leaves it in training mode
    for start in range(0, len(prompts), settings["batch_size"]):
        batch = prompts[start:start + settings["batch_size"]]
        texts = [tokenizer.apply_chat_template(p["prompt"], tokenize=False, add_generation_prompt=True) for p in batch]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        for sampled in (False, True):
            n = settings["samples_per_prompt"] if sampled else 1
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=spec["max_completion_length"], do_sample=sampled,
                                     num_return_sequences=n, pad_token_id=tokenizer.pad_token_id,
                                     **({"temperature": settings["temperature"], "top_k": settings["top_k"],
                                         "top_p": settings["top_p"]} if sampled else {}))
            completions = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            answers = [p["answer"] for p in batch for _ in range(n)]
            correct = sum(is_right(c, a, spec["tokens"]) for c, a in zip(completions, answers))
            if sampled:
                right += correct
                fmt += sum(score > 0 for score in rewards[0](completions=completions))
                reward += sum(map(sum, zip(*(fn(completions=completions, answer=answers) for fn in rewards))))
                total += len(completions)
            else:
                greedy_right += correct
    return {"greedy_accuracy": 100 * greedy_right / len(prompts), "sampled_pass_at_1": 100 * right / total,
            "sampled_format": 100 * fmt / total, "sampled_mean_reward": reward / total,
            "prompts": len(prompts), "samples_per_prompt": settings["samples_per_prompt"]}


def main(spec_path: str, out_path: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    torch.manual_seed(spec["seed"])
    torch.set_num_threads(spec.get("threads", 1))
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    rewards = make_rewards(spec["tokens"], spec["weights"])
    start = time.monotonic()
    before = evaluate(model, tokenizer, spec["eval_prompts"], rewards, spec)
    eval_s = time.monotonic() - start

    versions = {m.__name__: m.__version__ for m in (torch, __import__("trl"), __import__("transformers"))}
    g = spec["grpo"]
    if g["steps"] == 0:  # eval only: the model as it is (grpo_trl.py --model)
        write_result(out_path, {"before": before, "after": before, "curve": [], "train_seconds": 0.0,
                                "eval_seconds": eval_s, "versions": versions})
        return
    config = GRPOConfig(
        output_dir=str(Path(out_path).parent / "trl_run"), max_steps=g["steps"], seed=spec["seed"],
        per_device_train_batch_size=g["prompts_per_step"] * g["num_generations"], gradient_accumulation_steps=1,
        num_generations=g["num_generations"], steps_per_generation=1, shuffle_dataset=False,
        max_completion_length=spec["max_completion_length"], temperature=g["temperature"], top_k=g["top_k"],
        top_p=g["top_p"], beta=g["beta"], epsilon=g["epsilon"], num_iterations=1, loss_type="grpo",
        scale_rewards="group", learning_rate=g["learning_rate"], lr_scheduler_type="cosine",
        warmup_steps=g["warmup_steps"], adam_beta1=g["adam_b1"], adam_beta2=g["adam_b2"],
        adam_epsilon=g["adam_eps"], weight_decay=g["weight_decay"], max_grad_norm=g["max_grad_norm"],
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
        dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=False,  # a tiny model: no need
    )
    train = Dataset.from_list(spec["train_prompts"])
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=config, train_dataset=train, processing_class=tokenizer)
    start = time.monotonic()
    trainer.train()
    train_s = time.monotonic() - start
    after = evaluate(trainer.model, tokenizer, spec["eval_prompts"], rewards, spec)
    curve = [{"step": row["step"], "reward": row["reward"], "kl": row.get("kl"),
              "reward_exact_format": row.get("rewards/match_format_exactly/mean"),
              "reward_answer": row.get("rewards/check_numbers/mean"),
              "completion_length": row.get("completions/mean_length")}
             for row in trainer.state.log_history if "reward" in row]
    write_result(out_path, {"before": before, "after": after, "curve": curve, "train_seconds": train_s,
                            "eval_seconds": eval_s, "versions": versions})


def write_result(out_path: str, result: dict) -> None:
    """OUT.json, and its evals and times on stdout."""
    Path(out_path).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("before", "after", "train_seconds", "eval_seconds")}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
