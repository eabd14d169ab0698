"""An OpenAI-compatible ``/v1/completions`` endpoint over an exported model on the CPU.

On a TPU VM the evaluate stage scores a model with lm-eval against vLLM's OpenAI server (MaxText's
eval runner starts it). On the laptop this server stands in for vLLM: the same lm-eval client
(``local-completions``), the same requests, answered by the numpy forward of the exported Hugging Face
directory (:mod:`mtpipe.evaluation.numpy_forward`) with greedy decoding, which is what lm-eval's GSM8K
tasks ask for (``do_sample: false``, temperature 0).

What it implements of the completions API: ``prompt`` as text or token ids (one or a batch),
``max_tokens``, ``stop`` (strings), ``temperature`` 0 only, and ``echo`` with ``logprobs`` (the
prompt tokens' log-probabilities, ``choices[i].logprobs.token_logprobs``, first one null: what the
held-out loss reads, from vLLM as from here); the answer has ``choices[i].text`` and
``finish_reason``; ``GET /health`` answers 200 once the model is loaded, as vLLM's does. Anything else
a request asks for (sampling, streaming, unknown fields) gets a 400 naming it, so a client that needs
more fails loudly instead of being scored on something else.

    python -m mtpipe.evaluation.server HF_DIR --port PORT [--parent-pid PID]

The evaluate stage starts it with ``--parent-pid`` its own pid: the server ends itself once that
process is no longer its parent (the stage died, even by SIGKILL, and the server was handed on to
init), so a killed stage leaves no server behind.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from mtpipe.evaluation.numpy_forward import Model

SUPPORTED = {"model", "prompt", "max_tokens", "stop", "temperature", "seed", "stream", "echo", "logprobs"}


class CompletionModel:
    """An exported model and its tokenizer, answering one completions request."""

    def __init__(self, hf_dir: Path) -> None:
        from transformers import AutoTokenizer  # local import: transformers is slow to import

        self.model = Model(hf_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        config = json.loads((hf_dir / "generation_config.json").read_text()) \
            if (hf_dir / "generation_config.json").is_file() else {}
        eos = config.get("eos_token_id", self.tokenizer.eos_token_id)
        self.stop_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.lock = threading.Lock()  # one generation at a time: the model is not thread-safe

    def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        """The response body for one request (raises ValueError for what is not supported)."""
        unknown = sorted(set(request) - SUPPORTED)
        if unknown:
            raise ValueError(f"unsupported completion fields: {', '.join(unknown)}")
        if request.get("temperature", 0) != 0 or request.get("stream"):
            raise ValueError("only greedy decoding (temperature 0, no stream) is served")
        prompts = request["prompt"]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        stops = request.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        choices = []
        for index, prompt in enumerate(prompts):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
            max_tokens = int(request.get("max_tokens", 16))
            with self.lock:
                if request.get("echo"):  # a scoring request: the prompt's log-probabilities, one forward
                    if max_tokens > 1:
                        raise ValueError("echo is served with max_tokens 0 or 1 (scoring, not generation)")
                    logits = self.model.logits(ids)
                    new, logprobs = [int(np.argmax(logits[-1]))][:max_tokens], self.prompt_logprobs(ids, logits)
                else:
                    new, logprobs = self.model.generate(ids, max_tokens, tuple(self.stop_ids)), None
            text = self.tokenizer.decode([t for t in new if t not in self.stop_ids])
            cut = min((text.index(s) for s in stops if s in text), default=None)
            finish = "stop" if cut is not None or (new and new[-1] in self.stop_ids) else "length"
            choices.append({"index": index, "text": text if cut is None else text[:cut], "finish_reason": finish,
                            "logprobs": logprobs})
        return {"object": "text_completion", "model": request.get("model", ""), "choices": choices}

    def prompt_logprobs(self, ids: list[int], logits: np.ndarray) -> dict[str, Any]:
        """The OpenAI ``logprobs`` of an echoed prompt: each token's log-probability given those before."""
        logits = logits[:-1]
        top = logits.max(axis=-1, keepdims=True)
        log_z = (top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))[:, 0]
        chosen = logits[np.arange(len(ids) - 1), ids[1:]] - log_z
        return {"tokens": [self.tokenizer.decode([t]) for t in ids], "token_logprobs": [None, *map(float, chosen)]}


class _Handler(BaseHTTPRequestHandler):
    model: CompletionModel

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.rstrip("/") == "/health":
            return self._send(200, {})
        return self._send(404, {"error": {"message": f"no endpoint {self.path}"}})

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.rstrip("/") != "/v1/completions":
            return self._send(404, {"error": {"message": f"no endpoint {self.path}"}})
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            return self._send(200, self.model.complete(request))
        except (ValueError, KeyError, TypeError) as err:
            return self._send(400, {"error": {"message": str(err), "type": "invalid_request_error"}})

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:  # one line per request would drown the stage's log
        pass


def exit_with_parent(pid: int, period_s: float = 0.5) -> None:
    """End this process, from a daemon thread, once ``pid`` is no longer its parent."""
    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(period_s)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description="An OpenAI-compatible completions server over an exported model")
    parser.add_argument("hf_dir", type=Path)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--parent-pid", type=int, help="end when this process is no longer the parent")
    args = parser.parse_args()
    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    handler = type("Handler", (_Handler,), {"model": CompletionModel(args.hf_dir)})
    ThreadingHTTPServer((args.host, args.port), handler).serve_forever()


if __name__ == "__main__":
    main()
