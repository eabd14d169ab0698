"""Code fingerprints (mtpipe/pipeline/fingerprint.py): what cannot change a result leaves them alone,
everything else moves them, and a stage refuses a view written for other code."""

import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import families
from mtpipe.data import embedded
from mtpipe.errors import ConfigError
from mtpipe.pipeline import config, fingerprint, view

pytestmark = pytest.mark.architecture

MODULE = '''"""A module."""

import os

LIMIT = 3  # a constant


class Loader:
    """Loads."""

    def load(self, path, retries=2):
        """Load ``path``."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: run `make` first")
        assert retries >= 0, "retries must not be negative"
        print("loading", path)
        return open(path).read()
'''


def fp(source: str) -> str:
    return fingerprint.source_fingerprint(source)


@pytest.mark.parametrize(("old", "new"), [
    ('"""A module."""', '"""Another summary of the module."""'),
    ('"""Load ``path``."""', '"""Read the file at ``path``."""'),
    ("# a constant", "# how many, at most"),
    ("LIMIT = 3", "LIMIT = 3\n\n\n# a comment block\n"),
    ('f"{path} is missing: run `make` first"', 'f"no file at {path!r}; `make` writes it"'),
    ('"retries must not be negative"', 'f"retries: {retries} < 0"'),
    ("        return open", "\n        return open"),
], ids=["module_docstring", "method_docstring", "comment", "blank_lines", "error_message", "assert_message",
        "layout"])
def test_what_cannot_change_a_result_keeps_the_fingerprint(old, new):
    assert old in MODULE
    assert fp(MODULE.replace(old, new)) == fp(MODULE)


@pytest.mark.parametrize(("old", "new"), [
    ("LIMIT = 3", "LIMIT = 4"),
    ("retries=2", "retries=3"),
    ('print("loading", path)', 'print("reading", path)'),
    ("FileNotFoundError", "RuntimeError"),
    ("import os\n", "import os\nimport sys\n"),
    ("retries >= 0", "retries > 0"),
], ids=["constant", "default", "log_line", "exception_type", "import", "assert_condition"])
def test_a_change_of_behaviour_moves_the_fingerprint(old, new):
    assert old in MODULE
    assert fp(MODULE.replace(old, new)) != fp(MODULE)


MESSAGES = '''import sys
import warnings

from mtpipe.errors import ConfigError


def describe(low):
    return f"at least {low}" if low else "any number"


def check(cfg, errors):
    def add(key, problem, fix):
        errors.append(ConfigError(key, problem, fix))

    fix = "set steps: 10 in " + "params.yaml"
    if cfg.steps < 1:
        add("steps", f"is {cfg.steps}, but nothing trains", fix)
    if cfg.steps > 9:
        errors.append(ConfigError("steps", "is " + describe(9), fix))
        warnings.warn("many steps: %d" % cfg.steps, UserWarning)
    if not errors:
        return 0
    sys.exit(f"{len(errors)} problems")
'''


@pytest.mark.parametrize(("old", "new"), [
    ('f"is {cfg.steps}, but nothing trains"', '"has to be positive"'),
    ('"set steps: 10 in " + "params.yaml"', '"steps: 10 (params.yaml)"'),
    ('"is " + describe(9)', '"must be " + describe(9)'),
    ('"any number"', '"whatever you like"'),
    ('"many steps: %d"', '"a long run: %d steps"'),
    ('f"{len(errors)} problems"', 'f"stopped: {len(errors)} problems"'),
], ids=["message_helper", "message_variable", "exception_not_raised", "message_function", "warning", "exit"])
def test_message_text_however_it_is_built_keeps_the_fingerprint(old, new):
    assert old in MESSAGES
    assert fp(MESSAGES.replace(old, new)) == fp(MESSAGES)


@pytest.mark.parametrize(("old", "new"), [
    ("cfg.steps < 1", "cfg.steps < 2"),
    ("return 0", "return 1"),
    ('sys.exit(f"{len(errors)} problems")', "sys.exit(len(errors))"),
], ids=["condition", "result", "exit_status"])
def test_what_messages_depend_on_still_counts(old, new):
    assert old in MESSAGES
    assert fp(MESSAGES.replace(old, new)) != fp(MESSAGES)


@pytest.mark.address
@pytest.mark.parametrize("helper", ["add", "append", "get"])
def test_a_method_named_like_a_message_helper_is_not_message_text(helper):
    """A module whose message helper is named like a common method: the helper's text is wording, the
    same name called as a method (a set's add, a list's append, a dict's get) computes a result."""
    source = f'''from mtpipe.errors import ConfigError


def check(cfg, errors, seen, table):
    def {helper}(key, problem):
        errors.append(ConfigError(key, problem, "fix it"))

    if cfg.backend in seen:
        {helper}("backend", "is listed twice")
    seen.{helper}("xpk")
    return table.{helper}("local")
'''
    assert fp(source.replace('"is listed twice"', '"appears twice"')) == fp(source)
    assert fp(source.replace(f'seen.{helper}("xpk")', f'seen.{helper}("local")')) != fp(source)
    assert fp(source.replace(f'table.{helper}("local")', f'table.{helper}("xpk")')) != fp(source)


def test_an_exit_status_is_not_a_message():
    """``sys.exit(main())`` passes main's result on: main is not wording."""
    source = "import sys\n\ndef main():\n    return 1\n\nsys.exit(main())\n"
    assert fp(source.replace("return 1", "return 2")) != fp(source)


@pytest.mark.parametrize(("module", "old", "new"), [
    ("rules", '"is missing for a kind: hub source"', '"must name the Hub repository"'),
    ("rules", 'f"needs held-out prompts, but dataset {', 'f"has no prompts to test on: dataset {'),
    ("rules", '"(one replica on all chips)"', '"(a single replica)"'),
    ("schema", 'means="a 40-hex commit sha"', 'means="a full commit hash (40 hex digits)"'),
    ("schema", 'return f"a list of {', 'return f"a YAML list of {'),
], ids=["combination_rule", "combination_rule_fstring", "message_variable", "words", "description"])
def test_rewording_a_schema_message_keeps_its_fingerprint(module, old, new):
    """The configuration's wording is message text: the combination rules (``add(...)``, rules.py, which
    only configure runs), and in schema.py, which every stage runs, the wording of its keys (``Words``)
    and its descriptions of types and ranges."""
    source = (view.ROOT / "mtpipe" / "pipeline" / f"{module}.py").read_text()
    assert old in source
    assert fp(source.replace(old, new)) == fp(source)


def test_a_view_written_for_other_code_is_refused(tmp_path: Path):
    """`python -m stages.X` (or `dvc repro -s`) after a code edit, without configure: the stage stops
    before any work and names the module and the fix."""
    config.write_resolved(config.compose_all(families.load_params()), config.twin_confs(embedded.FAMILIES), tmp_path)
    path = view.resolved_path("sft", "to_huggingface", tmp_path)
    cfg = OmegaConf.load(path)
    backends = view.backends(OmegaConf.to_container(cfg))
    assert view.load_stage("sft", "to_huggingface", tmp_path).code == fingerprint.stage_code("to_huggingface",
                                                                                            backends=backends)
    cfg.code["mtpipe/maxtext/commands.py"] = "0" * 16
    OmegaConf.save(cfg, path)
    with pytest.raises(ConfigError, match=r"views/sft/to_huggingface.yaml: was written for other code "
                                          r"\(changed: mtpipe/maxtext/commands.py\).*dvc repro"):
        view.load_stage("sft", "to_huggingface", tmp_path)


def test_the_committed_views_hold_the_fingerprints_of_the_committed_code(tmp_path: Path):
    """configure would write views/ as committed: no stage runs under another code's address."""
    config.write_resolved(config.compose_all(families.load_params()), config.twin_confs(embedded.FAMILIES), tmp_path)
    for path in sorted((tmp_path / "views").rglob("*.yaml")):
        committed = config.ROOT / path.relative_to(tmp_path)
        assert path.read_text() == committed.read_text(), f"{committed}: run `dvc repro configure` and commit"


def test_a_module_that_is_imported_late_is_found(tmp_path: Path):
    """Imports inside functions count: the module runs when the function does."""
    shutil.copytree(config.ROOT / "mtpipe", tmp_path / "mtpipe")
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "late.py").write_text("def main():\n    from mtpipe.data import hub\n")
    assert "mtpipe/data/hub.py" in fingerprint.stage_modules("late", tmp_path)


@pytest.mark.address
def test_a_child_process_a_stage_starts_is_in_its_code(tmp_path: Path):
    """A new `python -m <module>` a stage starts is in the stage's code without a list to update; with
    a backend that does not start it (BACKEND_MODULES), it is left out like a late import."""
    shutil.copytree(config.ROOT / "mtpipe", tmp_path / "mtpipe")
    (tmp_path / "mtpipe" / "data" / "child.py").write_text("from mtpipe.data import hub\n")
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "parent.py").write_text(
        "import subprocess, sys\n\ndef main():\n"
        '    subprocess.run([sys.executable, "-m", "mtpipe.data.child"], check=True)  # mtpipe.data.publish\n')
    found = fingerprint.stage_modules("parent", tmp_path)
    assert {"mtpipe/data/child.py", "mtpipe/data/hub.py"} <= set(found)
    assert "mtpipe/data/publish.py" not in found  # named in a comment only
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as m:
        m.setitem(fingerprint.BACKEND_MODULES, "parent.backend", {"other": ("mtpipe/data/child.py",)})
        assert "mtpipe/data/child.py" not in fingerprint.stage_modules("parent", tmp_path, backends={})


@pytest.mark.address
def test_a_module_that_only_checks_is_in_no_stages_code(tmp_path: Path):
    """A module declaring ``ADDRESS_EXEMPT`` is left out of a stage's code with what only it imports; a module
    the stage also imports another way stays in."""
    shutil.copytree(config.ROOT / "mtpipe", tmp_path / "mtpipe")
    (tmp_path / "mtpipe" / "data" / "guard.py").write_text(
        'ADDRESS_EXEMPT = "refuses bad input"\nfrom mtpipe.data import hub, publish\n')
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "guarded.py").write_text("from mtpipe.data import guard, hub\n")
    found = set(fingerprint.stage_modules("guarded", tmp_path))
    assert "mtpipe/data/hub.py" in found
    assert not {"mtpipe/data/guard.py", "mtpipe/data/publish.py"} & found
    (tmp_path / "mtpipe" / "data" / "guard.py").write_text("from mtpipe.data import hub, publish\n")
    assert {"mtpipe/data/guard.py", "mtpipe/data/publish.py"} <= set(fingerprint.stage_modules("guarded", tmp_path))


@pytest.mark.address
def test_each_stage_runs_only_its_own_configuration_and_patches():
    """configure's code (composition, presets, the cross-key rules) is in no other stage's address; the
    address's own checks (fingerprints, tool versions) are in none; a converter holds no training patch and
    a trainer no conversion patch. The modules that declare themselves exempt are the two checks."""
    configure_only = {"mtpipe/pipeline/config.py", "mtpipe/pipeline/rules.py", "mtpipe/pipeline/maxtext_check.py"}
    checks = {"mtpipe/pipeline/fingerprint.py", "mtpipe/pipeline/toolchain.py"}
    assert {str(p.relative_to(config.ROOT)) for p in (config.ROOT / "mtpipe").rglob("*.py")
            if fingerprint.is_exempt(p)} == checks
    stages = [*config.BRANCH_STAGES["rl"], "make_embedded"]
    code = {stage: set(fingerprint.stage_modules(stage)) for stage in stages}
    for stage in stages:
        assert not (configure_only | checks) & code[stage], stage
        assert "mtpipe/pipeline/view.py" in code[stage]
    assert configure_only <= set(fingerprint.stage_modules("configure"))
    for converter in ("to_maxtext", "to_huggingface", "evaluate_warmup"):
        assert "mtpipe/maxtext/adapter/conversion.py" in code[converter]
        assert not {"mtpipe/maxtext/adapter/training.py", "mtpipe/maxtext/training_commands.py"} & code[converter]
    for trainer in ("train_sft", "train_rl"):
        assert "mtpipe/maxtext/adapter/training.py" in code[trainer]
        assert not {"mtpipe/maxtext/adapter/conversion.py", "mtpipe/maxtext/conversion_commands.py"} & code[trainer]
