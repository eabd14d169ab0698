"""CPU rollout backend for MaxText's GRPO trainer (`rollout_backend: cpu_jax`).

`maxtext.trainers.post_train.rl.train_rl` imports vLLM and tpu-inference when it is imported and
hands every rollout to `MaxTextVllmRollout`. Neither runs on a CPU (nor on one NVIDIA GPU with the
`cuda12` extra). `install()` puts two stand-in modules into `sys.modules` BEFORE train_rl is
imported, and changes nothing else:

* `maxtext.integration.vllm.maxtext_vllm_adapter` with a no-op `register()`;
* `maxtext.integration.vllm.maxtext_vllm_rollout` whose `MaxTextVllmRollout` is `CpuJaxRollout`,
  a tunix `BaseRollout` that samples with the MaxText actor model itself, in JAX.

The rest of MaxText and tunix (config, model load, data, rewards, GrpoLearner, eval, checkpoints)
runs unmodified. `run_train_rl(argv)` is the entry point: it installs the backend, runs train_rl's
`main`, and leaves with `os._exit` because the math-verify process pool hangs interpreter shutdown.

Sampling follows what tunix and vLLM hand back to the GRPO learner: prompts are tokenized like
tunix (BOS prepended, then deduplicated), left-padded with the pad id to at least the config's
`max_prompt_length` (never truncated); completions are sampled with temperature / top-k / top-p,
stop at the first EOS, and are returned unpadded WITH that EOS (as vLLM returns them). The pad token
is never sampled (when it differs from EOS), because the trainer treats every pad id as padding.
Each step runs the full forward over a fixed-size buffer, with the same positions and segment ids
the trainer uses for its log-probs, so the sampler's and the trainer's distributions agree.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import time
import traceback
import types
from typing import Any, NoReturn, Optional, Sequence, Tuple

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from tunix.generate import tokenizer_adapter
from tunix.rl import common
from tunix.rl.rollout import base_rollout

PARENT_PACKAGE = "maxtext.integration.vllm"
ROLLOUT_MODULE = "maxtext.integration.vllm.maxtext_vllm_rollout"
ADAPTER_MODULE = "maxtext.integration.vllm.maxtext_vllm_adapter"
TRAIN_RL_MODULE = "maxtext.trainers.post_train.rl.train_rl"


def check_backend(backend: str) -> None:
  """Fails early, naming `rollout_backend` and the fix, if `backend` cannot run here."""
  if backend == "cpu_jax":
    return
  if backend != "vllm":
    raise ValueError(f"rollout_backend={backend!r} is unknown: use 'vllm' (TPU) or 'cpu_jax' (CPU/GPU).")
  import importlib.util  # pylint: disable=import-outside-toplevel

  missing = [m for m in ("vllm", "tpu_inference") if importlib.util.find_spec(m) is None]
  if missing:
    raise RuntimeError(
      f"rollout_backend=vllm needs {' and '.join(missing)}, which is not installed here "
      "(vLLM/tpu-inference run on TPU VMs only; install them with MaxText's "
      "`install_tpu_post_train_extra_deps`). On CPU or GPU set `rollout_backend: cpu_jax`."
    )


def _sample_next(logits, key, temperature: float, top_k: Optional[int], top_p: Optional[float]):
  """Picks one token per row from `logits` [B, V]; returns (tokens [B], logprobs [B]).

  Greedy (argmax) when temperature <= 0 or top_k == 1. Otherwise temperature, then top-k, then
  top-p (nucleus) filtering, then a categorical draw. The logprob is taken under the distribution
  the token was drawn from (vLLM's "processed_logprobs").
  """
  logits = logits.astype(jnp.float32)
  if temperature <= 0 or top_k == 1:
    tokens = jnp.argmax(logits, axis=-1)
    logprobs = jnp.zeros(tokens.shape, jnp.float32)
    return tokens, logprobs
  logits = logits / temperature
  if top_k is not None and 0 < top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p is not None and top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    # keep the smallest prefix whose mass reaches top_p (always at least one token)
    cutoff_idx = jnp.sum(cum < top_p, axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  tokens = jax.random.categorical(key, logits, axis=-1)
  logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
  return tokens, logprobs


def _decode_step(graphdef, state, buffer, step, key, *, temperature, top_k, top_p, pad_id, forbid_pad):
  """One full-forward decode step: samples the token at position `step` of `buffer` [B, T].

  Positions and (inside the adapter) segment ids come from `buffer != pad_id`, exactly as the
  trainer builds them for its log-probs; causality makes the pads after `step` irrelevant.
  """
  model = nnx.merge(graphdef, state)
  positions = common.build_positions_from_mask(buffer != pad_id)
  logits, _ = model(buffer, positions=positions, cache=None, attention_mask=None)
  last = jax.lax.dynamic_index_in_dim(logits, step - 1, axis=1, keepdims=False)
  if forbid_pad:
    last = last.at[:, pad_id].set(-jnp.inf)
  return _sample_next(last, key, temperature, top_k, top_p)


class CpuJaxRollout(base_rollout.BaseRollout):
  """Samples with the MaxText actor (a `TunixMaxTextAdapter`) in JAX; see the module docstring."""

  def __init__(
      self,
      rollout_actor: Any,
      tokenizer: Any,
      mesh: Any,
      rollout_config: base_rollout.RolloutConfig,
      maxtext_config: Any = None,
      cache_config_or_size: Any = None,
  ):  # pylint: disable=super-init-not-called,too-many-positional-arguments
    del cache_config_or_size
    self._model = rollout_actor
    self._tokenizer = tokenizer_adapter.TokenizerAdapter(tokenizer)
    self.mesh = mesh
    self._axis_rules = getattr(maxtext_config, "logical_axis_rules", None)
    # train_rl's eval builds a RolloutConfig without max_prompt_length (default 64): pad to
    # the trainer's prompt length too, so eval shapes equal train shapes and nothing is cut.
    self._min_prompt_length = int(getattr(maxtext_config, "max_prefill_predict_length", 0) or 0)
    self._train_temperature = rollout_config.temperature
    self._calls = 0
    self._step_fns: dict[tuple, Any] = {}
    self.last_generate_seconds = 0.0

  # -- tunix interface -------------------------------------------------------------------
  def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig, **kwargs):
    """Samples one completion per prompt string."""
    del kwargs
    start = time.perf_counter()
    prompt_ids = [self._tokenize(p) for p in prompts]
    prompt_len = max(rollout_config.max_prompt_length, self._min_prompt_length, max(len(p) for p in prompt_ids))
    padded = np.stack([_left_pad(p, prompt_len, self.pad_id()) for p in prompt_ids])
    eos_ids = list(rollout_config.eos_tokens or [self.eos_id()])
    seed = rollout_config.seed
    if seed is None:
      seed = self._calls
    key = jax.random.PRNGKey(seed) if isinstance(seed, int) else seed
    self._calls += 1
    with self._context():
      tokens, logprobs = self.sample(
        padded,
        rollout_config.max_tokens_to_generate,
        eos_ids,
        key,
        temperature=rollout_config.temperature,
        top_k=rollout_config.top_k,
        top_p=rollout_config.top_p,
      )
    self.last_generate_seconds = time.perf_counter() - start
    logging.info(
        "cpu_jax rollout: %d prompts, prompt length %d, %d new tokens max, %.2f s",
        len(prompts), prompt_len, rollout_config.max_tokens_to_generate, self.last_generate_seconds,
    )
    return base_rollout.RolloutOutput(
        text=[self._tokenizer.decode(t.tolist()) for t in tokens],
        logits=None,
        tokens=tokens,
        left_padded_prompt_tokens=padded,
        logprobs=logprobs if rollout_config.return_logprobs else None,
    )

  def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array) -> jax.Array:
    graphdef, state = nnx.split(self._model)
    with self._context():
      return common.compute_per_token_logps(
        graphdef,
        state,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        pad_id=self.pad_id(),
        eos_id=self.eos_id(),
        stop_gradient=True,
        return_logits=False,
        temperature=self._train_temperature,
      )

  def update_params(self, params: Any, filter_types: Optional[Tuple[Any, ...]] = None) -> None:
    del filter_types
    nnx.update(self._model, params)

  def pad_id(self) -> int:
    return self._tokenizer.pad_id()

  def eos_id(self) -> int:
    return self._tokenizer.eos_id()

  def model(self) -> Any:
    return self._model

  # -- sampling ----------------------------------------------------------------------------
  def sample(
      self,
      padded_prompts: np.ndarray,
      max_new_tokens: int,
      eos_ids: Sequence[int],
      key: jax.Array,
      *,
      temperature: float,
      top_k: Optional[int],
      top_p: Optional[float],
  ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Decodes from left-padded prompts [B, P]; returns per row the tokens up to and including
    the first EOS, and their logprobs."""
    batch, prompt_len = padded_prompts.shape
    pad = self.pad_id()
    forbid_pad = pad not in eos_ids
    buffer = np.full((batch, prompt_len + max_new_tokens), pad, np.int32)
    buffer[:, :prompt_len] = padded_prompts
    buffer = jnp.asarray(buffer)
    graphdef, state = nnx.split(self._model)
    step_fn = self._step_fn(graphdef, float(temperature), top_k, top_p, pad, forbid_pad)
    done = np.zeros(batch, bool)
    out = np.full((batch, max_new_tokens), pad, np.int32)
    out_logprobs = np.zeros((batch, max_new_tokens), np.float32)
    eos = np.asarray(eos_ids)
    for i in range(max_new_tokens):
      key, sub = jax.random.split(key)
      step = prompt_len + i
      tok, lp = step_fn(state, buffer, step, sub)
      tok = np.where(done, pad, np.asarray(tok))
      out[:, i] = tok
      out_logprobs[:, i] = np.asarray(lp)
      buffer = buffer.at[:, step].set(tok)
      done |= np.isin(tok, eos)
      if done.all():
        break
    return _trim(out, out_logprobs, eos)

  # -- helpers -----------------------------------------------------------------------------
  def _step_fn(self, graphdef: Any, temperature: float, top_k, top_p, pad: int, forbid_pad: bool):
    """The jitted decode step for these settings (MaxText's graphdef holds an unhashable config,
    so it is closed over rather than passed as a static argument)."""
    key = (temperature, top_k, top_p, pad, forbid_pad)
    if key not in self._step_fns:
      self._step_fns[key] = jax.jit(
          functools.partial(
              _decode_step, graphdef, temperature=temperature, top_k=top_k, top_p=top_p, pad_id=pad,
              forbid_pad=forbid_pad,
          )
      )
    return self._step_fns[key]

  def _tokenize(self, text: str) -> list[int]:
    ids = self._tokenizer.encode(text)
    bos = [self._tokenizer.bos_id()] if self._tokenizer.bos_id() is not None else []
    return self._tokenizer.dedup_bos_ids(bos + list(ids))

  def _context(self):
    import contextlib  # pylint: disable=import-outside-toplevel

    stack = contextlib.ExitStack()
    if self.mesh is not None:
      stack.enter_context(self.mesh)
    if self._axis_rules is not None:
      stack.enter_context(nn_partitioning.axis_rules(self._axis_rules))
    return stack



def _left_pad(ids: Sequence[int], length: int, pad: int) -> np.ndarray:
  out = np.full(length, pad, np.int32)
  out[length - len(ids):] = ids
  return out


def _trim(tokens: np.ndarray, logprobs: np.ndarray, eos: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Cuts each row after its first EOS (kept), or at the full length."""
  rows, lps = [], []
  for t, lp in zip(tokens, logprobs):
    hits = np.flatnonzero(np.isin(t, eos))
    end = hits[0] + 1 if hits.size else len(t)
    rows.append(t[:end].copy())
    lps.append(lp[:end].copy())
  return rows, lps


def install() -> None:
  """Registers the stand-in modules; call before importing train_rl."""
  adapter = types.ModuleType(ADAPTER_MODULE)
  adapter.__doc__ = "mtpipe stand-in: vLLM model registration is not needed by the cpu_jax rollout."
  adapter.register = lambda config=None: None
  rollout = types.ModuleType(ROLLOUT_MODULE)
  rollout.__doc__ = "mtpipe stand-in: MaxTextVllmRollout is mtpipe.rollout_cpu.CpuJaxRollout."
  rollout.MaxTextVllmRollout = CpuJaxRollout
  parent = importlib.import_module(PARENT_PACKAGE)  # its __init__ imports nothing from vLLM
  for name, module in ((ADAPTER_MODULE, adapter), (ROLLOUT_MODULE, rollout)):
    sys.modules[name] = module
    setattr(parent, name.rsplit(".", 1)[1], module)  # `import a.b.c as x` reads the attribute


def run_train_rl(argv: Sequence[str]) -> NoReturn:
  """Runs MaxText's train_rl with the cpu_jax backend and exits the process with its status.

  `argv` are train_rl's arguments (optional rl.yml path, then key=value pairs). The process ends
  with `os._exit` after train_rl's `main` has returned (its checkpoints are written synchronously
  by then): a normal interpreter exit hangs once the math-verify process pool has been used.
  """
  install()
  import multiprocessing.pool  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  from absl import app  # pylint: disable=import-outside-toplevel

  train_rl = importlib.import_module(TRAIN_RL_MODULE)
  code = 0
  try:
    app.run(train_rl.main, argv=[train_rl.__file__, *argv])
  except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    code = 1
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access


if __name__ == "__main__":
  run_train_rl(sys.argv[1:])
