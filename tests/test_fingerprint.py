"""Code fingerprints (mtpipe/pipeline/fingerprint.py): what cannot change a result leaves them alone,
everything else moves them, and a stage refuses a view written for other code."""

import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mtpipe.errors import ConfigError
from mtpipe.pipeline import config, fingerprint

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


def test_a_view_written_for_other_code_is_refused(tmp_path: Path):
    """`python -m stages.X` (or `dvc repro -s`) after a code edit, without configure: the stage stops
    before any work and names the module and the fix."""
    config.write_resolved(config.load_params(), tmp_path)
    view = config.resolved_path("sft", "to_huggingface", tmp_path)
    assert config.load_stage("sft", "to_huggingface", tmp_path).code == fingerprint.stage_code("to_huggingface")
    cfg = OmegaConf.load(view)
    cfg.code["mtpipe/maxtext/commands.py"] = "0" * 16
    OmegaConf.save(cfg, view)
    with pytest.raises(ConfigError, match=r"config/sft/to_huggingface.yaml: was written for other code "
                                          r"\(changed: mtpipe/maxtext/commands.py\).*dvc repro"):
        config.load_stage("sft", "to_huggingface", tmp_path)


def test_the_committed_views_hold_the_fingerprints_of_the_committed_code(tmp_path: Path):
    """configure would write config/ as committed: no stage runs under another code's address."""
    config.write_resolved(config.load_params(), tmp_path)
    for path in sorted((tmp_path / "config").rglob("*.yaml")):
        committed = config.ROOT / path.relative_to(tmp_path)
        assert path.read_text() == committed.read_text(), f"{committed}: run `dvc repro configure` and commit"


def test_a_module_that_is_imported_late_is_found(tmp_path: Path):
    """Imports inside functions count: the module runs when the function does."""
    shutil.copytree(config.ROOT / "mtpipe", tmp_path / "mtpipe")
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "late.py").write_text("def main():\n    from mtpipe.data import hub\n")
    assert "mtpipe/data/hub.py" in fingerprint.stage_modules("late", tmp_path)
