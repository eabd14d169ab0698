"""CPU rollout backend for MaxText's GRPO trainer (`rollout_backend: cpu_jax`).

`maxtext.trainers.post_train.rl.train_rl` imports vLLM and tpu-inference when it is imported and
hands every rollout to `MaxTextVllmRollout`. Neither runs on a CPU (nor on one NVIDIA GPU with the
`cuda12` extra). `install()` puts two stand-in modules into `sys.modules` BEFORE train_rl is
imported, and changes nothing else:

* `maxtext.integration.vllm.maxtext_vllm_adapter` with a no-op `register()`;
* `maxtext.integration.vllm.maxtext_vllm_rollout` whose `MaxTextVllmRollout` is `CpuJaxRollout`,
  a tunix `BaseRollout` that samples with the MaxText actor model itself, in JAX.

The rest of MaxText and tunix (config, model load, data, rewards, GrpoLearner, eval, checkpoints)
runs unmodified. The child process starts in mtpipe.maxtext.launch_rl_cpu, which calls `install()`
and runs train_rl (it, not this module, is the process's __main__: see there why).

Sampling follows what tunix and vLLM hand back to the GRPO learner: prompts are tokenized like
tunix (BOS prepended, then deduplicated), left-padded with the pad id to at least the trainer's
`max_prefill_predict_length` (never truncated); completions are sampled with temperature / top-k /
top-p, stop at the first EOS, and are returned unpadded WITH that EOS (as vLLM returns them). The
pad token is never sampled (when it differs from EOS): the trainer treats every pad id as padding.
Positions and segment ids are built from `tokens != pad` exactly as the trainer builds them for its
log-probs, so the sampler's and the trainer's distributions agree.

Random numbers are paired: each row draws from its own key, made from the run's seed (MaxText's
`data_shuffle_seed`), the prompt's text, the row's repeat index among the rows with that prompt in
the call, and the call's eval pass (how many earlier calls held exactly the same prompts, modulo
MaxText's `num_eval_passes`). So the eval before GRPO and the eval after it sample each prompt with
the same random numbers (common random numbers): where the policy did not change, neither do the
samples, and the difference between the two evals measures the policy rather than the dice
(benchmarks/grpo_learns.py). A GRPO step's prompts are a batch no earlier call held, so its draws
depend on nothing before it: a resumed run draws what the uninterrupted one drew, though it never
saw the steps before its checkpoint (a prompt that recurs in training, an eval prompt trained on).

Two decoders give the same tokens (tests/maxtext/test_rollout_cpu.py): MaxText's own KV cache (prefill,
then one autoregressive step per token; the default), and a full forward over a fixed
[B, prompt + new] buffer per token (used when the cache does not fit; tests ask for it with
`kv_cache=False`). No environment variable picks one: what a stage runs is in its address.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import time
import types
import zlib
from typing import Any, Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from tunix.generate import tokenizer_adapter
from tunix.rl import common
from tunix.rl.rollout import base_rollout

PARENT_PACKAGE = "maxtext.integration.vllm"
ROLLOUT_MODULE = "maxtext.integration.vllm.maxtext_vllm_rollout"
ADAPTER_MODULE = "maxtext.integration.vllm.maxtext_vllm_adapter"
# The KV cache in attention's own axis order (batch, length, heads, head dim). MaxText's default, "1,2,0,3"
# (a TPU layout), made every decode step transpose the whole cache back: 20% of the rollout here.
CACHE_AXIS_ORDER = "0,1,2,3"

# advance(i, tokens sampled at step i-1 or None, per-row keys [B, 2]) -> (tokens [B], logprobs [B])
Advance = Callable[[int, Optional[np.ndarray], jax.Array], Tuple[jax.Array, jax.Array]]
# Every row's key folded with the token's index, [B, 2] -> [B, 2]: jitted, since an eager vmap is traced
# again at each token (0.5-1.4 s per 64-token rollout against 10-20 ms, the same keys).
_fold_rows = jax.jit(jax.vmap(jax.random.fold_in, in_axes=(0, None)))


# ----------------------------------------------------------------------------- jitted steps


def _sample_next(logits, keys, temperature: float, top_k: Optional[int], top_p: Optional[float]):
  """Picks one token per row from `logits` [B, V] with that row's key (`keys` [B, 2]); returns
  (tokens [B], logprobs [B]).

  Greedy (argmax, logprob 0) when temperature <= 0 or top_k == 1. Otherwise temperature, then
  top-k, then top-p (nucleus) filtering, then a categorical draw; the logprob is taken under the
  distribution the token was drawn from (vLLM's default "processed_logprobs").
  """
  logits = logits.astype(jnp.float32)
  if temperature <= 0 or top_k == 1:
    tokens = jnp.argmax(logits, axis=-1)
    return tokens, jnp.zeros(tokens.shape, jnp.float32)
  logits = logits / temperature
  if top_k is not None and 0 < top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p is not None and top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    cutoff_idx = jnp.sum(cum < top_p, axis=-1, keepdims=True)  # first token whose mass reaches top_p
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  tokens = jax.vmap(jax.random.categorical)(keys, logits)
  logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
  return tokens, logprobs


def _pick(last_logits, keys, *, temperature, top_k, top_p, pad_id, forbid_pad):
  if forbid_pad:
    last_logits = last_logits.at[:, pad_id].set(-jnp.inf)
  return _sample_next(last_logits, keys, temperature, top_k, top_p)


def _full_forward_step(graphdef, state, buffer, step, keys, **settings):
  """Samples the token at position `step` of `buffer` [B, T] from one full forward (adapter call,
  which derives segment ids from the pad id); causality makes the pads after `step` irrelevant."""
  model = nnx.merge(graphdef, state)
  positions = common.build_positions_from_mask(buffer != settings["pad_id"])
  logits, _ = model(buffer, positions=positions, cache=None, attention_mask=None)
  return _pick(jax.lax.dynamic_index_in_dim(logits, step - 1, axis=1, keepdims=False), keys, **settings)


@jax.jit
def _fold_row_keys(base, texts, repeats, eval_pass):
  """Each row's key: `base` folded with its prompt's crc32, its repeat index and the eval pass, in
  one call (the same keys as folding row by row, which cost ~30 ms of dispatches per 64 rows)."""
  fold = jax.random.fold_in
  return jax.vmap(lambda text, repeat: fold(fold(fold(base, text), repeat), eval_pass))(texts, repeats)


def _prefill_step(graphdef, params, cache, rest, prompts, keys, **settings):
  """MaxText prefill of left-padded prompts [B, P]; samples the first new token."""
  model = nnx.merge(graphdef, params, cache, rest)
  mask = prompts != settings["pad_id"]
  logits = model(prompts, common.build_positions_from_mask(mask), mask.astype(jnp.int32), model_mode="prefill")
  return (*_pick(logits[:, -1], keys, **settings), nnx.state(model, nnx.Cache))


def _autoregressive_step(graphdef, params, cache, rest, tokens, positions, keys, **settings):
  """One MaxText autoregressive step: feeds `tokens` [B] at `positions` [B], samples the next ones."""
  model = nnx.merge(graphdef, params, cache, rest)
  logits = model(tokens[:, None], positions[:, None], model_mode="autoregressive")
  return (*_pick(logits[:, -1], keys, **settings), nnx.state(model, nnx.Cache))


class _CacheModel:
  """The autoregressive-mode twin of the actor for `batch` rows: MaxText's KV cache variables, no
  weights of its own.

  MaxText sizes the autoregressive cache from `micro_batch_size_to_train_on` (train_rl: the prompts
  per step), not from the rollout's rows (prompts x num_generations), so the twin is built from a
  copy of the config with that field set to `batch` (and the cache in CACHE_AXIS_ORDER). Built
  abstractly (no parameter memory); its parameters are the actor's arrays at each call.
  """

  def __init__(self, config: Any, mesh: Any, batch: int):
    from maxtext.utils import model_creation_utils  # pylint: disable=import-outside-toplevel

    config = _cache_config(config, batch)
    _, abstract = model_creation_utils.create_nnx_abstract_model(config, mesh, model_mode="autoregressive")
    self.graphdef, _, cache, rest = nnx.split(abstract, nnx.Param, nnx.Cache, ...)
    self.fresh_cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), cache)
    self.rest = jax.tree.map(_concrete_rng_leaf, rest)  # RNG keys/counts (unused when decoding)


def _cache_config(config: Any, batch: int) -> Any:
  """A copy of MaxText's config (pydantic, or pyconfig's read-only wrapper) whose decode batch is
  `batch` and whose KV cache is in CACHE_AXIS_ORDER."""
  update = {"micro_batch_size_to_train_on": batch, "prefill_cache_axis_order": CACHE_AXIS_ORDER,
            "ar_cache_axis_order": CACHE_AXIS_ORDER}
  if hasattr(config, "model_copy"):
    return config.model_copy(update=update)
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  return pyconfig.HyperParameters(config._pydantic_config.model_copy(update=update))  # pylint: disable=protected-access


def _concrete_rng_leaf(abstract: jax.ShapeDtypeStruct) -> jax.Array:
  if jnp.issubdtype(abstract.dtype, jax.dtypes.prng_key):
    key = jax.random.key(0)
    return jax.random.split(key, abstract.shape) if abstract.shape else key
  return jnp.zeros(abstract.shape, abstract.dtype)


# ----------------------------------------------------------------------------- the rollout


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
      kv_cache: bool = True,
  ):  # pylint: disable=super-init-not-called,too-many-positional-arguments
    del cache_config_or_size
    self._model = rollout_actor  # train_rl's rollout model IS the actor: always the current weights
    self._tokenizer = tokenizer_adapter.TokenizerAdapter(tokenizer)
    self._maxtext_config = maxtext_config
    self.mesh = mesh
    # train_rl's eval builds a RolloutConfig without max_prompt_length (default 64): pad to the
    # trainer's prompt length too, so eval shapes equal train shapes and nothing is cut.
    self._min_prompt_length = int(getattr(maxtext_config, "max_prefill_predict_length", 0) or 0)
    self._train_temperature = rollout_config.temperature
    self.kv_cache = kv_cache
    self._cache_models: dict[int, _CacheModel] = {}  # by rollout rows: MaxText's cache has a fixed batch
    self._jit_cache: dict[tuple, Any] = {}
    # One seed for the run: MaxText's data_shuffle_seed orders the prompts and, here, seeds sampling.
    self._base_key = jax.random.PRNGKey(int(getattr(maxtext_config, "data_shuffle_seed", 0) or 0))
    self._eval_passes = max(1, int(getattr(maxtext_config, "num_eval_passes", 1) or 1))
    self._calls_of: dict[tuple[str, ...], int] = {}  # prompts of a call -> how many earlier calls held them
    self.last_generate_seconds = 0.0

  # -- tunix interface -------------------------------------------------------------------------
  def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig, **kwargs):
    """Samples one completion per prompt string."""
    del kwargs
    start = time.perf_counter()
    prompt_ids = [self._tokenize(p) for p in prompts]
    prompt_len = max(rollout_config.max_prompt_length, self._min_prompt_length, *(len(p) for p in prompt_ids))
    padded = np.stack([_left_pad(p, prompt_len, self.pad_id()) for p in prompt_ids])
    seed = rollout_config.seed
    if seed is None:
      base = self._base_key
    else:
      base = jax.random.PRNGKey(seed) if isinstance(seed, int) else seed
    with self._context():
      tokens, logprobs = self.sample(
          padded,
          rollout_config.max_tokens_to_generate,
          list(rollout_config.eos_tokens or [self.eos_id()]),
          self._row_keys(base, prompts),
          temperature=rollout_config.temperature,
          top_k=rollout_config.top_k,
          top_p=rollout_config.top_p,
      )
    self.last_generate_seconds = time.perf_counter() - start
    logging.info(
        "cpu_jax rollout: %d prompts, prompt length %d, %d new tokens max, kv_cache=%s, %.2f s",
        len(prompts), prompt_len, rollout_config.max_tokens_to_generate, self._uses_cache(padded.shape[1],
        rollout_config.max_tokens_to_generate), self.last_generate_seconds,
    )
    return base_rollout.RolloutOutput(
        text=[self._tokenizer.decode(t.tolist()) for t in tokens],
        logits=None,
        tokens=tokens,
        left_padded_prompt_tokens=padded,
        logprobs=logprobs if rollout_config.return_logprobs else None,
    )

  def _row_keys(self, base: jax.Array, prompts: list[str]) -> jax.Array:
    """One key per row [B, 2]: from `base`, the prompt's text, its repeat index in this call and
    the call's eval pass (see the module docstring); counts this call."""
    call = tuple(prompts)
    eval_pass = self._calls_of.get(call, 0) % self._eval_passes
    self._calls_of[call] = self._calls_of.get(call, 0) + 1
    repeats: dict[str, int] = {}
    texts, repeat_of_row = [], []
    for prompt in prompts:
      texts.append(zlib.crc32(prompt.encode()))
      repeat_of_row.append(repeats.get(prompt, 0))
      repeats[prompt] = repeat_of_row[-1] + 1
    return _fold_row_keys(base, np.array(texts, np.uint32), np.array(repeat_of_row, np.uint32), np.uint32(eval_pass))

  def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array) -> jax.Array:
    """Log-probs of `completion_tokens` under the current weights (used when num_iterations > 1)."""
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

  # -- decoding --------------------------------------------------------------------------------
  def sample(
      self,
      padded_prompts: np.ndarray,
      max_new_tokens: int,
      eos_ids: Sequence[int],
      row_keys: jax.Array,
      *,
      temperature: float,
      top_k: Optional[int],
      top_p: Optional[float],
  ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Decodes from left-padded prompts [B, P], row b drawing with `row_keys[b]` (folded with the
    token's index); returns per row the tokens up to and including the first EOS, and their logprobs."""
    batch, prompt_len = padded_prompts.shape
    pad = self.pad_id()
    settings = dict(temperature=float(temperature), top_k=top_k, top_p=top_p, pad_id=pad, forbid_pad=pad not in eos_ids)
    if self._uses_cache(prompt_len, max_new_tokens):
      advance = self._cached_decoder(padded_prompts, settings)
    else:
      advance = self._full_forward_decoder(padded_prompts, max_new_tokens, settings)
    done = np.zeros(batch, bool)
    out = np.full((batch, max_new_tokens), pad, np.int32)
    out_logprobs = np.zeros((batch, max_new_tokens), np.float32)
    eos = np.asarray(eos_ids)
    tok = None
    for i in range(max_new_tokens):
      new, lp = advance(i, tok, _fold_rows(row_keys, i))
      tok = np.where(done, pad, np.asarray(new)).astype(np.int32)
      out[:, i] = tok
      out_logprobs[:, i] = np.asarray(lp)
      done |= np.isin(tok, eos)
      if done.all():
        break
    return _trim(out, out_logprobs, eos)

  def _full_forward_decoder(self, padded_prompts: np.ndarray, max_new_tokens: int, settings: dict) -> Advance:
    """One full forward over a [B, P + G] buffer per new token."""
    batch, prompt_len = padded_prompts.shape
    buffer = np.full((batch, prompt_len + max_new_tokens), settings["pad_id"], np.int32)
    buffer[:, :prompt_len] = padded_prompts
    buf = jnp.asarray(buffer)
    graphdef, state = nnx.split(self._model)
    step = self._jitted("full", _full_forward_step, graphdef, settings)

    def advance(i: int, previous: Optional[np.ndarray], keys: jax.Array):
      nonlocal buf
      if i > 0:
        buf = buf.at[:, prompt_len + i - 1].set(previous)
      return step(state, buf, prompt_len + i, keys)

    return advance

  def _cached_decoder(self, padded_prompts: np.ndarray, settings: dict) -> Advance:
    """MaxText's own prefill, then one autoregressive step per new token.

    Prefill stores the left-padded prompts with their segment ids (pads masked, as in the full
    forward); each step feeds the previous token at position `prompt length + i - 1` per row. The
    cache twin (and its jitted steps) is built once per number of rows.
    """
    rows = padded_prompts.shape[0]
    if rows not in self._cache_models:
      self._cache_models[rows] = _CacheModel(self._maxtext_config, self.mesh, rows)
    cm = self._cache_models[rows]
    params = nnx.state(self._model.base, nnx.Param)
    prefill = self._jitted(f"prefill/{rows}", _prefill_step, cm.graphdef, settings)
    step = self._jitted(f"autoregressive/{rows}", _autoregressive_step, cm.graphdef, settings)
    prompts = jnp.asarray(padded_prompts)
    lengths = jnp.asarray((padded_prompts != settings["pad_id"]).sum(axis=1), jnp.int32)
    cache = cm.fresh_cache

    def advance(i: int, previous: Optional[np.ndarray], keys: jax.Array):
      nonlocal cache
      if i == 0:
        tok, lp, cache = prefill(params, cache, cm.rest, prompts, keys)
      else:
        tok, lp, cache = step(params, cache, cm.rest, jnp.asarray(previous), lengths + i - 1, keys)
      return tok, lp

    return advance

  def _uses_cache(self, prompt_len: int, max_new_tokens: int) -> bool:
    """MaxText's cache holds exactly `max_prefill_predict_length` prompt positions and
    `max_target_length - max_prefill_predict_length` new ones; otherwise decode without it."""
    cfg = self._maxtext_config
    if not self.kv_cache or cfg is None or not hasattr(self._model, "base"):
      return False
    return prompt_len == cfg.max_prefill_predict_length and (
        max_new_tokens <= cfg.max_target_length - cfg.max_prefill_predict_length
    )

  # -- helpers ---------------------------------------------------------------------------------
  def _jitted(self, name: str, fn: Callable, graphdef: Any, settings: dict):
    """`fn` with the graphdef and sampling settings bound, jitted once per (name, settings).

    MaxText's graphdef holds its (unhashable) config, so it is closed over rather than passed as a
    static argument; the model's structure does not change between calls.
    """
    key = (name, *sorted(settings.items()))
    if key not in self._jit_cache:
      self._jit_cache[key] = jax.jit(functools.partial(fn, graphdef, **settings))
    return self._jit_cache[key]

  def _tokenize(self, text: str) -> list[int]:
    ids = self._tokenizer.encode(text)
    bos = [self._tokenizer.bos_id()] if self._tokenizer.bos_id() is not None else []
    return self._tokenizer.dedup_bos_ids(bos + list(ids))

  def _context(self) -> contextlib.ExitStack:
    """The rollout mesh and MaxText's logical axis rules (train_rl's eval calls us outside them)."""
    stack = contextlib.ExitStack()
    if self.mesh is not None:
      stack.enter_context(self.mesh)
    rules = getattr(self._maxtext_config, "logical_axis_rules", None)
    if rules is not None:
      stack.enter_context(nn_partitioning.axis_rules(rules))
    return stack


def _left_pad(ids: Sequence[int], length: int, pad: int) -> np.ndarray:
  out = np.full(length, pad, np.int32)
  out[length - len(ids) :] = ids
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


# ----------------------------------------------------------------------------- entry points


def install() -> None:
  """Registers the two stand-in modules; call before importing train_rl."""
  adapter = types.ModuleType(ADAPTER_MODULE)
  adapter.__doc__ = "mtpipe stand-in: the cpu_jax rollout registers no vLLM model."
  adapter.register = lambda config=None: None
  rollout = types.ModuleType(ROLLOUT_MODULE)
  rollout.__doc__ = "mtpipe stand-in: MaxTextVllmRollout is mtpipe.maxtext.rollout_cpu.CpuJaxRollout."
  rollout.MaxTextVllmRollout = CpuJaxRollout
  parent = importlib.import_module(PARENT_PACKAGE)  # its __init__ imports nothing from vLLM
  for name, module in ((ADAPTER_MODULE, adapter), (ROLLOUT_MODULE, rollout)):
    sys.modules[name] = module
    setattr(parent, name.rsplit(".", 1)[1], module)  # `import a.b.c as x` reads the attribute
