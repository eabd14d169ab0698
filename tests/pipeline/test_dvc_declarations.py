"""dvc.yaml declares exactly what each stage reads: no hidden inputs, no spurious ones.

* code: the stage script plus every project module it imports (and, for stages that run MaxText,
  every module the child process `python -m mtpipe.maxtext.adapter.conversion` or `.training` imports)
  are fingerprinted in its view (mtpipe/pipeline/fingerprint.py), and no other module; configure depends on the code;
* config: a pipeline stage reads one resolved file, views/<branch>/<stage>.yaml, and declares it;
* params: `configure` declares every top-level key of params.yaml (it is the only reader).
"""

from modulefinder import ModuleFinder
from pathlib import Path

import pytest
import yaml
from dvc.repo import Repo

from mtpipe.pipeline import config, fingerprint
import families

ROOT = config.ROOT
# MaxText's child entry points per stage: the converters' adapter, or the trainers' and GRPO's CPU launcher
MAXTEXT_LAUNCHERS = {
    **dict.fromkeys(("to_maxtext", "to_huggingface", "evaluate_warmup"), ("adapter/conversion",)),
    **dict.fromkeys(("train_sft", "train_rl"), ("adapter/training", "launch_rl_cpu")),
}


def project_modules(script: Path) -> set[str]:
    """Project files a script imports, transitively (third-party modules are not followed)."""
    finder = ModuleFinder(path=[str(ROOT)])
    finder.run_script(str(script))
    return {
        str(Path(m.__file__).relative_to(ROOT))
        for m in finder.modules.values()
        if m.__file__ and Path(m.__file__).is_relative_to(ROOT) and Path(m.__file__) != script
    }


def dvc_stages() -> dict[str, object]:
    with Repo(str(ROOT)) as repo:
        return {stage.addressing: stage for stage in repo.index.stages}


STAGES = dvc_stages()


def deps_of(stage) -> set[str]:
    return {str(Path(d.def_path)) for d in stage.deps}


@pytest.mark.architecture
@pytest.mark.parametrize("name", sorted(STAGES))
def test_code_is_fingerprinted_not_declared(name):
    """A stage's code reaches DVC through the fingerprints in its view, never as .py deps; only
    configure (which writes the fingerprints) depends on the code, as whole directories."""
    stage = STAGES[name]
    script_name = name.split("@")[0]
    assert stage.cmd.startswith(f"exec python -m stages.{script_name}")  # exec: see docs/secrets.md
    if script_name == "configure":
        assert {"stages", "mtpipe", "conf"} <= deps_of(stage)
    else:
        assert not {d for d in deps_of(stage) if d.endswith(".py")}


@pytest.mark.architecture
@pytest.mark.parametrize("script_name", sorted({n.split("@")[0] for n in STAGES}))
def test_fingerprinted_modules_are_exactly_the_imported_ones(script_name):
    """The modules in a stage's fingerprints are what Python's ModuleFinder says the stage script
    imports, plus the child processes it can start (`python -m mtpipe.maxtext.adapter.conversion` for the
    converters, `python -m mtpipe.maxtext.adapter.training` for the trainers, or for GRPO on CPU
    `python -m mtpipe.maxtext.launch_rl_cpu`: MaxTextCommand's launchers; for the evaluations
    `python -m mtpipe.evaluation.server`; evaluate_warmup exports the warm-up with MaxText, then serves
    it), less the modules that only check (``ADDRESS_EXEMPT``: the fingerprints' and tool versions' checks,
    which import no project module of their own). Every backend counts here; the view's backends narrow
    it (the test below)."""
    expected = {f"stages/{script_name}.py"} | project_modules(ROOT / "stages" / f"{script_name}.py")
    for launcher in MAXTEXT_LAUNCHERS.get(script_name, ()):
        expected |= project_modules(ROOT / "mtpipe" / "maxtext" / f"{launcher}.py") | {f"mtpipe/maxtext/{launcher}.py"}
    if script_name in ("evaluate_base", "evaluate_warmup", "evaluate"):  # the CPU model server, `python -m mtpipe.evaluation.server`
        expected |= project_modules(ROOT / "mtpipe" / "evaluation" / "server.py") | {"mtpipe/evaluation/server.py"}
    expected -= {m for m in expected if fingerprint.is_exempt(ROOT / m)}
    found = set(fingerprint.stage_modules(script_name))
    assert found == expected, f"missing: {expected - found}, not used: {found - expected}"


@pytest.mark.parametrize("name", sorted(n for n in STAGES if n != "configure"))
def test_each_stage_declares_its_resolved_config(name):
    script_name, _, branch = name.partition("@")
    branch = branch or {"train_rl": "rl", "evaluate_warmup": "rl", "make_embedded": "embedded"}[script_name]
    source = (ROOT / "stages" / f"{script_name}.py").read_text()
    assert f'open_stage("{script_name}", ' in source or f'load_stage("{branch}", "{script_name}")' in source, \
        "the stage opens its own view: open_stage(stage, branch)"
    configs = {d for d in deps_of(STAGES[name]) if d.startswith("views/")}
    assert configs == {f"views/{branch}/{script_name}.yaml"}
    assert not STAGES[name].params, "pipeline stages read params only through their resolved view"


def test_configure_declares_every_params_key():
    params = yaml.safe_load(families.committed_params_text())
    declared = {p for dep in STAGES["configure"].deps for p in getattr(dep, "params", None) or []}
    assert declared == set(params)
    outs = {str(o.def_path) for o in STAGES["configure"].outs}
    assert outs == {f"views/{b}/{s}.yaml" for b, stages in config.BRANCH_STAGES.items() for s in stages} | {
        "views/{}/{}.yaml".format(*config.EMBEDDED_VIEW)} | {config.RUN_FILE}


def test_every_resolved_view_is_produced_and_consumed_and_the_run_keys_by_no_stage():
    """views/run.yaml holds what no output depends on: a stage that declared it would rerun for it."""
    produced = {str(o.def_path) for o in STAGES["configure"].outs}
    consumed = {d for s in STAGES.values() for d in deps_of(s) if d.startswith("views/")}
    assert consumed == produced - {config.RUN_FILE}


@pytest.mark.architecture
@pytest.mark.parametrize(("stage", "backends", "left_out"), [
    ("train_sft", {"hardware.backend": "local"}, {"mtpipe/training/xpk.py", "mtpipe/training/xpk_pod.py",
                                                  "mtpipe/training/image.py", "mtpipe/maxtext/launch_rl_cpu.py",
                                                  "mtpipe/maxtext/rollout_cpu.py"}),
    ("train_rl", {"hardware.backend": "local", "train_rl.rollout_backend": "vllm"},
     {"mtpipe/training/xpk.py", "mtpipe/training/xpk_pod.py", "mtpipe/training/image.py",
      "mtpipe/maxtext/launch_rl_cpu.py", "mtpipe/maxtext/rollout_cpu.py"}),
    ("evaluate", {"evaluate.backend": "vllm", "evaluate.task": "gsm8k_rl_format"},
     {"mtpipe/evaluation/server.py", "mtpipe/evaluation/numpy_forward.py"}),
    ("evaluate", {"evaluate.backend": "cpu", "evaluate.task": "gsm8k_cot_llama"}, {"mtpipe/data/gsm8k_chat.py"}),
], ids=["local_training", "vllm_rollouts", "vllm_server", "lm_eval_task"])
def test_only_the_backend_in_use_is_in_a_stages_code(stage, backends, left_out):
    """A backend's modules (and what only they import) are in the code of a stage whose view selects
    that backend, and only there: a GKE-only edit does not rerun CPU training."""
    every = set(fingerprint.stage_modules(stage))
    assert left_out <= every
    assert set(fingerprint.stage_modules(stage, backends=backends)) == every - left_out
    selected = {key: next(iter(fingerprint.BACKEND_MODULES[key])) for key in backends}  # the other backends
    assert {m for key, value in selected.items() for m in fingerprint.BACKEND_MODULES[key][value]} \
        <= set(fingerprint.stage_modules(stage, backends=selected))
