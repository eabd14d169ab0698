"""GRPO by TRL (GRPOTrainer, torch on the CPU) from the RL branch's warm-up, with MaxText's settings:
the independent reference for MaxText's GRPO path (docs/grpo-benchmark.md).

    python benchmarks/grpo_trl.py --repo PROJECT_COPY [--seed 1] [--steps N] [--model HF_DIR] [--out DIR]

PROJECT_COPY is a project checkout whose RL branch ran up to train_sft@rl (artifacts/rl/warmup,
model, dataset and views/rl/train_rl.yaml: the copy benchmarks/grpo_learns.py keeps with --keep,
or the project itself after `make demo`). This script, in the project's environment:

1. exports the warm-up to a Hugging Face directory (MaxText's to_huggingface, as to_huggingface@rl);
2. builds the prompts as train_rl does (MaxText's template and the tokenizer's chat template; grain's
   shuffle with the seed, MaxText's `data_shuffle_seed`; prompts over `max_prefill_predict_length`
   tokens dropped): the first num_batches x batch_size training prompts in train_rl's order, and the
   first num_test_batches x eval_batch_size test prompts (train_rl's eval set);
3. reads MaxText's settings as train_rl resolves them (MaxText's base.yml < rl.yml < the stage's
   config): group size, prompts per step, learning rate, warm-up fraction and cosine schedule, AdamW,
   gradient clipping, beta, clip epsilon, sampling, completion length, reward weights;
4. runs benchmarks/trl_reference.py in the TRL side environment (`side_env()`: Python 3.11, pinned
   torch (CPU) / trl / transformers, in work/trl_env; made on first use) and prints its table.

The eval (before and after, on the held-out prompts): greedy accuracy, and pass@1, format share
and reward per completion over `--eval-samples` completions per prompt sampled as GRPO's rollouts
sample (temperature, top-k, top-p of train_rl's `decode_sampling_*`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))
from mtpipe.data.gsm8k_chat import rl_prompt_format  # noqa: E402
from mtpipe.maxtext import conversion_commands  # noqa: E402
from mtpipe.pipeline.view import load_stage  # noqa: E402

SIDE_ENV = PROJECT / "work" / "trl_env"
# Python 3.11: the CPU build of torch 2.13.0 that pip takes on the project's machines is a cp311 wheel
# (docs/grpo-benchmark.md); any other torch release or Python pulls a CUDA build of several GB.
SIDE_PYTHON = "python3.11"
SIDE_PINS = ("torch==2.13.0", "trl==1.16.0", "transformers==5.12.1", "accelerate==1.16.0", "datasets==5.2.0")
MARKER = SIDE_ENV / "mtpipe-pins"
REFERENCE = PROJECT / "benchmarks" / "trl_reference.py"
REWARD_KEYS = ("reward_exact_format_match", "reward_partial_format_match", "reward_exact_answer",
               "penalty_incorrect_format", "penalty_incorrect_answer")
TOKEN_KEYS = ("reasoning_start_token", "reasoning_end_token", "solution_start_token", "solution_end_token")


def side_env() -> Path:
    """The TRL side environment's python, made on first use (pip, so that torch is the CPU wheel)."""
    from filelock import FileLock

    python = SIDE_ENV / "bin" / "python"
    SIDE_ENV.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(SIDE_ENV) + ".lock"):
        if MARKER.exists() and MARKER.read_text() == " ".join(SIDE_PINS) and python.exists():
            return python
        base = shutil.which(SIDE_PYTHON)
        if base is None:
            raise RuntimeError(f"{SIDE_PYTHON} not found: the TRL side environment needs it (the CPU torch wheel is "
                               "for Python 3.11); install it, or point PATH at one")
        shutil.rmtree(SIDE_ENV, ignore_errors=True)
        for step in ([base, "-m", "venv", str(SIDE_ENV)],
                     [str(python), "-m", "pip", "install", "--quiet", SIDE_PINS[0]],  # torch first: the CPU wheel
                     [str(python), "-m", "pip", "install", "--quiet", *SIDE_PINS]):
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"`{' '.join(step)}` failed ({done.stderr.strip()[-2000:]}): the TRL side environment "
                                   f"needs PyPI ({', '.join(SIDE_PINS)}); delete {SIDE_ENV} if it is half made")
        MARKER.write_text(" ".join(SIDE_PINS))
    return python


def maxtext_settings(stage: dict) -> dict:
    """train_rl's settings as it resolves them: MaxText's base.yml < rl.yml < the stage's `train_rl` section."""
    import maxtext

    configs = Path(maxtext.__file__).parent / "configs"
    settings = {**yaml.safe_load((configs / "base.yml").read_text()),
                **yaml.safe_load((configs / "post_train" / "rl.yml").read_text())}
    settings.update({k: v for k, v in stage.items() if k != "extra_args" and v is not None})
    settings["rl"] = {**settings["rl"], **{k: stage[k] for k in ("num_generations", "grpo_beta", "grpo_epsilon")
                                           if stage.get(k) is not None}}
    settings.update(stage.get("extra_args") or {})
    return settings


def export_warmup(repo: Path, out: Path) -> Path:
    """The warm-up's params as a Hugging Face directory: the rl export's command
    (mtpipe.maxtext.conversion_commands) on the warm-up instead of the GRPO result."""
    if (out / "config.json").exists():
        return out
    cfg = load_stage("rl", "to_huggingface", root=repo)
    cmd = conversion_commands.to_huggingface(cfg, params=repo / "artifacts/rl/warmup/model_params",
                                             hf_src_dir=repo / "artifacts/rl/model/files", out_dir=out)
    env = dict(os.environ, **cmd.env, PYTHONPATH=str(PROJECT))
    done = subprocess.run(cmd.argv(), env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (out / "config.json").exists():
        raise RuntimeError(f"exporting the warm-up failed:\n{done.stderr[-3000:]}")
    return out


def prompts(files: list[Path], tokenizer_dir: Path, count: int, settings: dict, seed: int) -> list[dict]:
    """train_rl's prompts of one split, in its order: shuffled by grain with the seed, too long ones dropped."""
    import grain
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    template, _ = rl_prompt_format()
    rows = [r for f in files
            for r in pq.read_table(f, columns=["question", "answer"]).to_pylist()]
    picked = []
    for row in grain.MapDataset.source(rows).shuffle(seed=seed):
        messages = [{"role": "user", "content": template.replace("{question}", row["question"])}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if len(tokenizer.tokenize(text)) <= settings["max_prefill_predict_length"]:
            picked.append({"prompt": messages, "answer": row["answer"].rpartition("####")[2].strip()})
        if len(picked) == count:
            break
    return picked


def make_spec(s: dict, model: Path, data: tuple[list[Path], list[Path]], seed: int, steps: int | None = None,
              eval_samples: int = 8, threads: int = 1) -> dict:
    """Everything trl_reference.py needs: MaxText's settings `s` (maxtext_settings), the HF model directory
    (its tokenizer builds the prompts) and the (train, test) parquet files."""
    steps = s["num_batches"] if steps is None else steps
    eval_batch = s["eval_batch_size"] if s.get("eval_batch_size", -1) > 0 else s["batch_size"]
    return {
        "model": str(model), "seed": seed, "threads": threads,
        "tokens": {k: s[k] for k in TOKEN_KEYS}, "weights": {k: float(s[k]) for k in REWARD_KEYS},
        "max_completion_length": s["max_target_length"] - s["max_prefill_predict_length"],
        "train_prompts": prompts(data[0], model, steps * s["batch_size"], s, seed),
        "eval_prompts": prompts(data[1], model, s["num_test_batches"] * eval_batch, s, seed),
        "grpo": {"steps": steps, "prompts_per_step": s["batch_size"], "num_generations": s["rl"]["num_generations"],
                 "temperature": s["decode_sampling_temperature"], "top_k": s["decode_sampling_top_k"],
                 "top_p": s["decode_sampling_nucleus_p"], "beta": s["rl"]["grpo_beta"], "epsilon": s["rl"]["grpo_epsilon"],
                 "learning_rate": s["learning_rate"], "warmup_steps": int(s["warmup_steps_fraction"] * steps),
                 "adam_b1": s["adam_b1"], "adam_b2": s["adam_b2"], "adam_eps": s["adam_eps"],
                 "weight_decay": s["adam_weight_decay"], "max_grad_norm": s["gradient_clipping_threshold"]},
        "eval": {"samples_per_prompt": eval_samples, "batch_size": eval_batch, "temperature": s["decode_sampling_temperature"],
                 "top_k": s["decode_sampling_top_k"], "top_p": s["decode_sampling_nucleus_p"]},
    }


def print_table(result: dict, spec: dict, seconds: float) -> None:
    g, before, after = spec["grpo"], result["before"], result["after"]
    print(f"\nTRL GRPO reference ({', '.join(f'{k} {v}' for k, v in result['versions'].items())}), seed {spec['seed']}: "
          f"{g['steps']} steps x {g['prompts_per_step']} prompts x {g['num_generations']} completions, lr {g['learning_rate']}, "
          f"beta {g['beta']}, T {g['temperature']}; {seconds / 60:.1f} min in all (training {result['train_seconds'] / 60:.1f})")
    print("| held-out eval | before | after |\n| --- | --- | --- |")
    for key, label, unit in (("greedy_accuracy", "greedy accuracy", "%"), ("sampled_pass_at_1", "pass@1 under sampling", "%"),
                             ("sampled_format", "format under sampling", "%"),
                             ("sampled_mean_reward", "reward per sampled completion", "")):
        print(f"| {label} | {before[key]:.3f}{unit} | {after[key]:.3f}{unit} |")
    print(f"eval: {before['prompts']} held-out prompts, greedy + {before['samples_per_prompt']} samples each")
    print("reward per step: " + " ".join(f"{row['reward']:.3f}" for row in result["curve"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, required=True, help="project copy whose RL branch ran train_sft@rl")
    parser.add_argument("--seed", type=int, default=None, help="data_shuffle_seed (default: train_rl's)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: train_rl's num_batches; 0: eval only)")
    parser.add_argument("--model", type=Path, default=None,
                        help="a Hugging Face directory to start from instead of the exported warm-up (with --steps 0: "
                             "evaluate MaxText's GRPO result, artifacts/rl/hf, as the reference evaluates its own)")
    parser.add_argument("--eval-samples", type=int, default=8, help="sampled completions per held-out prompt")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", type=Path, default=PROJECT / "work" / "grpo_trl", help="export, spec and result")
    args = parser.parse_args()
    start = time.monotonic()
    spec, result = reference(args.repo, args.out, args.seed, args.steps, args.model, args.eval_samples, args.threads)
    print_table(result, spec, time.monotonic() - start)


def reference(repo: Path, out: Path, seed: int | None = None, steps: int | None = None, model: Path | None = None,
              eval_samples: int = 8, threads: int = 1) -> tuple[dict, dict]:
    """TRL's GRPO from `model` (default: the copy's exported warm-up) with train_rl's settings, `steps` of it
    (0: the eval alone); the spec and the result (trl_reference.py's OUT.json)."""
    repo = repo.resolve()
    if not (repo / "artifacts/rl/warmup/model_params").is_dir():
        raise SystemExit(f"{repo}/artifacts/rl/warmup/model_params is missing: run `dvc repro train_sft@rl` there first")
    out.mkdir(parents=True, exist_ok=True)
    stage = yaml.safe_load((repo / "views" / "rl" / "train_rl.yaml").read_text())
    settings = maxtext_settings(stage["train_rl"])
    seed = settings["data_shuffle_seed"] if seed is None else seed
    files = repo / "artifacts/rl/dataset/files"
    data = (sorted(files.glob(stage["dataset"]["train_files"])), sorted(files.glob(stage["dataset"]["eval_files"])))
    model = model.resolve() if model else export_warmup(repo, out / "warmup_hf")
    spec = make_spec(settings, model, data, seed, steps, eval_samples, threads)
    return spec, run_reference(spec, out)


def run_reference(spec: dict, out: Path) -> dict:
    """trl_reference.py on `spec` in the side environment; its result."""
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    subprocess.run([str(side_env()), str(REFERENCE), str(out / "spec.json"), str(out / "result.json")], env=env, check=True)
    return json.loads((out / "result.json").read_text())


if __name__ == "__main__":
    main()
