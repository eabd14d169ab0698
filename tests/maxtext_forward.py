"""MaxText's own forward pass of a MaxText checkpoint, in a child process on CPU.

    logits(checkpoint, model_name, token_ids, overrides) -> np.ndarray (len(token_ids), vocab), float32

`checkpoint` is what `load_parameters_path` takes: `<to_maxtext out>/0/items`, or a trained
`.../checkpoints/<step>/model_params`. `overrides` are extra MaxText `key=value` settings, e.g. the
shrunk dims of a tiny model (`override_model_config=true base_emb_dim=64 ...`).

The child builds the model the way MaxText's own logit checker does on its NNX path (tests/utils/
forward_pass_logit_checker.py upstream): `pyconfig.initialize`, then
`model_creation_utils.from_pretrained` (the loader the SFT trainer uses too; it reads both the
converter's Linen layout and the trainer's NNX `model_params`), then
`model(decoder_input_tokens, decoder_positions, decoder_segment_ids)`. It runs in float32 with the
highest matmul precision and plain dot-product attention, so only MaxText's deliberate roundings remain.

Run as a script it is that child: `python tests/maxtext_forward.py TOKENS.npy OUT.npy key=value ...`.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

_REPO = Path(__file__).resolve().parent.parent
# Settings the comparison needs; the caller's overrides come after them (MaxText: last one wins).
_FORWARD_SETTINGS = (
    "dtype=float32",
    "weight_dtype=float32",
    "matmul_precision=highest",
    "attention=dot_product",
    "per_device_batch_size=1",
    "use_multimodal=false",
    "enable_checkpointing=false",
    "hardware=cpu",
    "skip_jax_distributed_system=true",
    "run_name=maxtext_forward",
)


def as_args(overrides: Mapping[str, object] | Sequence[str]) -> list[str]:
    """MaxText `key=value` arguments from a mapping (booleans as true/false) or a list of them."""
    if isinstance(overrides, Mapping):
        return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items()]
    return list(overrides)


def logits(
    checkpoint: str | Path,
    model_name: str,
    token_ids: Sequence[int],
    overrides: Mapping[str, object] | Sequence[str] = (),
    *,
    timeout_s: float = 900,
) -> np.ndarray:
    """float32 logits, shape (len(token_ids), vocab), of MaxText `model_name` loaded from `checkpoint`."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"load_parameters_path {checkpoint} is not a directory (want .../0/items or .../model_params)")
    ids = np.asarray(token_ids, dtype=np.int32)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError("token_ids must be a non-empty 1-D sequence of ints")
    env = dict(os.environ, JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(_REPO / "work" / "jax_cache"))
    with tempfile.TemporaryDirectory(prefix="maxtext_forward_") as tmp:
        tokens, out = Path(tmp) / "tokens.npy", Path(tmp) / "logits.npy"
        np.save(tokens, ids)
        args = [
            f"model_name={model_name}",
            f"load_parameters_path={checkpoint}",
            f"max_target_length={ids.size}",
            f"max_prefill_predict_length={ids.size}",
            f"base_output_directory={tmp}/run",
            f"jax_cache_dir={env['JAX_COMPILATION_CACHE_DIR']}",
            *_FORWARD_SETTINGS,
            *as_args(overrides),
        ]
        proc = subprocess.run(
            [sys.executable, __file__, str(tokens), str(out), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"MaxText forward failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
        return np.load(out)


def _child(tokens_path: str, out_path: str, maxtext_args: list[str]) -> None:
    """Load the checkpoint into MaxText's Transformer and save its logits for the tokens."""
    import jax

    from maxtext.common.common_types import DECODING_ACTIVE_SEQUENCE_INDICATOR, MODEL_MODE_TRAIN
    from maxtext.configs import pyconfig
    from maxtext.utils import maxtext_utils, model_creation_utils

    config = pyconfig.initialize(["maxtext_forward", *maxtext_args])
    mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(config), config.mesh_axes)
    model = model_creation_utils.from_pretrained(config, mesh=mesh, model_mode=MODEL_MODE_TRAIN)

    ids = np.load(tokens_path)
    batch = config.global_batch_size_to_train_on
    tokens = np.tile(ids[None, :], (batch, 1))
    positions = np.tile(np.arange(ids.size, dtype=np.int32)[None, :], (batch, 1))
    segments = np.full_like(tokens, DECODING_ACTIVE_SEQUENCE_INDICATOR)
    out = model(
        decoder_input_tokens=tokens, decoder_positions=positions, decoder_segment_ids=segments, enable_dropout=False
    )
    np.save(out_path, np.asarray(out[0], dtype=np.float32))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3:])
    gc.freeze()  # the exit frees MaxText's modules without a collection over them (mtpipe.maxtext.launch)
