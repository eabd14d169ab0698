"""Plan the runs for the lent TPU chip: this project's own MaxText commands, built here by
mtpipe.maxtext.training_commands from the stages' views, with their inputs copied into .tpu-chip/.

    python benchmarks/on_tpu/plan.py [--smoke]      # on the laptop, after `dvc repro to_maxtext@sft to_maxtext@rl`

Writes .tpu-chip/plan.json: groups of runs, each a launcher, a MaxText module, its arguments and its
environment, with the paths as ``@CHIP@/...`` (the carried .tpu-chip folder) and ``@RUNS@/...`` (run
directories on the chip), which benchmarks/on_tpu/chip_run.py fills in there. The chip's Python 3.11
cannot import the stage modules (Python 3.12 syntax), so the commands are built here.

Groups (each fits one call of the chip, 10 minutes):
* ``sft`` and ``rl``: the embedded default's trainings, as `dvc repro` runs them: train_sft@sft twice
  (is the chip bitwise repeatable?); train_sft@rl (GRPO's warm-up), then train_rl@rl from its last
  checkpoint.
* ``slices*``: the SFT tutorial's train_sft (its sequence length, dtypes and remat policy) for both
  tutorial families at real width (Gemma 3 4B, Llama 3.1 8B), the decoder depth and the vocabulary cut
  to fit one v5e chip, at batch 1-4 (:data:`SLICE_GROUPS`), and MaxText's pre-training trainer once;
* ``own_*``: the slices whose peaks a shared process measured after another slice (``TOGETHER``), each in
  a process of its own: does a shared process move a peak? ``again_*``: slices measured alone before,
  alone again: does a process repeat its peak?
* ``grpo*``: the GRPO tutorial's train_rl with the JAX rollout, Llama 3.1 8B at real width cut likewise
  (:data:`GRPO_GROUPS`).
* ``rehearsal``: the trainings `doit vm_run --rehearse` sends to its one-chip VM
  (mtpipe.cloud.lifecycle.rehearsal.training_sets), on the one-v5e-chip preset conf/hardware/v5e-1.yaml. tests/planning/test_on_tpu.py compares each record with preflight's forecast for
  topology v5e-1 (:func:`slice_forecast`), fit on the other records.

``--smoke``: the same commands with a few steps each, for a rehearsal on the CPU (docs/tpu-chip.md);
``--no-embedded``: without the ``sft`` and ``rl`` groups (no converted checkpoints needed).
What differs from the stages' commands on the chip is :func:`on_chip`, and only that.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtpipe.cloud.lifecycle import rehearsal  # noqa: E402
from mtpipe.maxtext import commands, training_commands  # noqa: E402
from mtpipe.planning import aot  # noqa: E402
from mtpipe.pipeline import overrides  # noqa: E402
from mtpipe.pipeline.config import stage_view  # noqa: E402
from mtpipe.pipeline.view import View  # noqa: E402
from mtpipe.pipeline.maxtext_check import compose_checked  # noqa: E402
from mtpipe.pipeline.stage import ROOT, artifact  # noqa: E402
from stages.train_sft import chat_files  # noqa: E402

CHIP = ROOT / ".tpu-chip"
PLAN = CHIP / "plan.json"
RUNS = Path("/mtpipe-chip-runs")  # stands for @RUNS@
SFT_TUTORIAL = "gemma3-4b-ultrachat-v6e8"
FAMILIES = {"gemma3": "gemma3-4b", "llama3.1": "llama3.1-8b-Instruct"}  # MaxText's model, at its real width


@dataclass(frozen=True)
class Slice:
    """A tutorial model cut in depth and vocabulary to fit one v5e chip, at its real width and the SFT
    tutorial's sequence length, dtypes and remat policy."""

    name: str
    family: str               # a key of FAMILIES
    layers: int
    vocab: int
    batch: int = 1            # per_device_batch_size (sequences of 2048 tokens)
    module: str = commands.TRAIN_SFT

    def planned(self) -> dict[str, Any]:
        """What a planned run and its record say about the slice."""
        return {"family": self.family, "layers": self.layers, "vocab": self.vocab, "batch": self.batch}


# Groups of slices. Two depths separate the cost of a layer from the rest, two vocabularies the
# embedding's, batches 1-4 the tokens per step; the pre-training trainer is what preflight compiles.
# A group marked TOGETHER runs in one process, each slice after the other, in ascending order of
# both parts of its peak HBM (peak in use, peak reserved): memory_stats() keeps one peak per process.
SLICE_GROUPS = {
    "slices": (Slice("sft_d6", "gemma3", 6, 32768), Slice("sft_d3", "gemma3", 3, 32768)),
    "slices_more": (Slice("sft_d3_v64k", "gemma3", 3, 65536),
                    Slice("pretrain_d6", "gemma3", 6, 32768, module="maxtext.trainers.pre_train.train")),
    "slices_gemma": (Slice("gemma_d2_b2", "gemma3", 2, 32768, 2), Slice("gemma_d3_b4", "gemma3", 3, 32768, 4),
                     Slice("gemma_d4_v48k_b4", "gemma3", 4, 49152, 4)),
    "slices_llama": (Slice("llama_d1_v16k_b1", "llama3.1", 1, 16384, 1),),
    "slices_llama_more": (Slice("llama_d1_v24k_b2", "llama3.1", 1, 24576, 2), Slice("llama_d1_b4", "llama3.1", 1, 32768, 4)),
    "slices_gemma_scanned": (Slice("gemma_d6_v16k_b2", "gemma3", 6, 16384, 2),),  # one scanned 6-layer block
    "slices_depths": (Slice("gemma_d4_v32k_b1", "gemma3", 4, 32768, 1), Slice("llama_d2_v16k_b1", "llama3.1", 2, 16384, 1)),
    "slices_scanned_b1": (Slice("gemma_d6_v16k_b1", "gemma3", 6, 16384, 1),),
    "slices_scanned_v32k": (Slice("gemma_d6_v32k_b2", "gemma3", 6, 32768, 2),),
    "slices_llama_deep": (Slice("llama_d2_v8k_b1", "llama3.1", 2, 8192, 1), Slice("llama_d3_v4k_b1", "llama3.1", 3, 4096, 1)),
}
SLICES = tuple(s for group in SLICE_GROUPS.values() for s in group)
TOGETHER = ("slices_gemma", "slices_llama", "slices_llama_more", "slices_depths", "slices_llama_deep")
# Every slice a TOGETHER process measured after another, again in a process of its own (records/own_*.json)
OWN_GROUPS = {"own_a": ("gemma_d3_b4", "gemma_d4_v48k_b4", "llama_d2_v16k_b1"), "own_b": ("llama_d3_v4k_b1", "llama_d1_b4")}
# The two slices whose peak is the low kind (docs/step-time.md), again in a process of their own:
# does a process of its own repeat its peak? (records/again_*.json)
AGAIN_GROUPS = {"again_d6": ("gemma_d6_v16k_b1", "gemma_d6_v16k_b2")}
SLICE_GROUPS |= {group: tuple(s for s in SLICES if s.name in names)
                 for group, names in (OWN_GROUPS | AGAIN_GROUPS).items()}
REHEARSAL_HARDWARE = "v5e-1"   # the lent chip's one-chip preset
SLICE_STEPS = 20
SPLASH_BLOCK = 128  # JAX 0.10.2's splash-attention kernel needs sequence lengths in multiples of this


def committed_view(branch: str, stage: str, sets: tuple[str, ...] = ()) -> View:
    """The view ``stage`` reads, composed from HEAD's params.yaml (+ ``sets``) as configure writes it."""
    params = overrides.apply_sets(overrides.committed_params(ROOT), list(sets))
    return stage_view(compose_checked(branch, params), stage)


def on_chip(cmd: commands.MaxTextCommand) -> dict[str, Any]:
    """The command as the chip runs it: the TPU instead of the CPU (no JAX_PLATFORMS=cpu, no
    hardware=cpu), one process with no coordinator (the chip's machine refuses sockets) and, for a
    sequence length the chip's splash kernel refuses, dot-product attention."""
    args = [a for a in cmd.args if a != "hardware=cpu"]
    if not any(a.startswith("skip_jax_distributed_system=") for a in args):
        args.append("skip_jax_distributed_system=True")
    length = next((int(a.split("=", 1)[1]) for a in args if a.startswith("max_target_length=")), None)
    if length and length % SPLASH_BLOCK:
        args.append("attention=dot_product")
    env = {k: v for k, v in cmd.env.items() if k != "JAX_PLATFORMS"}
    return {"launcher": cmd.launcher, "module": cmd.module, "args": args, "env": env}


def chip_path(path: Path | str) -> str:
    """A local path under .tpu-chip or RUNS as the chip's placeholder."""
    return str(path).replace(str(CHIP), "@CHIP@").replace(str(RUNS), "@RUNS@")


def placeholders(run: dict[str, Any]) -> dict[str, Any]:
    """``run`` with its arguments' local paths as the chip's placeholders."""
    return run | {"args": [chip_path(a) for a in run["args"]]}


def copy_inputs(branch: str, names: tuple[str, ...] = ("maxtext", "dataset", "model")) -> Path:
    """The branch's converted checkpoint, dataset and tokenizer (``names``) under .tpu-chip/artifacts."""
    dest = CHIP / "artifacts" / branch
    for name in names:
        if (dest / name).exists():
            shutil.rmtree(dest / name)
        shutil.copytree(artifact(branch, name), dest / name)
    return dest


def set_arg(args: list[str], key: str, value: Any) -> list[str]:
    """``args`` with ``key=value`` in place of an existing ``key=``, or appended."""
    new = f"{key}={commands.fmt(value)}"
    if any(a.startswith(f"{key}=") for a in args):
        return [new if a.startswith(f"{key}=") else a for a in args]
    return [*args, new]


def training_runs(sets: tuple[str, ...], sft_names: tuple[str, ...], warmup: str, grpo: str) -> list[dict[str, Any]]:
    """train_sft@sft (once per name), train_sft@rl (the warm-up ``warmup``), train_rl@rl from its last
    checkpoint: the stages' views of HEAD's params with ``sets``, the inputs copied."""
    runs = []
    sft_in = copy_inputs("sft")
    cfg = committed_view("sft", "train_sft", sets)
    train, evals, columns = chat_files(cfg, sft_in / "dataset", CHIP / "artifacts" / "sft")
    for name in sft_names:
        cmd = training_commands.train_sft(
            cfg, ckpt=sft_in / "maxtext" / "0" / "items", train_files=train, eval_files=evals, columns=columns,
            tokenizer_dir=sft_in / "model" / "files", base_output=RUNS, run_name=name,
            metrics_file=RUNS / name / "metrics.jsonl", jax_cache_dir=RUNS / "jax_cache")
        runs.append(on_chip(cmd) | {"name": name, "stage": "train_sft@sft", "steps": cfg.train_sft.steps})
    rl_in = copy_inputs("rl")
    cfg = committed_view("rl", "train_sft", sets)
    train, evals, columns = chat_files(cfg, rl_in / "dataset", rl_in)
    cmd = training_commands.train_sft(
        cfg, ckpt=rl_in / "maxtext" / "0" / "items", train_files=train, eval_files=evals, columns=columns,
        tokenizer_dir=rl_in / "model" / "files", base_output=RUNS, run_name=warmup,
        metrics_file=RUNS / warmup / "metrics.jsonl", jax_cache_dir=RUNS / "jax_cache")
    runs.append(on_chip(cmd) | {"name": warmup, "stage": "train_sft@rl", "steps": cfg.train_sft.steps})
    cfg = committed_view("rl", "train_rl", sets)
    files = rl_in / "dataset" / "files"
    cmd = training_commands.train_rl(
        cfg, ckpt=Path("@START@"), train_files=str(files / cfg.dataset.train_files),
        eval_files=str(files / cfg.dataset.eval_files), tokenizer_dir=rl_in / "model" / "files", base_output=RUNS,
        run_name=grpo, jax_cache_dir=RUNS / "jax_cache")
    runs.append(on_chip(cmd) | {"name": grpo, "stage": "train_rl@rl", "steps": cfg.train_rl.num_batches,
                                "start_from": warmup})
    return runs


def embedded_runs(smoke: bool) -> list[dict[str, Any]]:
    """The embedded default as `dvc repro` trains it: train_sft@sft twice, the warm-up, GRPO."""
    runs = training_runs((), ("sft_a", "sft_b"), "rl_warmup", "rl_grpo")
    return [placeholders(smoke_run(r) if smoke else r) for r in runs]


def rehearsal_runs() -> list[dict[str, Any]]:
    """The rehearsal's trainings on the lent chip's one-chip preset (already a few steps: no --smoke cut)."""
    sets = tuple(rehearsal.training_sets(ROOT, REHEARSAL_HARDWARE))
    return [placeholders(r | {"sets": list(sets)})
            for r in training_runs(sets, ("rehearsal_sft",), "rehearsal_warmup", "rehearsal_grpo")]


def smoke_run(run: dict[str, Any]) -> dict[str, Any]:
    """A few steps of the same command (a CPU rehearsal of the harness, not a measurement)."""
    args = run["args"]
    if run["module"] == commands.TRAIN_RL:
        for key, value in (("num_batches", 2), ("num_test_batches", 1), ("num_eval_passes", 1)):
            args = set_arg(args, key, value)
    else:
        for key, value in (("steps", 3), ("checkpoint_period", 2), ("eval_steps", 1)):
            args = set_arg(args, key, value)
        if "eval_interval=0" not in args:
            args = set_arg(args, "eval_interval", 2)
    return run | {"args": args, "steps": 2 if run["module"] == commands.TRAIN_RL else 3}


def slice_command(cut: Slice, smoke: bool) -> commands.MaxTextCommand:
    """The SFT tutorial's training command (preflight's, placeholder paths) for ``cut``: its family's
    model at real width, cut to its layers and vocabulary, at its batch."""
    cmd = aot.stage_command(committed_view("sft", "train_sft", (f"sft.preset={SFT_TUTORIAL}",)))
    args = [a for a in cmd.args if not a.startswith(("load_parameters_path=", "profiler=", "checkpoint_period=",
                                                      "max_num_checkpoints_to_keep="))]
    args = set_arg(set_arg(args, "model_name", FAMILIES[cut.family]), "per_device_batch_size", cut.batch)
    changes = {"override_model_config": True, "base_num_decoder_layers": cut.layers, "vocab_size": cut.vocab,
               "steps": 3 if smoke else SLICE_STEPS, "enable_checkpointing": False}
    if cut.module != commands.TRAIN_SFT:  # the pre-training trainer: the same model and batch, synthetic data
        args = [a for a in args if not a.startswith(("hf_path=", "train_split=", "train_data_columns=", "hf_train_files=",
                                                      "tokenizer_path="))]
        changes["dataset_type"] = "synthetic"
    for key, value in changes.items():
        args = set_arg(args, key, value)
    if smoke:
        args = set_arg(set_arg(set_arg(args, "base_emb_dim", 256), "base_mlp_dim", 512), "max_target_length", 128)
    return commands.MaxTextCommand(cut.module, args, env={"DECOUPLE_GCLOUD": "TRUE"}, launcher=cmd.launcher)


def chip_args(cmd: commands.MaxTextCommand, paths: dict[str, str]) -> list[str]:
    """``cmd``'s arguments with each placeholder path replaced by ``paths[key]``."""
    args = []
    for arg in cmd.args:
        key, _, value = arg.partition("=")
        args.append(f"{key}={paths[key] if value.startswith(training_commands.PLACEHOLDER) else value}")
    return args


def slice_runs(group: str, smoke: bool) -> list[dict[str, Any]]:
    """The calibration slices of ``group``, their data the embedded UltraChat twin and its tokenizer
    (ids < 512: any vocabulary holds them; an SFT step's cost does not depend on the token values)."""
    sft_in = CHIP / "artifacts" / "sft"
    runs = []
    for cut in SLICE_GROUPS[group]:
        cmd = slice_command(cut, smoke)
        args = chip_args(cmd, {
            "run_name": cut.name, "base_output_directory": str(RUNS), "metrics_file": str(RUNS / cut.name / "metrics.jsonl"),
            "hf_train_files": str(sft_in / "dataset" / "files" / "data" / "train_sft-*.parquet"),
            "tokenizer_path": str(sft_in / "model" / "files"), "jax_cache_dir": str(RUNS / "jax_cache")})
        run = on_chip(commands.MaxTextCommand(cut.module, args, cmd.env, launcher=cmd.launcher))
        runs.append(placeholders(run | {"name": cut.name, "stage": f"slice of {SFT_TUTORIAL}", "steps": SLICE_STEPS}
                                 | cut.planned()))
    return runs


@dataclass(frozen=True)
class GrpoCut:
    """The GRPO tutorial's train_rl (Llama 3.1 8B Instruct at real width) cut to fit one v5e chip, with
    the project's JAX rollout (rollout_backend cpu_jax) on the chip: ``batch`` prompts x ``generations``
    completions of up to ``new_tokens`` tokens after a ``prompt``-token prompt buffer."""

    name: str
    layers: int
    vocab: int
    batch: int
    generations: int
    new_tokens: int
    prompt: int = 160  # the embedded GSM8K twin's prompts are <= 139 tokens in train_rl's template

    def planned(self) -> dict[str, Any]:
        return {"family": "llama3.1", "layers": self.layers, "vocab": self.vocab, "batch": self.batch,
                "generations": self.generations, "new_tokens": self.new_tokens, "prompt": self.prompt}


GRPO_TUTORIAL = "llama3.1-8b-gsm8k-v6e8"
GRPO_GROUPS = {"grpo": (GrpoCut("grpo_d1_b1x4_n64", 1, 16384, 1, 4, 64), GrpoCut("grpo_d1_b2x4_n128", 1, 16384, 2, 4, 128),
                         GrpoCut("grpo_d2_b1x4_n64", 2, 16384, 1, 4, 64)),
               "grpo_more": (GrpoCut("grpo_d2_b2x4_n64", 2, 16384, 2, 4, 64),)}
GRPO_STEPS = 8


def grpo_command(cut: GrpoCut, smoke: bool) -> commands.MaxTextCommand:
    """The GRPO tutorial's train_rl command (placeholder paths) with the JAX rollout, cut to ``cut``,
    from randomly initialised weights (no checkpoint: a step's cost does not depend on the values),
    without evals (num_test_batches 0)."""
    sets = (f"rl.preset={GRPO_TUTORIAL}", "rl.train_rl.rollout_backend=cpu_jax")
    cmd = aot.stage_command(committed_view("rl", "train_rl", sets))
    args = [a for a in cmd.args if not a.startswith(("load_parameters_path=", "checkpoint_period=",
                                                      "max_num_checkpoints_to_keep="))]
    changes = {"chips_per_vm": 1, "rollout_tensor_parallelism": 1, "num_batches": 2 if smoke else GRPO_STEPS,
               "num_test_batches": 0, "batch_size": cut.batch, "num_generations": cut.generations,
               "max_prefill_predict_length": cut.prompt, "max_target_length": cut.prompt + cut.new_tokens,
               "override_model_config": True, "base_num_decoder_layers": cut.layers, "vocab_size": cut.vocab,
               "enable_checkpointing": False, "use_pathways": False, "convert_checkpoint_if_possible": False}
    for key, value in changes.items():
        args = set_arg(args, key, value)
    if smoke:
        args = set_arg(set_arg(args, "base_emb_dim", 256), "base_mlp_dim", 512)
    return commands.MaxTextCommand(commands.TRAIN_RL, args, env={"DECOUPLE_GCLOUD": "TRUE"}, launcher=cmd.launcher)


def grpo_runs(group: str, smoke: bool) -> list[dict[str, Any]]:
    """The GRPO cuts of ``group`` on the embedded GSM8K twin and its tokenizer (ids < 512)."""
    rl_in = CHIP / "artifacts" / "rl"
    files = rl_in / "dataset" / "files" / "main"
    runs = []
    for cut in GRPO_GROUPS[group]:
        cmd = grpo_command(cut, smoke)
        args = chip_args(cmd, {"run_name": cut.name, "base_output_directory": str(RUNS),
                               "hf_train_files": str(files / "train-*.parquet"), "hf_eval_files": str(files / "test-*.parquet"),
                               "tokenizer_path": str(rl_in / "model" / "files"), "jax_cache_dir": str(RUNS / "jax_cache")})
        run = on_chip(commands.MaxTextCommand(cmd.module, args, cmd.env, launcher=cmd.launcher))
        runs.append(placeholders(run | {"name": cut.name, "stage": f"train_rl of {GRPO_TUTORIAL}, cut",
                                        "steps": GRPO_STEPS} | cut.planned()))
    return runs


def slice_forecast(run: dict[str, Any]) -> list[str]:
    """The arguments preflight compiles for a slice on topology v5e-1 (paths left out, as preflight does)."""
    cmd = commands.MaxTextCommand(run["module"], [a for a in run["args"] if "@CHIP@" not in a and "@RUNS@" not in a],
                                  launcher=run["launcher"])
    return aot.compile_args(cmd, "v5e-1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps per run (CPU rehearsal)")
    parser.add_argument("--no-embedded", action="store_true",
                        help="leave out the sft and rl groups (they need `dvc repro to_maxtext@sft to_maxtext@rl`)")
    opts = parser.parse_args()
    smoke = opts.smoke
    CHIP.mkdir(exist_ok=True)
    groups = {}
    if not opts.no_embedded:
        embedded = embedded_runs(smoke)
        groups = {"sft": embedded[:2], "rl": embedded[2:], "rehearsal": rehearsal_runs()}
    copy_inputs("sft", ("dataset", "model"))
    copy_inputs("rl", ("dataset", "model"))
    groups |= {g: slice_runs(g, smoke) for g in SLICE_GROUPS} | {g: grpo_runs(g, smoke) for g in GRPO_GROUPS}
    plan = {"smoke": smoke, "together": list(TOGETHER), "groups": groups}
    PLAN.write_text(json.dumps(plan, indent=1) + "\n")
    for group, runs in plan["groups"].items():
        print(f"{group}: " + ", ".join(f"{r['name']} ({r['stage']}, {r['steps']} steps)" for r in runs))
    print(f"wrote {PLAN.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
