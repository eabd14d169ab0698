"""The machine budget: what every stage of a run writes and keeps, per file system, and host memory.

Answered before any VM exists, from numbers that need no accelerator and no network:

* **Model sizes**: the source's safetensors headers on disk (a local source, the embedded twins), or
  :data:`HUB_MODELS` (the Hub index's ``total_size`` and the language model's parameter count of
  each tutorial model, pinned by tests/planning/test_budget.py against tests/fixtures/). With a cached
  preflight compile, its train state's parameter count and weight dtype are used instead.
* **Dtypes**: the stage's own MaxText command line (:func:`mtpipe.maxtext.training_commands.placeholder_command`)
  over MaxText's config files (the trainer's, :attr:`mtpipe.pipeline.trainers.Trainer.config_file`, and
  ``base.yml``): ``weight_dtype`` for params, ``mu_dtype`` (empty: the weights') for Adam's first
  moment, the weights' dtype for the second.
* **Checkpoints**: one every ``checkpoint_period`` steps plus the last (the command line's, else the
  config files'); Orbax keeps
  ``max_num_checkpoints_to_keep`` and deletes an older one only after the newer is committed, so a
  run directory peaks at ``min(saves, kept + 1)`` checkpoints.
* **Where**: run directories on the boot disk (the checkout's ``work/``), in ``MTPIPE_WORK_DIR``
  (``/dev/shm/...``: tmpfs, which is host memory) or in ``MTPIPE_WORK_BUCKET``; everything else on
  the boot disk. DVC's cache links outputs (``cache.type`` hardlink: no second copy) or copies them.

Capacities of the machine are :func:`host_of` with their sources, or what the VM itself says after
its setup (``Machine.host``, read by mtpipe.cloud.checks.host); :func:`check` refuses a plan that leaves
less than :data:`MARGIN` of a file system or of host memory free, naming the key to change.
docs/machine-budget.md says which number is measured, compiled or estimated.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from importlib import util
from pathlib import Path
from typing import Any

import yaml

from mtpipe.errors import ConfigError
from mtpipe.maxtext import commands, training_commands
from mtpipe.maxtext.run_dir import WORK_BUCKET_ENV, WORK_DIR_ENV
from mtpipe.pipeline.trainers import BY_MODULE, in_branch
from mtpipe.pipeline import generations
from mtpipe.pipeline.stage_table import BRANCH_STAGES, address
from mtpipe.pipeline.view import ROOT, View
from mtpipe.planning.aot import run_steps, trainer_of

GIB = 2**30
GB = 10**9


@dataclass(frozen=True)
class Host:
    """What a TPU VM has of its host: Google's VM-type table, or what was read on the VM."""

    memory_gib: float     # the VM's RAM
    shm_gib: float        # /dev/shm (tmpfs), which takes its pages from that memory
    source: str
    # bytes of run directories earlier runs left, by place (BOOT, SHM), read on the VM; none on a new one
    left: dict[str, int] = field(default_factory=dict)


def host_of(topology: str) -> Host | None:
    """The VM's RAM and /dev/shm of MaxText's ``topology`` (v6e-8) as Google's VM-type tables give them
    (conf/generations.yaml host_ram_gb, GB: 10^9 B, the smaller reading; the VM itself is read after the
    setup, mtpipe.cloud.checks.host); None where the table has no figure. /dev/shm: Linux mounts tmpfs at
    half of RAM unless told otherwise (mount(8), tmpfs "size"); the TPU image is assumed to set no other
    size, and the VM says."""
    gen, chips = generations.of_accelerator(topology)
    ram_gb = gen.host_ram_gb.get(chips)
    if ram_gb is None:
        return None
    return Host(memory_gib=ram_gb * 1e9 / 2**30, shm_gib=ram_gb * 1e9 / 2**30 / 2,
                source=f"Google's VM types: {gen.machine_type(chips)}, {ram_gb:,} GB of RAM; tmpfs default: half of RAM")


@dataclass(frozen=True)
class HubModel:
    """A Hub model's size, from its ``model.safetensors.index.json`` (tests/fixtures/ pins both)."""

    total_bytes: int          # the index's metadata.total_size: every safetensors file
    lm_params: int            # the language model's parameters (what MaxText converts with use_multimodal=false)
    lm_arrays: int            # arrays MaxText stores for them (:func:`maxtext_arrays`)
    other_files_bytes: int    # config, tokenizer and chat template files (estimated from the Hub listing)


HUB_MODELS = {
    "google/gemma-3-4b-it": HubModel(8_600_158_944, 3_880_263_168, 132, 40_000_000),
    "meta-llama/Llama-3.1-8B-Instruct": HubModel(16_060_522_496, 8_030_261_248, 12, 20_000_000),
}
# Parquet files hf_download fetches (allow_patterns of conf/dataset/*.yaml), estimated from the
# Hub's listing: UltraChat 200k train_sft + test_sft, GSM8K main train + test.
HUB_DATASETS = {"HuggingFaceH4/ultrachat_200k": 1_100_000_000, "openai/gsm8k": 3_000_000}

# Assumptions (estimated): each one lands in the report.
MARGIN = 0.10                    # what a file system or the host memory must keep free
ARRAY_OVERHEAD_BYTES = 4096      # per stored array: its directory, .zarray and array metadata (3.8 KB measured)
ENVIRONMENT_GB = 30.0            # the TPU image (~10 GB used) + the VM's venv (MaxText, vLLM, tpu-inference) + uv cache
LOGS_GB = 2.0                    # stage logs, tensorboard, an xplane profile, the JAX compile cache
PROCESS_BASE_GB = 4.0            # a MaxText/vLLM process before it holds a model (imports, JAX, libtpu)
LAYER = re.compile(r"layers\.(\d+)\.")
SCAN_BLOCK = {"gemma3": 6}      # MaxText's gemma3 decoder scans blocks of 6 layers (5 local + 1 global)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "F32": 4, "BF16": 2, "F16": 2}
BOOT, SHM, BUCKET = "boot disk", "/dev/shm", "work bucket"
LEFT_BEHIND = "left behind"  # the plan's first "stage": what earlier runs left on the VM


@dataclass(frozen=True)
class Model:
    """What a branch's model weighs: the download, and the language model MaxText converts and trains."""

    files_bytes: int         # everything hf_download writes for the model
    lm_params: int
    lm_arrays: int
    lm_dtype_bytes: int      # the source dtype: the converted checkpoint keeps it
    other_tensor_bytes: int  # tensors outside the language model (vision tower): copied into the export


@dataclass
class Item:
    """Bytes one stage writes and keeps (or holds while it runs: ``transient``)."""

    stage: str
    what: str
    where: str
    bytes: int
    transient: bool = False


@dataclass
class Plan:
    """Every item of a run, in stage order, and the peaks they add up to."""

    items: list[Item] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)   # stage -> host bytes of its process(es)
    state_keys: list[str] = field(default_factory=list)    # the keys that size the run directories

    def peaks(self) -> dict[str, int]:
        """Peak bytes per file system: while a stage runs, what earlier stages kept plus its transient
        bytes (a run directory); once it ends, plus what it keeps (its output)."""
        kept: dict[str, int] = {}
        peak: dict[str, int] = {}
        for stage in dict.fromkeys(i.stage for i in self.items):
            now = [i for i in self.items if i.stage == stage]
            for i in now:
                if i.transient:
                    peak[i.where] = max(peak.get(i.where, 0), kept.get(i.where, 0) + sum(
                        j.bytes for j in now if j.transient and j.where == i.where))
            for i in now:
                if not i.transient:
                    kept[i.where] = kept.get(i.where, 0) + i.bytes
            for where, total in kept.items():
                peak[where] = max(peak.get(where, 0), total)
        return peak

    def memory_peak(self) -> tuple[int, str]:
        """Host memory: the largest stage's processes plus what /dev/shm holds while it runs (its run
        directory, and what earlier runs left there)."""
        left = sum(i.bytes for i in self.items if i.stage == LEFT_BEHIND and i.where == SHM)
        shm = {stage: left + sum(i.bytes for i in self.items if i.stage == stage and i.where == SHM)
               for stage in self.memory}
        stage = max(self.memory, key=lambda s: self.memory[s] + shm[s])
        return self.memory[stage] + shm[stage], stage


# ---------------------------------------------------------------- sizes


def safetensors_inventory(files: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of every tensor in the ``*.safetensors`` of ``files`` (headers only)."""
    tensors: dict[str, tuple[str, list[int]]] = {}
    for path in sorted(files.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        tensors |= {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}
    return tensors


def is_language_model(name: str) -> bool:
    """Whether MaxText converts this tensor with ``use_multimodal=false`` (gemma3: not the vision tower)."""
    return not name.startswith(("vision_tower.", "multi_modal_projector."))


def maxtext_arrays(names: list[str], maxtext_name: str) -> int:
    """Arrays a scanned MaxText checkpoint stores for these HF tensors: one per tensor outside the
    layers; per kind of layer tensor (``layers.N.<kind>``), one stack per position of the scanned
    block (:data:`SCAN_BLOCK`: gemma3 scans blocks of 6 layers) plus one per remainder layer."""
    layers: dict[str, set[int]] = {}
    others = 0
    for name in names:
        m = LAYER.search(name)
        if m:
            layers.setdefault(name[m.end():], set()).add(int(m[1]))
        else:
            others += 1
    block = next((n for prefix, n in SCAN_BLOCK.items() if maxtext_name.startswith(prefix)), 0)
    count = len(next(iter(layers.values()), ()))
    positions = (block if count >= block else 0) + count % block if block else 1
    return others + len(layers) * positions


def tree_bytes(path: Path) -> int:
    """``du -sb``: the apparent size of every file and directory under ``path``."""
    total = path.lstat().st_size
    for dirpath, dirnames, filenames in os.walk(path):
        total += sum(os.lstat(os.path.join(dirpath, n)).st_size for n in dirnames + filenames)
    return total


def model_size(cfg: View, root: Path = ROOT) -> Model:
    """The model of a branch: measured from a local source's files, else from :data:`HUB_MODELS`."""
    source = cfg.model.source
    if source.kind == "local":
        files = root / source.path
        tensors = safetensors_inventory(files)
        lm = {k: v for k, v in tensors.items() if is_language_model(k)}
        other = {k: v for k, v in tensors.items() if not is_language_model(k)}
        dtypes = {dtype for dtype, _ in lm.values()}
        return Model(files_bytes=tree_bytes(files), lm_params=sum(math.prod(s) for _, s in lm.values()),
                     lm_arrays=maxtext_arrays(list(lm), cfg.model.maxtext_name),
                     lm_dtype_bytes=max(DTYPE_BYTES[d] for d in dtypes),
                     other_tensor_bytes=sum(math.prod(s) * DTYPE_BYTES[d] for d, s in other.values()))
    if source.repo_id not in HUB_MODELS:
        raise ConfigError(f"{cfg.branch}.model", f"the budget knows no size for {source.repo_id}",
                          "add its safetensors index's total_size and language-model parameters to "
                          "mtpipe/planning/budget.py HUB_MODELS")
    hub = HUB_MODELS[source.repo_id]
    lm_bytes = hub.lm_params * 2  # the Hub checkpoints are bf16
    return Model(files_bytes=hub.total_bytes + hub.other_files_bytes, lm_params=hub.lm_params,
                 lm_arrays=hub.lm_arrays, lm_dtype_bytes=2, other_tensor_bytes=hub.total_bytes - lm_bytes)


def dataset_bytes(cfg: View, root: Path = ROOT) -> int:
    """What hf_download writes for the dataset: a local source's files, else :data:`HUB_DATASETS`."""
    source = cfg.dataset.source
    if source.kind == "local":
        return tree_bytes(root / source.path)
    return HUB_DATASETS.get(source.repo_id, 0)


def maxtext_value(cmd: commands.MaxTextCommand, key: str) -> Any:
    """``key`` as the trainer sees it: the command line, else its config file, else the file that one
    is based on (sft.yml: base.yml; rl.yml stands alone); None when none sets it (or sets MaxText's
    ``None``)."""
    for arg in reversed(cmd.args):
        name, _, value = arg.partition("=")
        if name == key:
            return _null(yaml.safe_load(value))
    configs = Path(util.find_spec("maxtext").submodule_search_locations[0]) / "configs"
    path = configs / BY_MODULE[cmd.module].config_file
    while True:
        values = yaml.safe_load(path.read_text())
        if key in values:
            return _null(values[key])
        if "base_config" not in values:
            return None
        path = configs / values["base_config"]


def _null(value: Any) -> Any:
    """MaxText's YAML spells null ``None`` (base.yml: ``max_num_checkpoints_to_keep: None``)."""
    return None if value == "None" else value


def saves(steps: int, period: int) -> int:
    """Checkpoints a run writes: Orbax saves the first step (no checkpoint yet), then every ``period``
    steps, then the last step (measured: checkpoints 1, 50, 100, 150 of a 150-step run)."""
    return (1 if period > 1 else 0) + steps // period + (1 if steps % period else 0)


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Placement:
    """Where a run's training state lives (conf/vm.yaml's ``run.env`` on the VM)."""

    run_dirs: str             # BOOT, SHM or BUCKET
    dvc_links: bool           # the DVC cache links outputs (hardlink/symlink/reflink) instead of copying

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Placement:
        """From the VM's environment (the bucket wins over MTPIPE_WORK_DIR: mtpipe/maxtext/run_dir.py;
        a work dir outside /dev/shm counts as the boot disk) and the committed DVC config, which the
        VM's clone has."""
        if env.get(WORK_BUCKET_ENV, "").strip():
            where = BUCKET
        elif env.get(WORK_DIR_ENV, "").strip().startswith("/dev/shm"):
            where = SHM
        else:
            where = BOOT
        return cls(where, dvc_links=dvc_cache_links())


def dvc_cache_links(root: Path = ROOT) -> bool:
    """Whether .dvc/config's first cache type links (no second copy of an output)."""
    config = root / ".dvc" / "config"
    text = config.read_text() if config.is_file() else ""
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "type":
            return value.strip().strip('"').split(",")[0].strip() in ("hardlink", "symlink", "reflink")
    return False


def training(name: str, cmd: commands.MaxTextCommand, model: Model, compiled: dict | None, steps: int,
             place: Placement) -> tuple[Item, int, int]:
    """A training stage's run directory at its peak: (item, parameters, bytes per parameter of the
    trained weights). The final params leave it for the boot disk (a rename there, else a copy).
    Parameters and weight dtype: the compiled train state's when ``compiled``, else the model's and
    the command's ``weight_dtype``; checkpoints: the command's ``checkpoint_period`` and
    ``max_num_checkpoints_to_keep``."""
    if compiled:
        params, weight = compiled["param_count"], compiled["param_bytes"] // compiled["param_count"]
    else:
        params, weight = model.lm_params, DTYPE_BYTES[str(maxtext_value(cmd, "weight_dtype"))]
    mu = DTYPE_BYTES.get(str(maxtext_value(cmd, "mu_dtype") or ""), weight)
    arrays = model.lm_arrays * ARRAY_OVERHEAD_BYTES
    checkpoint = params * (weight + mu + weight) + 3 * arrays  # model_params + Adam's mu and nu
    written = saves(steps, int(maxtext_value(cmd, "checkpoint_period")))
    kept = maxtext_value(cmd, "max_num_checkpoints_to_keep")
    held = written if kept is None else min(written, int(kept) + 1)
    item = Item(name, f"run directory: {held} of {written} checkpoints x {checkpoint / GB:.2f} GB",
                place.run_dirs, held * checkpoint, transient=True)
    return item, params, weight


def plan(views: dict[str, dict[str, View]], place: Placement, compiled: dict[str, dict] | None = None,
         root: Path = ROOT, left: dict[str, int] | None = None) -> Plan:
    """The budget of the branches in ``views`` (branch -> stage -> view), run one after the other, on a VM
    where earlier runs left ``left`` bytes of run directories per place (:attr:`Host.left`): they stay
    through the whole run."""
    p = Plan()
    p.items += [Item(LEFT_BEHIND, "run directories of earlier runs (read on the VM; `python -m "
                     "mtpipe.maxtext.collect_runs --delete` there removes those no recipe names)", where, size)
                for where, size in (left or {}).items() if size]
    p.items.append(Item("environment", "TPU image + venv + uv cache (estimated)", BOOT, int(ENVIRONMENT_GB * GB)))
    p.items.append(Item("environment", "logs, tensorboard, profile, JAX cache (estimated)", BOOT, int(LOGS_GB * GB)))
    dvc = 1 if place.dvc_links else 2
    for branch, stages in views.items():
        cfg = stages["hf_download"]
        model = model_size(cfg, root)
        data = dataset_bytes(cfg, root)
        p.items.append(Item(f"hf_download@{branch}", "model files + dataset", BOOT, dvc * (model.files_bytes + data)))
        arrays = model.lm_arrays * ARRAY_OVERHEAD_BYTES
        converted = model.lm_params * model.lm_dtype_bytes + arrays
        p.items.append(Item(f"to_maxtext@{branch}", "converted checkpoint", BOOT, dvc * converted))
        p.memory[f"to_maxtext@{branch}"] = int(PROCESS_BASE_GB * GB + 2 * converted)
        params, weight = model.lm_params, model.lm_dtype_bytes
        for trainer in in_branch(tuple(stages)):
            view = stages[trainer.stage]
            steps = getattr(getattr(view, trainer.stage), trainer.steps_key)
            if not steps:   # an RL warm-up of 0 steps: skipped
                continue
            cmd = training_commands.placeholder_command(view, trainer)
            # the compile is of the branch's last training stage (the SFT warm-up of rl has none)
            mine = (compiled or {}).get(branch) if trainer == trainer_of(branch) else None
            name = address(trainer.stage, branch)
            run, params, weight = training(name, cmd, model, mine, run_steps(mine, cmd.args) if mine else steps, place)
            p.items.append(run)
            p.items.append(Item(name, "final params", BOOT, dvc * (params * weight + arrays)))
            p.memory[name] = int(PROCESS_BASE_GB * GB + converted)
        export_dtype = DTYPE_BYTES[stages["to_huggingface"].to_huggingface.weight_dtype]
        export = params * export_dtype + model.other_tensor_bytes + _other_files(cfg, root)
        p.items.append(Item(f"to_huggingface@{branch}", "export (safetensors + tokenizer)", BOOT, dvc * export))
        p.memory[f"to_huggingface@{branch}"] = int(PROCESS_BASE_GB * GB + params * (weight + export_dtype))
        p.memory[f"evaluate@{branch}"] = int(PROCESS_BASE_GB * GB + export)  # the model server loads the export
        # evaluate_warmup exports the warm-up, scores it, deletes it
        if "evaluate_warmup" in BRANCH_STAGES[branch] and stages["train_sft"].train_sft.steps:
            p.items.append(Item("evaluate_warmup", "the warm-up's export, while it is scored", BOOT, export,
                                transient=True))
            p.memory["evaluate_warmup"] = p.memory[f"to_huggingface@{branch}"]
        p.state_keys += _state_keys(branch, stages)
    return p


def _other_files(cfg: View, root: Path) -> int:
    """The export's non-weight files (config, tokenizer, chat template): the source's."""
    if cfg.model.source.kind == "local":
        files = root / cfg.model.source.path
        return sum(f.stat().st_size for f in files.iterdir() if f.is_file() and f.suffix != ".safetensors")
    return HUB_MODELS[cfg.model.source.repo_id].other_files_bytes


def _state_keys(branch: str, stages: dict[str, View]) -> list[str]:
    """The keys that size a branch's run directories: those of each training stage that runs."""
    return [f"{branch}.{t.stage}.{key}" for t in in_branch(tuple(stages))
            if getattr(getattr(stages[t.stage], t.stage), t.steps_key) for key in t.checkpoint_keys]


# ---------------------------------------------------------------- capacity


@dataclass(frozen=True)
class Machine:
    """What the budget reads of conf/vm.yaml: the boot disk's size, the run's environment and the TPU
    its machine type holds, as MaxText names it (``v6e-8``; None: not said); ``host``: the VM's RAM and
    /dev/shm as read on it (None: :func:`host_of`)."""

    boot_disk_gb: int
    env: dict[str, str]
    tpu: str | None = None
    host: Host | None = None


def capacities(host: Host, boot_disk_gb: int) -> dict[str, float]:
    """Bytes each place holds on the VM: the boot disk (conf/vm.yaml), /dev/shm and host memory."""
    return {BOOT: boot_disk_gb * GB, SHM: host.shm_gib * GIB, "host memory": host.memory_gib * GIB}


def report(p: Plan, topology: str, boot_disk_gb: int, host: Host) -> dict[str, Any]:
    """Peaks next to capacities, each with its fit (``need x (1 + MARGIN) <= capacity``)."""
    cap = capacities(host, boot_disk_gb)
    peaks = p.peaks()
    memory, stage = p.memory_peak()
    rows = {where: {"peak_gb": round(peaks.get(where, 0) / GB, 2), "capacity_gb": round(cap[where] / GB, 1),
                    "fits": peaks.get(where, 0) * (1 + MARGIN) <= cap[where]} for where in (BOOT, SHM)}
    rows["host memory"] = {"peak_gb": round(memory / GB, 2), "capacity_gb": round(cap["host memory"] / GB, 1),
                           "fits": memory * (1 + MARGIN) <= cap["host memory"], "during": stage}
    if BUCKET in peaks:
        rows[BUCKET] = {"peak_gb": round(peaks[BUCKET] / GB, 2), "capacity_gb": None, "fits": True}
    return {"topology": topology, "places": rows, "margin": MARGIN, "source": host.source,
            "items": [{"stage": i.stage, "what": i.what, "where": i.where, "gb": round(i.bytes / GB, 3),
                       "transient": i.transient} for i in p.items],
            "assumptions": {"environment_gb": ENVIRONMENT_GB, "logs_gb": LOGS_GB, "process_base_gb": PROCESS_BASE_GB,
                            "array_overhead_bytes": ARRAY_OVERHEAD_BYTES}}


def check(p: Plan, rep: dict[str, Any], place: Placement) -> None:
    """Raise ConfigError naming the key to change when a place does not fit with :data:`MARGIN` to spare."""
    state = p.state_keys
    for where, row in rep["places"].items():
        if row["fits"]:
            continue
        if where == BOOT:
            keys = (state + ["run.env.MTPIPE_WORK_DIR or MTPIPE_WORK_BUCKET (conf/vm.yaml: where run directories "
                             "live)"] if place.run_dirs == BOOT else []) + ["boot_disk_gb (conf/vm.yaml)"]
        else:
            keys = state + ["run.env.MTPIPE_WORK_BUCKET (conf/vm.yaml: run directories in a bucket)"]
        largest = sorted((i for i in p.items if i.where == where), key=lambda i: -i.bytes)[:3]
        parts = (f"during {row['during']}" if where == "host memory" else
                 "; ".join(f"{i.stage}: {i.what}, {i.bytes / GB:.0f} GB" for i in largest))
        source = "" if where == BOOT else f" ({rep['source']})"
        larger_shm = (", or a larger /dev/shm (a setup command: sudo mount -o remount,size=SIZE /dev/shm)"
                      if where == SHM else "")
        raise ConfigError(keys[0], f"the run needs {row['peak_gb']:.0f} GB of the {rep['topology']} VM's {where} "
                          f"at its peak, which holds {row['capacity_gb']:.0f} GB{source} and must keep {MARGIN:.0%} "
                          f"free (largest parts: {parts})",
                          f"change one of {', '.join(keys)}{larger_shm}; `doit preflight --set ...` checks it in "
                          "seconds")


def table(rep: dict[str, Any]) -> str:
    """The places as a fixed-width table: peak / capacity, fits."""
    lines = [("place", "peak GB", "capacity GB", "fits")]
    for where, row in rep["places"].items():
        cap = "-" if row["capacity_gb"] is None else f"{row['capacity_gb']:.0f}"
        lines.append((where + (f" (during {row['during']})" if "during" in row else ""), f"{row['peak_gb']:.1f}", cap,
                      "yes" if row["fits"] else "NO"))
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in lines)
