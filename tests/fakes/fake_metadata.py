"""The VM's metadata server on 127.0.0.1, as far as mtpipe's identity probe and idle watch read it:
the attached service account's email and an OAuth access token for it
(``/computeMetadata/v1/instance/service-accounts/default/{email,token}``), and the VM's project,
zone and name.

Like the real server it answers only requests carrying ``Metadata-Flavor: Google`` (403 otherwise)
and 404 when the VM has no service account. The token is ``fakes.gcs_emulator.SA_TOKEN_PREFIX`` +
the email: the GCS emulator then holds the request to the bucket's IAM policy for that account.
``email`` is asked at each request, so a test can make it the service account of the VM the fake
Compute API created.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

from fakes.gcs_emulator import SA_TOKEN_PREFIX
from fakes.loopback import send, serving

ACCOUNT = "/computeMetadata/v1/instance/service-accounts/default/"


@dataclass
class FakeMetadata:
    """``email()`` is the VM's service account (None: none attached); ``host`` is host:port once running."""

    email: Callable[[], str | None]
    host: str = ""
    requests: list[str] = field(default_factory=list)
    vm: tuple[str, str, str] = ("proj-1", "us-east5-b", "mt-test")   # project, zone, name: who the VM is

    def answer(self, path: str, flavor: str | None) -> tuple[int, str, str]:
        """(status, content type, body) for a GET of ``path``."""
        if flavor != "Google":
            return 403, "text/html", "Missing Metadata-Flavor:Google header."
        project, zone, name = self.vm
        about = {"/computeMetadata/v1/project/project-id": project, "/computeMetadata/v1/instance/name": name,
                 "/computeMetadata/v1/instance/zone": f"projects/123456789/zones/{zone}"}
        if path in about:
            return 200, "application/text", about[path]
        email = self.email()
        if not path.startswith(ACCOUNT) or email is None:
            return 404, "text/html", "Not Found"
        what = path[len(ACCOUNT):]
        if what == "email":
            return 200, "application/text", email
        if what == "token":
            return 200, "application/json", json.dumps(
                {"access_token": SA_TOKEN_PREFIX + email, "expires_in": 3599, "token_type": "Bearer"})
        return 404, "text/html", "Not Found"


@contextmanager
def running_metadata(fake: FakeMetadata) -> Iterator[FakeMetadata]:
    """Serve ``fake`` on 127.0.0.1 (free port) in a thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            fake.requests.append(self.path)
            code, kind, body = fake.answer(self.path.split("?")[0], self.headers.get("Metadata-Flavor"))
            send(self, code, body.encode(), kind)

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as host:
        fake.host = host
        yield fake
