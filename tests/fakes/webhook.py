"""A webhook on 127.0.0.1 that keeps what Apprise's json:// posts to it: the notices a run sends."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

from fakes.loopback import send, serving


@contextmanager
def webhook() -> Iterator[tuple[str, list[dict]]]:
    """(the Apprise URL to post to, the list each posted JSON body is appended to) while serving."""
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            send(self, 200, b"{}")

        def log_message(self, *args: object) -> None:   # quiet
            pass

    with serving(Handler) as host:
        yield f"json://{host}/notify", received
