"""The runner: progress lines from MaxText's log, secrets redacted, failures loud."""

import sys
from pathlib import Path

import pytest

from mtpipe.maxtext import runner
from mtpipe.maxtext.commands import MaxTextCommand

LINE = ("I1129 completed step: 40, seconds: 0.131, TFLOP/s/device: 0.012, Tokens/s/device: 3907.5, "
        "total_weights: 512, loss: 2.103, lm_loss: 2.103, perplexity: 8.19")


def test_step_line_is_parsed_with_tokens_per_second():
    match = runner.STEP_LINE.search(LINE)
    assert (match["step"], match["loss"], match["tps"]) == ("40", "2.103", "3907.5")
    line = runner.format_progress(40, 150, match["loss"], match["tps"], elapsed=20.0, first_step=0)
    assert line == "  step 40/150  loss 2.103  tokens/s/device 3908  ETA 0:55"


def test_the_child_gets_no_token_and_the_log_masks_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    script = tmp_path / "fake_maxtext.py"
    script.write_text("import os; print('child has', os.environ.get('HF_TOKEN')); print('echo hf_abcdefghijklmnop');"
                      " print(%r)" % LINE)
    cmd = MaxTextCommand("fake", [])
    monkeypatch.setattr(MaxTextCommand, "argv", lambda self: [sys.executable, str(script)])
    runner.run(cmd, tmp_path / "log.txt", total_steps=150)
    log, out = (tmp_path / "log.txt").read_text(), capsys.readouterr().out
    assert "hf_abcdefghijklmnop" not in log + out
    assert "child has None" in log and "echo <HF_TOKEN>" in log
    assert "step 40/150  loss 2.103  tokens/s/device 3908" in out


def test_a_failing_tool_fails_the_stage(tmp_path, monkeypatch):
    script = tmp_path / "boom.py"
    script.write_text("import sys; print('Traceback: boom'); sys.exit(3)")
    monkeypatch.setattr(MaxTextCommand, "argv", lambda self: [sys.executable, str(script)])
    with pytest.raises(runner.MaxTextFailed, match="exited with 3"):
        runner.run(MaxTextCommand("fake", []), tmp_path / "log.txt")
    assert "# exit 3" in Path(tmp_path / "log.txt").read_text()
