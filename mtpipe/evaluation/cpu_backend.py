"""Whether the CPU model server (mtpipe/evaluation/numpy_forward.py) can serve a branch's model, asked
by `configure`, before anything is downloaded, converted or trained.

The model is not on disk then, so its Hugging Face config is MaxText's own table entry for the branch's
`maxtext_name` (maxtext.checkpoint_conversion.utils.hf_model_configs, what to_maxtext converts with):
its `model_type` and the keys the forward reads (rope type, activation, layer types).
"""

from __future__ import annotations

from mtpipe.data import maxtext_tables
from mtpipe.errors import ConfigError
from mtpipe.evaluation import numpy_forward
from mtpipe.pipeline.schema import SftBranch


def cpu_forward_errors(cfg: SftBranch) -> list[ConfigError]:
    """A composed branch with `evaluate.backend: cpu` whose model the CPU forward cannot serve: the error
    naming `<branch>.evaluate.backend`, the file to extend and the vLLM backend. A name MaxText does not
    know is left to the conversion's own checks."""
    if cfg.evaluate.backend != "cpu":
        return []
    hf_config = maxtext_tables.hf_config(cfg.model.maxtext_name)
    problems = numpy_forward.unsupported(hf_config) if hf_config is not None else []
    if not problems:
        return []
    key = f"{cfg.branch}.evaluate.backend"
    return [ConfigError(
        key,
        f"is cpu, but the CPU model server cannot run {cfg.model.name} (MaxText's {cfg.model.maxtext_name} "
        f"config: {'; '.join(problems)})",
        f"set evaluate.backend: vllm in the preset (or `dvc exp run -S +{key}=vllm`; vLLM needs a TPU VM), "
        "or teach the CPU forward this family: an Architecture in ARCHITECTURES of "
        "mtpipe/evaluation/numpy_forward.py (docs/extending.md)",
    )]  # fmt: skip


def check_cpu_forward(cfg: SftBranch) -> SftBranch:
    """Raise the first of :func:`cpu_forward_errors`; return ``cfg``."""
    if errors := cpu_forward_errors(cfg):
        raise errors[0]
    return cfg
