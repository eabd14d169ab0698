"""The evaluate stages' parts on the CPU: the model server (as lm-eval and vLLM clients see it), GSM8K
through the real lm-eval on the pinned local files, held-out loss, the intervals, and the TPU commands.

The tiny twins come from mtpipe.data.embedded (random weights), so scores here are about mechanics:
the same numbers through every path, not what a trained model reaches (the pipeline tests score the
trained exports)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import jinja2
import numpy as np
import pyarrow.parquet as pq
import pytest

from mtpipe.data import embedded
from mtpipe.evaluation import gsm8k, heldout, numpy_forward, serving
from mtpipe.pipeline import stats
import families

pytestmark = pytest.mark.evaluate_publish


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama and Gemma twins and the embedded GSM8K and UltraChat files."""
    root = tmp_path_factory.mktemp("evaluate")
    families.twins()["llama3.1-tiny"].write(root / "llama")
    families.twins()["gemma3-tiny"].write(root / "gemma")
    embedded.write_gsm8k_tiny(root / "gsm8k", n_train=10, n_test=12)
    embedded.write_ultrachat_tiny(root / "ultrachat", n_train=10, n_test=12)
    return {"llama": root / "llama", "gemma": root / "gemma", "gsm8k": root / "gsm8k", "ultrachat": root / "ultrachat"}


@pytest.fixture(scope="module")
def llama_server(data):
    port = serving.free_port()
    command = serving.server_command("cpu", data["llama"], port, None)
    with serving.serving(command, port, data["llama"].parent / "server.log", timeout_s=600) as url:
        yield url


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with serving.open_loopback(request, timeout=120) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


@pytest.mark.families
@pytest.mark.parametrize("name", families.TWINS)
def test_cached_decoding_is_greedy_decoding_of_the_full_forward(name, tmp_path):
    """The KV cache: each generated token is the argmax of the full forward over everything before it
    (70 prompt tokens: past Gemma 3's 64-token window, which the cache must respect)."""
    hf_dir = tmp_path / name
    families.twins()[name].write(hf_dir)
    model = numpy_forward.Model(hf_dir)
    prompt = list(np.random.default_rng(0).integers(3, embedded.TINY_VOCAB, 70))
    generated = model.generate(prompt, 8)
    for i, token in enumerate(generated):
        assert token == int(np.argmax(numpy_forward.logits(hf_dir, prompt + generated[:i])[-1])), i


def test_the_server_answers_like_an_openai_completions_endpoint(data, llama_server):
    ids = [5, 9, 17, 33]
    status, body = post(llama_server, {"model": "m", "prompt": [ids, ids], "max_tokens": 5, "temperature": 0})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["text"] == body["choices"][1]["text"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    # echo + logprobs: each prompt token's log-probability, the numpy forward's
    status, body = post(llama_server, {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0})
    got = body["choices"][0]["logprobs"]["token_logprobs"]
    logits = numpy_forward.logits(data["llama"], ids)
    expected = [float(logits[i, ids[i + 1]] - np.log(np.exp(logits[i]).sum())) for i in range(len(ids) - 1)]
    assert got[0] is None and np.allclose(got[1:], expected, atol=1e-9)


@pytest.mark.parametrize("body", [{"prompt": [1, 2], "temperature": 0.7}, {"prompt": [1, 2], "n": 3},
                                  {"prompt": [1, 2], "echo": True, "max_tokens": 5}])
def test_what_the_server_does_not_do_is_refused(llama_server, body):
    status, answer = post(llama_server, body)
    assert status == 400 and answer["error"]["message"]


def test_a_server_that_dies_is_reported_with_its_log(tmp_path):
    port = serving.free_port()
    command = serving.server_command("cpu", tmp_path / "no-model", port, None)
    with pytest.raises(RuntimeError, match=r"exited with 1 before serving: see .*server.log"):
        with serving.serving(command, port, tmp_path / "server.log", timeout_s=60):
            pass


def test_a_server_that_never_listens_is_reported_with_its_cpu_time_and_log(tmp_path):
    """A stuck server and a starved one read differently: the error gives its CPU seconds and log."""
    port = serving.free_port()
    command = [sys.executable, "-c", "print('loading the model', flush=True); import time; time.sleep(60)"]
    with pytest.raises(RuntimeError, match=r"(?s)within 3 s \(state S, \d+\.\d s of CPU used\): "
                                           r"see .*server.log\n  \| loading the model"):
        with serving.serving(command, port, tmp_path / "server.log", timeout_s=3):
            pass


def test_the_server_is_reached_past_a_proxy_the_environment_names(data, tmp_path):
    """A proxy in the environment (here dead, and urlopen's global opener built while it was set)
    does not stand between the stage and its server on 127.0.0.1."""
    script = """
import os, sys, urllib.request
from pathlib import Path
from mtpipe.evaluation import serving
os.environ.update(HTTP_PROXY="http://127.0.0.1:9", NO_PROXY="127.0.0.1")
try:
    urllib.request.urlopen("http://127.0.0.1:9/", timeout=2)  # builds the global opener with the proxy
except OSError:
    pass
del os.environ["NO_PROXY"]
port = serving.free_port()
with serving.serving(serving.server_command("cpu", Path(sys.argv[1]), port, None), port, Path(sys.argv[2]), 120) as url:
    with serving.open_loopback(url.replace("/v1/completions", "/health"), timeout=5) as resp:
        print("served", resp.status)
"""
    out = subprocess.run([sys.executable, "-c", script, str(data["llama"]), str(tmp_path / "server.log")],
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "served 200", out.stdout + out.stderr[-3000:]


STAGE = """
import os, sys, time
from pathlib import Path
from mtpipe.evaluation import serving
port = serving.free_port()
if sys.argv[1] == "cpu":
    command = serving.server_command("cpu", Path(sys.argv[2]), port, None)
else:  # a server that knows nothing of its stage, as vLLM's: static files, one of them `health`
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", sys.argv[2]]
with serving.serving(command, port, Path(sys.argv[3]), 600):
    print("serving", flush=True)
    time.sleep(600)
"""


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an ended process its new parent has not reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.address
@pytest.mark.parametrize("server", ["cpu", "unwatched"])
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_stage_leaves_no_model_server_behind(data, tmp_path, signum, server):
    """The server runs in a session of its own, out of reach of a signal to the stage's process group:
    a stage stopped by SIGTERM stops it; one killed by SIGKILL cannot, and the kernel ends the server
    (its parent-death signal), also one that does not watch its parent itself, as vLLM's does not."""
    served = data["llama"] if server == "cpu" else tmp_path / "static"
    if server == "unwatched":
        served.mkdir()
        (served / "health").write_text("ok")
    stage = subprocess.Popen([sys.executable, "-c", STAGE, server, str(served), str(tmp_path / "server.log")],
                             stdout=subprocess.PIPE, text=True)
    servers: list[int] = []
    try:
        assert stage.stdout.readline().strip() == "serving"
        servers = children(stage.pid)
        assert len(servers) == 1, servers
        os.kill(stage.pid, signum)
        assert stage.wait(timeout=60) == (-signum if signum == signal.SIGKILL else 128 + signum)
        deadline = time.monotonic() + 10
        while running(servers[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(servers[0]), f"the model server outlived its stage ({signum.name})"
    finally:
        stage.kill()
        for pid in servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.scores
@pytest.mark.parametrize("task", gsm8k.TASKS)
def test_gsm8k_through_lm_eval_on_the_pinned_files(data, llama_server, tmp_path, task):
    """The real lm-eval (chat template) against the server: the task reads the local test split (12
    problems, offline), and each problem's result is lm-eval's exact-match of its logged sample."""
    files = sorted((data["gsm8k"] / "main").glob("test-*.parquet"))
    keys = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE", "TOKENIZERS_PARALLELISM")
    before = {key: os.environ.get(key) for key in keys}
    rows = gsm8k.evaluate(llama_server, data["llama"], files, tmp_path, task=task, num_problems=None,
                          num_fewshot=0, max_new_tokens=8)
    # lm-eval's own imports set other variables (hf_transfer); ours are back as they were
    assert {key: os.environ.get(key) for key in keys} == before, "the offline settings leaked out"
    answers = [q.split("####")[-1].strip() for f in files for q in pq.read_table(f).column("answer").to_pylist()]
    assert [(r["problem"], r["target"]) for r in rows] == list(enumerate(answers))
    assert all(r[name] in (0, 1) for r in rows for name in gsm8k.FILTERS)
    result = gsm8k.scores(rows)
    assert result["problems"] == 12
    for name in gsm8k.FILTERS:
        p = sum(r[name] for r in rows) / 12
        assert result[f"{name}_accuracy"] == pytest.approx(100 * p, abs=0.01)
        assert result[f"{name}_ci95"] == pytest.approx(100 * stats.Z95 * (p * (1 - p) / 11) ** 0.5, abs=0.01)


@pytest.mark.scores
def test_lm_eval_indexes_only_the_tasks_the_stage_wrote(data, tmp_path):
    """Both tasks, written to one folder, are all lm-eval's task manager knows (the pinned one reads
    its upstream file by path), and each loads: no bundled task is indexed."""
    files = sorted((data["gsm8k"] / "main").glob("test-*.parquet"))
    names = {gsm8k.write_task(task, files, tmp_path) for task in gsm8k.TASKS}
    manager = gsm8k.task_manager(tmp_path)
    indexed = {name: entry.yaml_path for name, entry in manager.task_index.items() if entry.yaml_path}
    assert set(indexed) == names and {path.parent for path in indexed.values()} == {tmp_path}
    for name in names:
        assert manager.load([name])


@pytest.mark.scores
def test_the_rl_format_task_asks_in_train_rls_prompt_and_reads_its_answer_tag(tmp_path):
    """gsm8k_rl_format renders train_rl's own prompt (the warm-up's user turn, token for token) and
    scores the number in <answer>; the last number anywhere is the flexible extraction."""
    from lm_eval.filters.extraction import RegexFilter

    from mtpipe.data import gsm8k_chat

    task = gsm8k.rl_format_task([tmp_path / "test.parquet"])
    template, tokens = gsm8k_chat.rl_prompt_format()
    question = "Ann has 3 pens and buys 4 more. How many pens has she?"
    rendered = jinja2.Template(task["doc_to_text"]).render(question=question)
    assert rendered == gsm8k_chat.to_messages(question, "#### 7", template, tokens)[0]["content"]
    assert task["generation_kwargs"]["until"] == ["</answer>"]
    reply = "<reasoning>3 + 4 = 7, not 12.</reasoning><answer>7"
    extracted = {}
    for f in task["filter_list"]:
        regex = f["filter"][0]
        extracted[f["name"]] = RegexFilter(regex_pattern=regex["regex_pattern"], group_select=regex["group_select"]
                                           ).apply([[reply]], [{}])[0][0]
    assert extracted == {"strict-match": "7", "flexible-extract": "7"}
    no_tag = "<reasoning>3 + 4 = 7</reasoning> 7"
    strict = task["filter_list"][0]["filter"][0]
    assert RegexFilter(regex_pattern=strict["regex_pattern"]).apply([[no_tag]], [{}])[0][0] == "[invalid]"


def rows(flags: list[int], **extra) -> list[dict]:
    return [{"problem": i, "target": "7", "flexible": f, "strict": 0, **extra} for i, f in enumerate(flags)]


@pytest.mark.scores
def test_gain_is_the_paired_difference_with_its_interval():
    """The gain's interval is that of the per-problem differences: two models that differ on few
    problems have a narrow one, narrower than the two scores' own intervals combined."""
    before, after = rows([1] * 30 + [0] * 70), rows([1] * 30 + [1] * 10 + [0] * 60)
    out = gsm8k.gain(before, after)
    diffs = [0] * 30 + [1] * 10 + [0] * 60
    sd = np.std(diffs, ddof=1)
    assert out["flexible_gain"] == 10.0
    assert out["flexible_gain_ci95"] == pytest.approx(100 * stats.Z95 * sd / 10, abs=0.01)
    unpaired = 100 * stats.Z95 * np.hypot(*(np.std(x, ddof=1) / 10 for x in ([1] * 30 + [0] * 70, [1] * 40 + [0] * 60)))
    assert out["flexible_gain_ci95"] < unpaired / 1.5
    assert out["strict_gain"] == 0.0 and out["strict_gain_ci95"] == 0.0
    with pytest.raises(ValueError, match="same test split and evaluate.num_problems"):
        gsm8k.gain(before, after[:50])
    with pytest.raises(ValueError, match="different problems"):
        gsm8k.gain(before, [r | {"target": "8"} for r in after])


def test_heldout_loss_is_the_mean_token_nll_of_each_conversation(data, tmp_path):
    files = sorted((data["ultrachat"] / "data").glob("test_sft-*.parquet"))
    port = serving.free_port()
    with serving.serving(serving.server_command("cpu", data["gemma"], port, None), port, tmp_path / "log", 600) as url:
        rows = heldout.evaluate(url, data["gemma"], files, column="messages", count=5, max_length=48)
    from transformers import AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(data["gemma"]), numpy_forward.Model(data["gemma"])
    losses = []
    for messages in heldout.conversations(files, "messages", 5):
        ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))[:48]
        logits = model.logits(ids)[:-1]
        log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        losses.append(float(np.mean(log_z - logits[np.arange(len(ids) - 1), ids[1:]])))
    assert [r["problem"] for r in rows] == list(range(5))
    assert [r["loss"] for r in rows] == pytest.approx(losses, abs=1e-5)
    result = heldout.scores(rows)
    assert result["conversations"] == 5 and result["loss"] == pytest.approx(np.mean(losses), abs=1e-5)
    # random weights over a 512-token vocabulary: about log(512) per token
    assert abs(result["loss"] - np.log(embedded.TINY_VOCAB)) < 0.5
    shifted = [r | {"loss": r["loss"] - 0.25} for r in rows]
    assert heldout.gain(rows, shifted) == {"loss_gain": 0.25, "loss_gain_ci95": 0.0}  # a uniform drop: no spread


def test_the_tpu_server_is_vllms_openai_server_for_the_grpo_tutorial():
    """Golden: the GRPO tutorial preset's evaluate stage serves the export with vLLM on the v6e-8's 8
    chips and scores all 1,319 GSM8K test problems, 8-shot, through the same lm-eval call."""
    from mtpipe.pipeline.config import compose

    params = families.load_params()
    params.rl.preset = "llama3.1-8b-gsm8k-v6e8"
    e = compose("rl", params).evaluate
    command = serving.server_command(e.backend, Path("artifacts/rl/hf"), 8123, e)
    assert command[1:] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "artifacts/rl/hf",
                           "--served-model-name", "mtpipe", "--host", "127.0.0.1", "--port", "8123",
                           "--tensor-parallel-size", "8", "--max-model-len", "4096", "--seed", "0"]
    assert (e.num_problems, e.num_fewshot, e.max_new_tokens) == (None, 8, 512)
    assert compose("rl", params).dataset.eval_files == "main/test-*.parquet"
