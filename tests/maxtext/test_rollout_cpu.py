"""The cpu_jax rollout backend (mtpipe.maxtext.rollout_cpu) for MaxText's GRPO trainer.

Fast tests check the sampling pieces and the stand-in modules without MaxText's model. The slow ones
build the tiny Llama 3.1 twin's MaxText model the way train_rl does (random weights, the embedded
tokenizer) and compare the sampler with an independent reference decode: MaxText's own forward on
the growing sequence (no left padding, no KV cache, plain positions; right-padded to a fixed width
so that it compiles once, which the causal mask hides from every real position), argmax per step.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpipe.maxtext import rollout_cpu
import families

RL_YML = Path(importlib.util.find_spec("maxtext").origin).parent / "configs" / "post_train" / "rl.yml"
PROMPTS = ["Tom has 3 pens. He gets 4 more. How many pens?", "Mia has 12 coins and gives 5 away. How many are left?"]
NEW_TOKENS = 12
DECODE_BATCH = 2  # train_rl's batch_size (prompts per step); a rollout has batch_size x num_generations rows


# ----------------------------------------------------------------------------- fast


def test_greedy_pick_is_argmax_with_zero_logprob_shape():
    logits = jnp.array([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    tokens, logprobs = rollout_cpu._sample_next(logits, jax.random.split(jax.random.PRNGKey(0), 2), 0.0, None, None)
    assert tokens.tolist() == [1, 0]
    assert logprobs.shape == (2,)


def test_top_k_and_top_p_only_draw_allowed_tokens():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 256))
    keys = jax.random.split(jax.random.PRNGKey(1), (3, 256))
    top2, lp = rollout_cpu._sample_next(logits, keys[0], 1.0, 2, None)
    assert set(np.asarray(top2).tolist()) == {0, 1}
    # logprob under the renormalised top-2 distribution
    np.testing.assert_allclose(np.exp(np.asarray(lp)), np.where(np.asarray(top2) == 0, 0.5 / 0.8, 0.3 / 0.8), rtol=1e-5)
    nucleus, _ = rollout_cpu._sample_next(logits, keys[1], 1.0, None, 0.7)  # 0.5 + 0.3 reaches 0.7
    assert set(np.asarray(nucleus).tolist()) == {0, 1}
    everything, _ = rollout_cpu._sample_next(logits, keys[2], 1.0, None, 1.0)
    assert set(np.asarray(everything).tolist()) == {0, 1, 2, 3}


def test_trim_keeps_first_eos_and_left_pad():
    tokens = np.array([[5, 2, 9, 9], [5, 6, 7, 8]])
    rows, lps = rollout_cpu._trim(tokens, np.ones_like(tokens, np.float32), np.array([2]))
    assert [r.tolist() for r in rows] == [[5, 2], [5, 6, 7, 8]]
    assert [len(x) for x in lps] == [2, 4]
    assert rollout_cpu._left_pad([7, 8], 4, 0).tolist() == [0, 0, 7, 8]


@pytest.mark.fast_rl
def test_row_keys_are_the_row_by_row_folds():
    """The rows' keys, folded in one jitted call, are bit for bit those of folding each row in turn
    (prompt crc32, repeat index, eval pass), which cost ~30 ms of dispatches per 64-row rollout."""
    import types
    import zlib

    prompts = [f"question {i % 3}" for i in range(7)] + ["a prompt whose crc32 is above 2**31 " * 3]
    rollout = types.SimpleNamespace(_calls_of={}, _eval_passes=8)
    base = jax.random.PRNGKey(42)
    for eval_pass in range(2):  # the same prompts again: the second eval pass
        keys = rollout_cpu.CpuJaxRollout._row_keys(rollout, base, prompts)
        repeats: dict[str, int] = {}
        for row, prompt in enumerate(prompts):
            key = jax.random.fold_in(jax.random.fold_in(base, zlib.crc32(prompt.encode())), repeats.get(prompt, 0))
            assert (keys[row] == jax.random.fold_in(key, eval_pass)).all(), (row, eval_pass)
            repeats[prompt] = repeats.get(prompt, 0) + 1


def test_install_replaces_only_the_two_vllm_modules():
    rollout_cpu.install()
    assert sys.modules[rollout_cpu.ROLLOUT_MODULE].MaxTextVllmRollout is rollout_cpu.CpuJaxRollout
    assert sys.modules[rollout_cpu.ADAPTER_MODULE].register() is None
    from maxtext.integration.vllm import maxtext_vllm_rollout  # what train_rl imports

    assert maxtext_vllm_rollout.MaxTextVllmRollout is rollout_cpu.CpuJaxRollout


def _heavy_modules_a_grading_worker_imports(main_module: str) -> list[str]:
    """What a process of MaxText's math-verify pool imports before it grades anything, when the
    trainer's __main__ is `main_module`: a spawned worker first re-imports the parent's __main__
    module by name (multiprocessing.spawn's own step, run here in a fresh interpreter)."""
    code = ("import multiprocessing.spawn, sys\n"
            f"multiprocessing.spawn._fixup_main_from_name({main_module!r})\n"
            "print(','.join(m for m in ('jax', 'flax', 'tunix', 'maxtext') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return [m for m in run.stdout.strip().split(",") if m]


def test_the_grading_workers_do_not_import_jax_or_tunix():
    """train_rl's child process is launched as `python -m mtpipe.maxtext.launch_rl_cpu`; each grading
    worker (one more per 100 graded answers) re-imports that module, and must not pay JAX's, flax's
    and tunix's import (benchmarks/grading_workers.py measures the cost). The control: the rollout backend as
    __main__ makes every worker import them. (tests/maxtext/test_tutorial_commands.py checks the launcher.)"""
    assert _heavy_modules_a_grading_worker_imports("mtpipe.maxtext.launch_rl_cpu") == []
    assert {"jax", "flax", "tunix"} <= set(_heavy_modules_a_grading_worker_imports("mtpipe.maxtext.rollout_cpu"))


def test_missing_vllm_backend_names_the_key_and_the_fix():
    """stages/train_rl.py checks the backend before MaxText starts (vLLM is not installed here)."""
    from stages.train_rl import check_rollout_backend

    from mtpipe.errors import ConfigError

    if importlib.util.find_spec("vllm") and importlib.util.find_spec("tpu_inference"):
        pytest.skip("vLLM and tpu-inference are installed here")
    with pytest.raises(ConfigError, match=r"rl.train_rl.rollout_backend: vllm needs .*Fix: .*cpu_jax"):
        check_rollout_backend("vllm", runs_here=True)
    check_rollout_backend("cpu_jax", runs_here=True)
    check_rollout_backend("vllm", runs_here=False)   # an xpk workload: vLLM is in the image


# ----------------------------------------------------------------------------- MaxText model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(rollout, model, tokenizer, mesh, config) for the tiny Llama 3.1 twin, random MaxText weights."""
    from maxtext.configs import pyconfig, types
    from maxtext.utils import model_creation_utils
    from transformers import AutoTokenizer
    from tunix.rl.rollout import base_rollout

    from mtpipe.data import embedded

    root = tmp_path_factory.mktemp("tiny")
    families.twins()["llama3.1-tiny"].write(root / "llama")
    dims = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in families.twins()["llama3.1-tiny"].overrides.items()]
    argv = [
        "", str(RL_YML), "model_name=llama3.1-8b-Instruct", *dims, f"tokenizer_path={root / 'llama'}",
        "convert_checkpoint_if_possible=false", "init_weights_seed=7", "hardware=cpu",
        "use_pathways=false", "skip_jax_distributed_system=true", "chips_per_vm=1", "rollout_data_parallelism=1",
        "rollout_tensor_parallelism=1", "weight_dtype=float32", "dtype=float32", "matmul_precision=highest",
        "max_prefill_predict_length=64", f"max_target_length={64 + NEW_TOKENS}",
        f"batch_size={DECODE_BATCH}",  # MaxText sizes its decode cache from this, not from the rollout rows
        f"base_output_directory={root / 'out'}", "run_name=t", "enable_checkpointing=false", "log_config=false",
    ]
    config = pyconfig.initialize_pydantic(argv, config_class=types.RLConfig)
    tokenizer = AutoTokenizer.from_pretrained(root / "llama")
    model, mesh = model_creation_utils.from_pretrained(
        config, devices=jax.devices(), wrap_with_tunix_adapter=True, tokenizer_pad_id=tokenizer.pad_token_id
    )
    rollout = rollout_cpu.CpuJaxRollout(
        rollout_actor=model,
        tokenizer=tokenizer,
        mesh=mesh,
        rollout_config=base_rollout.RolloutConfig(max_prompt_length=64, max_tokens_to_generate=NEW_TOKENS),
        maxtext_config=config,
    )
    return rollout, model, tokenizer, mesh, config


_REFERENCE: dict[tuple[str, int], list[int]] = {}  # the module's `tiny` model is the same in every test


def _reference_greedy(tiny, prompt: str, steps: int) -> list[int]:
    """MaxText's forward over the whole sequence, re-run from scratch for every new token (computed
    once per prompt for the module)."""
    if (prompt, steps) not in _REFERENCE:
        _REFERENCE[prompt, steps] = _reference_greedy_uncached(tiny, prompt, steps)
    return _REFERENCE[prompt, steps]


def _reference_greedy_uncached(tiny, prompt: str, steps: int) -> list[int]:
    from flax import nnx
    from flax.linen import partitioning as nn_partitioning

    @nnx.jit
    def forward(base, tokens, segments):  # one compile per prompt: the sequence grows into a fixed width
        positions = jnp.arange(tokens.shape[1])[None]
        return base(decoder_input_tokens=tokens, decoder_positions=positions, decoder_segment_ids=segments)

    rollout, model, tokenizer, mesh, config = tiny
    seq = list(rollout._tokenize(prompt))
    width = len(seq) + steps
    out = []
    with mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
        for _ in range(steps):
            n = len(seq)  # the tokens after position n - 1 are padding it cannot attend to (causal mask)
            x = jnp.asarray([seq + [0] * (width - n)], jnp.int32)
            logits = forward(model.base, x, jnp.asarray([[1] * n + [0] * (width - n)], jnp.int32))
            last = np.asarray(logits[0, n - 1], np.float64)
            last[tokenizer.pad_token_id] = -np.inf  # the sampler never emits the pad token
            out.append(int(np.argmax(last)))
            seq.append(out[-1])
    return out


def _generate(tiny, prompts, kv_cache=True, **config):
    from tunix.rl.rollout import base_rollout

    rollout = tiny[0]
    rollout.kv_cache = kv_cache
    cfg = base_rollout.RolloutConfig(max_prompt_length=64, max_tokens_to_generate=NEW_TOKENS, **config)
    return rollout.generate(prompts, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache", [True, False], ids=["kv_cache", "full_forward"])
def test_greedy_matches_reference_decode(tiny, kv_cache):
    out = _generate(tiny, PROMPTS, kv_cache, temperature=0.0, eos_tokens=[-1])  # no stop: full length
    assert tiny[0]._uses_cache(64, NEW_TOKENS) is kv_cache
    assert out.left_padded_prompt_tokens.shape == (2, 64)
    for prompt, tokens in zip(PROMPTS, out.tokens):
        assert tokens.tolist() == _reference_greedy(tiny, prompt, NEW_TOKENS)
    # the same prompt alone (other padding, batch of one) gives the same tokens
    alone = _generate(tiny, PROMPTS[1:], kv_cache, temperature=0.0, eos_tokens=[-1])
    assert alone.tokens[0].tolist() == out.tokens[1].tolist()


@pytest.mark.slow
@pytest.mark.fast_rl
def test_the_decode_cache_is_kept_in_attention_axis_order(tiny):
    """The rollout's KV cache is (batch, length, heads, head dim), attention's own order, so no decode
    step transposes the whole cache (MaxText's default, (length, heads, batch, head dim), did)."""
    _, _, _, mesh, config = tiny
    cache = rollout_cpu._CacheModel(config, mesh, batch=8).fresh_cache
    layers = cache["decoder"]["layers"]["self_attention"]["KVCache_0"]
    kv_heads, head_dim = config.base_num_kv_heads, config.head_dim
    assert layers["cached_prefill_key"].value.shape == (config.base_num_decoder_layers, 8, 64, kv_heads, head_dim)
    assert layers["cached_ar_value"].value.shape == (config.base_num_decoder_layers, 8, NEW_TOKENS, kv_heads, head_dim)


@pytest.mark.slow
def test_kv_cache_greedy_matches_reference_with_more_rows_than_the_config_batch(tiny):
    """A train_rl rollout of batch_size 2 x num_generations 4 = 8 rows (the cache twin used to keep
    the config's batch of 2 and failed on "batch dims must match"); then fewer rows again."""
    prompts = PROMPTS + ["Ana has 9 cards. She gets 6 more. How many cards?", "Leo has 4 boxes of 5 shells. How many?"]
    rows = [p for p in prompts for _ in range(2)]  # 4 prompts x 2 generations
    out = _generate(tiny, rows, temperature=0.0, eos_tokens=[-1])
    assert tiny[0]._uses_cache(64, NEW_TOKENS)
    assert out.left_padded_prompt_tokens.shape == (8, 64)
    reference = {p: _reference_greedy(tiny, p, NEW_TOKENS) for p in prompts}
    for prompt, tokens in zip(rows, out.tokens):
        assert tokens.tolist() == reference[prompt]
    three = _generate(tiny, prompts[1:], temperature=0.0, eos_tokens=[-1])
    assert [t.tolist() for t in three.tokens] == [reference[p] for p in prompts[1:]]


@pytest.mark.slow
def test_kv_cache_and_full_forward_sample_the_same(tiny):
    outs = [
        _generate(tiny, PROMPTS, kv_cache, temperature=0.9, top_k=50, top_p=0.95, seed=11, return_logprobs=True)
        for kv_cache in (True, False)
    ]
    for cached, full in zip(outs[0].tokens, outs[1].tokens):
        assert cached.tolist() == full.tolist()
    np.testing.assert_allclose(np.concatenate(outs[0].logprobs), np.concatenate(outs[1].logprobs), atol=1e-4)


@pytest.mark.slow
def test_an_eval_pass_samples_a_prompt_with_the_same_random_numbers(tiny):
    """Common random numbers: with 2 eval passes, the 3rd call of the same prompts repeats the 1st
    (same weights, same samples), the 2nd differs; rows repeating one prompt in a call differ."""
    rollout = tiny[0]
    rows = [PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    rollout._eval_passes, rollout._calls_of = 2, {}
    try:
        first, second, third = (_generate(tiny, rows, temperature=1.0, eos_tokens=[-1]).tokens for _ in range(3))
    finally:
        rollout._eval_passes, rollout._calls_of = 1, {}
    assert [t.tolist() for t in third] == [t.tolist() for t in first]
    assert [t.tolist() for t in second] != [t.tolist() for t in first]
    assert first[0].tolist() != first[1].tolist(), "two samples of one prompt in a call drew the same numbers"


@pytest.mark.slow
def test_a_grpo_batch_draws_what_it_drew_before_a_resume(tiny):
    """A resumed run (a new sampler: no earlier calls) draws a training batch's numbers as the
    uninterrupted run did, though a prompt of it was sampled before the checkpoint; and the eval after
    training stays paired with the one before, though a training batch held one of its prompts."""
    rollout = tiny[0]
    base = jax.random.PRNGKey(0)
    evals, other = PROMPTS, "Ann has 2 cats and 3 dogs. How many pets?"
    step = [PROMPTS[0]] * 2 + [other] * 2  # a GRPO batch, 2 samples per prompt: an eval prompt trained on
    rollout._eval_passes, rollout._calls_of = 2, {}
    try:
        before = [np.asarray(rollout._row_keys(base, evals)) for _ in range(2)]
        rollout._row_keys(base, [other] * 2)  # a step before the checkpoint held `other`
        uninterrupted = np.asarray(rollout._row_keys(base, step))
        after = [np.asarray(rollout._row_keys(base, evals)) for _ in range(2)]
        rollout._calls_of = {}  # the resumed process
        resumed = np.asarray(rollout._row_keys(base, step))
    finally:
        rollout._eval_passes, rollout._calls_of = 1, {}
    np.testing.assert_array_equal(resumed, uninterrupted)
    for pass_before, pass_after in zip(before, after):
        np.testing.assert_array_equal(pass_after, pass_before)
    assert not np.array_equal(before[0], before[1])


@pytest.mark.slow
def test_stops_at_first_eos_and_keeps_it(tiny):
    full = _generate(tiny, PROMPTS[:1], temperature=0.0, eos_tokens=[-1]).tokens[0].tolist()
    k = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    out = _generate(tiny, PROMPTS[:1], temperature=0.0, eos_tokens=[full[k]])
    assert out.tokens[0].tolist() == full[: k + 1]
    assert out.text[0] == tiny[2].decode(full[: k + 1])


@pytest.mark.slow
def test_sampled_tokens_are_in_the_reference_top_k_with_their_logprob(tiny):
    from flax.linen import partitioning as nn_partitioning

    rollout, model, tokenizer, mesh, config = tiny
    out = _generate(tiny, PROMPTS, temperature=0.7, top_k=3, eos_tokens=[-1], seed=3, return_logprobs=True)
    for prompt, tokens, logprobs in zip(PROMPTS, out.tokens, out.logprobs):
        seq = list(rollout._tokenize(prompt)) + tokens.tolist()
        x = jnp.asarray([seq], jnp.int32)
        with mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
            logits = np.asarray(model.base(x, jnp.arange(len(seq))[None], jnp.ones_like(x))[0], np.float64)
        start = len(seq) - len(tokens) - 1
        for i, tok in enumerate(tokens.tolist()):
            step = logits[start + i] / 0.7
            step[tokenizer.pad_token_id] = -np.inf
            top = np.argsort(step)[-3:]
            assert tok in top
            ref = step[tok] - np.log(np.exp(step[top] - step[top].max()).sum()) - step[top].max()
            assert abs(ref - logprobs[i]) < 1e-3
