"""Where a GRPO step of the embedded default spends its time, against the time its arithmetic needs.

Runs MaxText's train_rl (through mtpipe.maxtext.launch_rl_cpu, as the train_rl stage does) on the
demo's RL branch (`embedded-rl`: the warm-up, data and tokenizer in artifacts/rl/; run
`dvc repro train_sft@rl` first) for a few steps and one eval batch before and after, in a child
process that times:

* rollout: CpuJaxRollout.generate (and per generated token);
* grading: the reward functions (tunix's RLLearner._compute_rewards: math-verify in MaxText's pool);
* ref logps / old logps: the reference and old-policy log-probabilities (RLCluster). JAX dispatches
  them asynchronously: their arithmetic runs, and is counted, in the update that waits for it;
* update: the actor's gradient step (RLCluster.update_actor);
* other: the rest of the step (Python, data loading, host-device transfers, metrics, checkpoints);
* compiles (jax.monitoring: tracing, lowering, XLA): in the first step; any compile in a later
  step is named (a defect to explain);
* eval: MaxText's eval before and after GRPO (evaluate_rl.evaluate), per eval batch.

Beside each phase, its FLOP-bound time: the phase's arithmetic (counted from the model's shapes) at
the rate this machine's JAX multiplies the model's MLP matrices, measured in the same run.

Both setups run side by side in one invocation (these machines are noisy: compare within a run):
`after` is the project as it is; `before` turns the speed-ups off in its child (turn_speedups_off).

Usage: python benchmarks/grpo_step.py [--steps 8] [--eval-batches 1] [--setups before,after]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))

# phase: (module, class, method) whose calls are timed within a GRPO step
PHASES: dict[str, tuple[str, str, str]] = {
    "rollout": ("mtpipe.maxtext.rollout_cpu", "CpuJaxRollout", "generate"),
    "grading": ("tunix.rl.rl_learner", "RLLearner", "_compute_rewards"),
    "ref logps": ("tunix.rl.rl_cluster", "RLCluster", "get_ref_per_token_logps"),
    "old logps": ("tunix.rl.rl_cluster", "RLCluster", "get_old_per_token_logps"),
    "update": ("tunix.rl.rl_cluster", "RLCluster", "update_actor"),
}
EVALUATE = "maxtext.trainers.post_train.rl.evaluate_rl"  # its `evaluate`: train_rl's eval before/after GRPO
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
SETUPS = ("before", "after")  # `before`: the speed-ups below turned off in the child


def turn_speedups_off() -> None:
    """What the project did to make a step faster, undone: the adapter's grading patch (patch 13:
    MaxText's pool polls again, every 0.1 s), the rollout's KV cache back in MaxText's axis order, the
    rollout's row keys folded row by row again."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    from mtpipe.maxtext import rollout_cpu  # pylint: disable=import-outside-toplevel
    from mtpipe.maxtext.adapter import training  # pylint: disable=import-outside-toplevel

    training.grade_without_polling = lambda: None
    rollout_cpu.CACHE_AXIS_ORDER = "1,2,0,3"

    def fold_row_by_row(base, texts, repeats, eval_pass):
        fold = jax.random.fold_in
        return jnp.stack([fold(fold(fold(base, int(t)), int(r)), int(eval_pass)) for t, r in zip(texts, repeats)])
    rollout_cpu._fold_row_keys = fold_row_by_row  # pylint: disable=protected-access


class StepClock:
    """Per GRPO step: seconds, seconds by phase, compile seconds by phase, compiled names, generated
    tokens; and the seconds of each eval. Written to `out` (JSON) as each step or eval ends."""

    def __init__(self, out: Path) -> None:
        self.out, self.lock, self.local = out, threading.Lock(), threading.local()
        self.steps: list[dict[str, Any]] = []
        self.evals: list[float] = []
        self.step_start: float | None = None
        self.current = self._fresh()

    @staticmethod
    def _fresh() -> dict[str, Any]:
        return {"phases": {}, "compile": {}, "compiled": [], "tokens": 0}

    def _add(self, table: str, key: str, seconds: float) -> None:
        with self.lock:
            self.current[table][key] = self.current[table].get(key, 0.0) + seconds

    def phase(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            outer, self.local.phase = getattr(self.local, "phase", None), name
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                self.local.phase = outer
                self._add("phases", name, time.perf_counter() - start)
            if name == "rollout":
                with self.lock:
                    self.current["tokens"] += sum(len(t) for t in result.tokens)
            return result
        return timed

    def step(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.close_step()
            self.step_start = time.perf_counter()
            return fn(*args, **kwargs)
        return timed

    def evaluation(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            with self.lock:
                self.evals.append(time.perf_counter() - start)
                self.current = self._fresh()  # what the eval did is not a step's
            self._write()
            return result
        return timed

    def close_step(self) -> None:
        """End the running step (the next one starts, or training ends)."""
        now = time.perf_counter()
        with self.lock:
            if self.step_start is not None:
                self.steps.append({"seconds": now - self.step_start, **self.current})
            self.current, self.step_start = self._fresh(), None
        self._write()

    def _write(self) -> None:
        with self.lock:
            self.out.write_text(json.dumps({"steps": self.steps, "evals": self.evals}))

    def compiled(self, event: str, seconds: float, **_: Any) -> None:
        if event in COMPILE_EVENTS:
            self._add("compile", getattr(self.local, "phase", None) or "other", seconds)


class CompileNames(logging.Handler):
    """Collects the names jax.log_compiles gives ("Compiling <name> with global shapes ...")."""

    def __init__(self, clock: StepClock) -> None:
        super().__init__(logging.WARNING)
        self.clock = clock

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Compiling "):
            with self.clock.lock:
                self.clock.current["compiled"].append(message.split()[1])


def child(out: Path, setup: str, argv: list[str]) -> None:
    """Run train_rl with the clocks on, as `setup` (never returns: launch_rl_cpu ends the process)."""
    import multiprocessing.pool  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    import jax  # pylint: disable=import-outside-toplevel

    from mtpipe.maxtext import launch_rl_cpu, rollout_cpu  # pylint: disable=import-outside-toplevel

    if setup == "before":
        turn_speedups_off()
    clock = StepClock(out)
    jax.config.update("jax_log_compiles", True)
    logging.getLogger("jax").addHandler(CompileNames(clock))
    jax.monitoring.register_event_duration_secs_listener(clock.compiled)
    rollout_cpu.install()
    for name, (module, cls, method) in PHASES.items():
        owner = getattr(importlib.import_module(module), cls)
        setattr(owner, method, clock.phase(name, getattr(owner, method)))
    learner = importlib.import_module("tunix.rl.rl_learner").RLLearner
    learner._run_global_step = clock.step(learner._run_global_step)  # pylint: disable=protected-access
    train = learner.train

    def train_then_close(self, *args, **kwargs):
        try:
            return train(self, *args, **kwargs)
        finally:
            clock.close_step()
    learner.train = train_then_close
    evaluate_rl = importlib.import_module(EVALUATE)
    evaluate_rl.evaluate = clock.evaluation(evaluate_rl.evaluate)
    launch_rl_cpu.run_train_rl(argv)


def train_rl_command(steps: int, eval_batches: int, out_dir: Path) -> tuple[list[str], dict[str, str], dict]:
    """The train_rl stage's arguments and environment for the configured RL branch, with `steps` GRPO
    steps and `eval_batches` eval batches; and the shapes the FLOP count needs."""
    from mtpipe.maxtext import training_commands  # pylint: disable=import-outside-toplevel
    from mtpipe.pipeline.view import load_stage  # pylint: disable=import-outside-toplevel
    from mtpipe.pipeline.stage import JAX_CACHE, artifact  # pylint: disable=import-outside-toplevel

    cfg = load_stage("rl", "train_rl")
    files, model = artifact("rl", "dataset") / "files", artifact("rl", "model") / "files"
    cmd = training_commands.train_rl(
        cfg, ckpt=artifact("rl", "warmup") / "model_params", train_files=str(files / cfg.dataset.train_files),
        eval_files=str(files / cfg.dataset.eval_files), tokenizer_dir=model, base_output=out_dir,
        run_name="grpo_step", jax_cache_dir=JAX_CACHE)
    set_here = {"num_batches": str(steps), "num_test_batches": str(eval_batches)}
    args = [a for a in cmd.args if a.split("=", 1)[0] not in set_here]
    given = dict(a.split("=", 1) for a in args)
    shapes = {key: int(given[key]) for key in ("base_emb_dim", "base_mlp_dim", "base_num_decoder_layers",
                                               "base_num_kv_heads", "base_num_query_heads", "head_dim",
                                               "vocab_size", "batch_size", "num_generations",
                                               "max_prefill_predict_length", "max_target_length")}
    return [*args, *(f"{k}={v}" for k, v in set_here.items())], cmd.env, shapes


def step_flops(s: dict[str, int]) -> dict[str, float]:
    """The arithmetic of one GRPO step by phase (matmuls and attention, 2 FLOP a multiply-add): the
    rollout's prefill and up to max_target - max_prefill decode steps (attention over the whole cache),
    a forward pass over [rows, max_target] for the reference log-probs, three for the update."""
    emb, mlp, hd = s["base_emb_dim"], s["base_mlp_dim"], s["head_dim"]
    q, kv, layers = s["base_num_query_heads"], s["base_num_kv_heads"], s["base_num_decoder_layers"]
    rows = s["batch_size"] * s["num_generations"]
    prompt, total = s["max_prefill_predict_length"], s["max_target_length"]
    per_token = 2 * layers * (2 * emb * q * hd + 2 * emb * kv * hd + 3 * emb * mlp) + 2 * emb * s["vocab_size"]
    attention = 4 * layers * q * hd  # per token and token of context (scores and weighted values)
    forward = rows * total * (per_token + attention * total)
    prefill = rows * prompt * (per_token + attention * prompt)
    rollout = prefill + rows * (total - prompt) * (per_token + attention * total)
    return {"rollout": rollout, "grading": 0.0, "ref logps": forward, "old logps": 0.0, "update": 3 * forward}


def matmul_rate(shapes: dict[str, int]) -> float:
    """FLOP/s of this machine's JAX (CPU) on the model's MLP matmul over a training batch's tokens."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    tokens = shapes["batch_size"] * shapes["num_generations"] * shapes["max_target_length"]
    a = jnp.ones((tokens, shapes["base_emb_dim"]), jnp.float32)
    b = jnp.ones((shapes["base_emb_dim"], shapes["base_mlp_dim"]), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / statistics.median(times)


def run_setup(setup: str, steps: int, eval_batches: int) -> dict[str, Any]:
    """One child run; its clock readings."""
    with tempfile.TemporaryDirectory(prefix=f"grpo_step-{setup}-") as tmp:
        argv, env, _ = train_rl_command(steps, eval_batches, Path(tmp) / "run")
        out = Path(tmp) / "clock.json"
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, __file__, "--child", str(out), "--setup", setup, "--", *argv],
            env={**os.environ, **env}, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not out.exists():
            sys.exit(f"{setup}: train_rl failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        print(f"  {setup}: {time.perf_counter() - started:.0f} s, start-up included", file=sys.stderr)
        return json.loads(out.read_text())


def table(runs: dict[str, dict[str, Any]], flops: dict[str, float], rate: float) -> str:
    """The budget: median seconds per step by phase (steps after the first), beside the FLOP bound."""
    setups = list(runs)
    later = {s: runs[s]["steps"][1:] for s in setups}

    def median(s: str, pick: Callable[[dict], float]) -> float:
        return statistics.median(pick(step) for step in later[s]) if later[s] else float("nan")

    head = f"{'per GRPO step (median of steps 2..)':36}" + "".join(f"{s:>10}" for s in setups) + f"{'FLOP-bound':>12}"
    lines = [head, "-" * len(head)]
    for phase in PHASES:
        cells = "".join(f"{median(s, lambda st, p=phase: st['phases'].get(p, 0.0)):>10.3f}" for s in setups)
        bound = f"{flops[phase] / rate:>12.3f}" if flops[phase] else f"{'-':>12}"
        lines.append(f"{phase + ' (s)':36}{cells}{bound}")
    other = "".join(f"{median(s, lambda st: st['seconds'] - sum(st['phases'].values())):>10.3f}" for s in setups)
    lines.append(f"{'other: Python, data, transfers (s)':36}{other}{'-':>12}")
    total = "".join(f"{median(s, lambda st: st['seconds']):>10.3f}" for s in setups)
    lines.append(f"{'step (s)':36}{total}{sum(flops.values()) / rate:>12.3f}")
    per_token = "".join(f"{median(s, lambda st: 1e3 * st['phases'].get('rollout', 0.0) / max(st['tokens'], 1)):>10.2f}"
                        for s in setups)
    lines.append(f"{'rollout per generated token (ms)':36}{per_token}")
    first = "".join(f"{runs[s]['steps'][0]['seconds']:>10.1f}" for s in setups)
    compile_first = "".join(f"{sum(runs[s]['steps'][0]['compile'].values()):>10.1f}" for s in setups)
    lines += [f"{'first step (s)':36}{first}", f"{'  of it compiling (s)':36}{compile_first}"]
    evals = "".join(f"{statistics.mean(runs[s]['evals']) if runs[s]['evals'] else float('nan'):>10.1f}" for s in setups)
    lines.append(f"{'eval, before or after GRPO (s)':36}{evals}")
    lines.append(f"\narithmetic per step: {sum(flops.values()) / 1e9:.1f} GFLOP at {rate / 1e9:.0f} GFLOP/s "
                 "(this machine's JAX on the model's MLP matmul)")
    for s in setups:
        late = [f"step {i}: {', '.join(st['compiled'])}"
                for i, st in enumerate(runs[s]["steps"][1:], 2) if st["compiled"]]
        lines.append(f"{s}: compiles after the first step: {'; '.join(late) if late else 'none'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--steps", type=int, default=8, help="GRPO steps per setup (the first compiles)")
    parser.add_argument("--eval-batches", type=int, default=1, help="eval batches before and after GRPO")
    parser.add_argument("--setups", default="before,after", help=f"comma-separated, of {', '.join(SETUPS)}")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--setup", default="after", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        child(args.child, args.setup, rest[1:] if rest[:1] == ["--"] else rest)
    _, env, shapes = train_rl_command(args.steps, args.eval_batches, Path("unused"))
    os.environ.update(env)  # this process's JAX (the matmul rate) on the CPU too
    runs = {setup: run_setup(setup, args.steps, args.eval_batches) for setup in args.setups.split(",")}
    print(table(runs, step_flops(shapes), matmul_rate(shapes)))


if __name__ == "__main__":
    main()
