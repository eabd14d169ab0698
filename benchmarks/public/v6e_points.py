"""The public MaxText v6e runs (v6e_maxtext.yaml) as records the step model is fit and tested on.

    .venv/bin/python benchmarks/public/v6e_points.py   # writes benchmarks/on_tpu/records/public_v6e.json (minutes)

No run is compiled here (a compile of these shapes takes far longer on a laptop than it is worth: the
step model reads only the FLOPs and the parameters). Per run, MaxText's config is built from the run's
own arguments (model, batch, sequence, MoE settings) at the TPU it ran on, and from it:

* ``tflops_per_device``: MaxText's ``calculate_tflops_training_per_device``, the count preflight uses
  (this MaxText's: causal attention counted half, unlike the count the runs logged before MaxText's
  FLOP change; compare ``logged.tflops_per_device x step_time_s``);
* the per-device batch the log line's ``total_weights`` shows where it differs from the configuration
  printed beside it (one run: its tokens per second agree with the log's batch);
* ``overlapped``: whether its XLA flags overlap FSDP's collectives with the arithmetic;
* ``param_count``: the decoder's weights from the config's dimensions (embedding, attention, MLP or
  experts and router, norms, unembedding unless tied), ``param_bytes`` at its ``weight_dtype``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "v6e_maxtext.yaml"
OUT = HERE.parent / "on_tpu" / "records" / "public_v6e.json"
# The run arguments that change MaxText's FLOP count or the weights; the rest (remat, offload, kernels'
# block sizes, data, profiler) change how fast the step runs, which is what the record measured.
# XLA flag groups that overlap FSDP's collectives with the arithmetic (maxtext benchmarks/xla_flags_library.py)
OVERLAP_FLAG_GROUPS = ("DATA_PARALLEL_OVERLAP", "CF_FOR_ALL_GATHER")
COUNTED_KEYS = ("model_name", "per_device_batch_size", "max_target_length", "weight_dtype", "megablox",
                "sparse_matmul", "capacity_factor")


def param_count(c: Any) -> int:
    """The decoder's weights from its config's dimensions."""
    emb, heads, kv, hd, layers = c.emb_dim, c.num_query_heads, c.num_kv_heads, c.head_dim, c.num_decoder_layers
    attention = emb * hd * (2 * heads + 2 * kv)
    experts = max(1, c.num_experts)
    mlp = 3 * emb * c.mlp_dim * experts + (emb * experts if experts > 1 else 0)
    tied = getattr(c, "logits_via_embedding", False)
    return int(layers * (attention + mlp + 2 * emb) + c.vocab_size * emb * (1 if tied else 2) + emb)


def point(run: dict[str, Any]) -> dict[str, Any]:
    from maxtext.configs import pyconfig
    from maxtext.utils import maxtext_utils
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

    args = [a for a in run["maxtext_args"] if a.split("=")[0] in COUNTED_KEYS]
    chips = int(run["chips"].rsplit("-", 1)[1])
    logged_batch = run["logged"]["total_weights"] / (chips * run["max_target_length"])
    if logged_batch != run["per_device_batch_size"]:   # the log line is of another batch than its config: the log's
        args = [a for a in args if not a.startswith("per_device_batch_size=")] + [f"per_device_batch_size={logged_batch:g}"]
    argv = ["v6e_points", os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml"), *args, f"compile_topology={run['chips']}",
            "compile_topology_num_slices=1", "run_name=v6e_points", "base_output_directory=/tmp/v6e_points",
            "skip_jax_distributed_system=True", "enable_checkpointing=False", "dataset_type=synthetic"]
    c = pyconfig.initialize(argv)
    params = param_count(c)
    itemsize = 4 if "float32" in str(c.weight_dtype) else 2
    return {
        "name": run["name"], "model": run["model"], "family": run["model"].split("-")[0], "chips": run["chips"],
        "per_device_batch_size": c.per_device_batch_size, "max_target_length": run["max_target_length"],
        "remat_policy": run["remat_policy"], "offloaded": run.get("offloaded_tensors", []),
        "step_s": run["logged"]["step_time_s"], "logged_tflops_per_device": run["logged"]["tflops_per_device"],
        "tflops_per_device": float(maxtext_utils.calculate_tflops_training_per_device(c, log=False)[0]),
        "param_count": params, "param_bytes": params * itemsize, "weight_dtype": str(c.weight_dtype),
        "counted_args": args, "source": run["source"]["url"], "quoted": run["quoted"],
        "maxtext_tag": run["source"].get("maxtext_tag"), "xla_flag_groups": run["xla_flag_groups"],
        "overlapped": any(g in OVERLAP_FLAG_GROUPS for g in run["xla_flag_groups"]),
    }


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    runs = yaml.safe_load(SOURCE.read_text())["runs"]
    from importlib import metadata
    records = {"source": "benchmarks/public/v6e_maxtext.yaml (tpu-recipes logs; each run's source below)",
               "counted_by": f"maxtext {metadata.version('maxtext')} calculate_tflops_training_per_device, "
                             "no compile (benchmarks/public/v6e_points.py)",
               "runs": {}}
    for run in runs:
        try:
            records["runs"][run["name"]] = point(run)
        except Exception as err:  # a model this MaxText no longer names: said in the file, not guessed
            records["runs"][run["name"]] = {"name": run["name"], "error": f"{type(err).__name__}: {err}"[:300]}
        print(run["name"], records["runs"][run["name"]].get("tflops_per_device"), file=sys.stderr, flush=True)
    OUT.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
