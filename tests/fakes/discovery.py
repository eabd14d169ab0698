"""Google's own description of the Compute API as the judge of what the fake Compute API receives and
answers: the discovery document google-api-python-client ships
(``googleapiclient/discovery_cache/documents/compute.v1.json``). The same checks judge the other fakes
by their documents (:func:`api`: ``storage.v1`` for the GCS emulator's IAM reads,
``cloudresourcemanager.v3`` and ``iam.v1`` for tests/fakes/fake_iam.py); methods that share a path
template (Resource Manager's ``v3/{+name}``) are told apart by their parameters' patterns.

A request is resolved to its discovery method (HTTP method + path template under ``compute/v1/``);
its path parameters, query parameters and JSON body are checked against the method (names, types,
formats, enums, patterns) and the body against the method's ``request.$ref`` schema, recursively:
an unknown field is refused as Compute refuses it. int64/uint64 fields may come as JSON strings or
numbers and enum values as strings, as proto3 JSON (what the REST API parses) accepts them. What
the fake answers is checked against the method's ``response.$ref`` schema the same way, and error
answers against Google's error body shape.

The wording of a refusal follows what Google's servers answer (quoted in public client issues):

- JSON the API front end cannot bind to the request message (an unknown field, a value of the wrong
  JSON type, an unknown query parameter) is answered before Compute sees it, with status
  INVALID_ARGUMENT: ``Invalid JSON payload received. Unknown name "foo" at 'instance_resource':
  Cannot find field.`` (googleapis/google-cloud-ruby#26951, GoogleCloudPlatform/
  deploymentmanager-samples#325), ``Invalid value at 'x' (TYPE_STRING), true``
  (zed-industries/zed#62539), ``Unknown name "foo": Cannot bind query parameter. Field 'foo' could
  not be found in request message.``. The message field holding the body is the one
  google-cloud-compute's protos name (``instance_resource`` for Instance, ``firewall_resource``...).
- A value Compute itself refuses: ``Invalid value for field 'resource.scheduling.onHostMaintenance':
  'MIGRATE'. ...`` (GoogleCloudPlatform/cloud-image-tests#346), ``Invalid value for field
  'instance': 'instance-'. Must be a match of regex '...'`` (rapid7/insightconnect-plugins#751),
  ``Required field 'resource' not specified`` with reason ``required``
  (googleapis/google-api-python-client#608). The enum sentence after the first one is this fake's.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import googleapiclient

DOCUMENTS = Path(googleapiclient.__file__).parent / "discovery_cache" / "documents"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gcp"

# proto3 JSON's scalar names, as the front end writes them in "Invalid value at 'x' (TYPE_...)".
PROTO_TYPES = {("string", None): "TYPE_STRING", ("string", "int64"): "TYPE_INT64",
               ("string", "uint64"): "TYPE_UINT64", ("string", "byte"): "TYPE_BYTES",
               ("integer", "int32"): "TYPE_INT32", ("integer", "uint32"): "TYPE_UINT32",
               ("number", "double"): "TYPE_DOUBLE", ("number", "float"): "TYPE_FLOAT",
               ("boolean", None): "TYPE_BOOL"}
INT_RANGES = {"int32": (-2**31, 2**31 - 1), "uint32": (0, 2**32 - 1), "int64": (-2**63, 2**63 - 1),
              "uint64": (0, 2**64 - 1)}
DURATION = re.compile(r"-?\d+(\.\d{1,9})?s")   # google-duration in JSON: "3.5s"


class Refused(Exception):
    """A request Compute would refuse: HTTP ``code`` with Google's error body."""

    def __init__(self, message: str, code: int = 400, reason: str = "invalid",
                 status: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code, self.reason, self.status = code, reason, status

    def body(self) -> dict:
        message = str(self)
        return {"error": {"code": self.code, "message": message, "status": self.status,
                          "errors": [{"message": message, "domain": "global", "reason": self.reason}]}}


@dataclass(frozen=True)
class Method:
    """One discovery method: its id (``compute.instances.insert``), parameters and schemas."""

    id: str
    http_method: str
    template: re.Pattern
    path_params: tuple[str, ...]
    params: dict[str, dict]
    request: str | None
    response: str | None
    literals: int   # literal characters of the path template: the most specific template wins


def _compile(template: str) -> tuple[re.Pattern, tuple[str, ...], int]:
    """``projects/{project}/zones/{zone}`` as a regex, its parameter names and its literal length."""
    regex, names, literals = "", [], 0
    for part in re.split(r"(\{\+?[^}]+\})", template):
        if variable := re.fullmatch(r"\{(\+?)([^}]+)\}", part):
            regex += "(.+)" if variable[1] else "([^/]+)"
            names.append(variable[2])
        else:
            regex += re.escape(part)
            literals += len(part)
    return re.compile(regex), tuple(names), literals


def _path_value(raw: str) -> str:
    """A path parameter's value as Google's servers read it: percent-decoded, except %2F, which stays
    in the value (Service Usage's resource names hold a metric as compute.googleapis.com%2Fcpus)."""
    return unquote(re.sub("%2[Ff]", "%252F", raw))


def _methods(resources: dict) -> Iterator[dict]:
    """Every method of the document's (nested) resources."""
    for resource in resources.values():
        yield from resource.get("methods", {}).values()
        yield from _methods(resource.get("resources", {}))


class Discovery:
    """A discovery document, indexed for resolving and checking requests and answers."""

    def __init__(self, doc: dict) -> None:
        self.schemas: dict[str, dict] = doc["schemas"]
        self.system_params: dict[str, dict] = doc["parameters"]
        self.prefix = "/" + doc["servicePath"]
        self.methods: list[Method] = []
        for m in _methods(doc["resources"]):
            template, names, literals = _compile(m["path"])
            self.methods.append(Method(
                m["id"], m["httpMethod"], template, names, m.get("parameters", {}),
                m.get("request", {}).get("$ref"), m.get("response", {}).get("$ref"), literals))
        self.methods.sort(key=lambda m: -m.literals)

    # ---- requests

    def _candidates(self, http_method: str, path: str) -> list[tuple[Method, dict[str, str]]]:
        """The methods whose template matches ``path``, with its path parameters."""
        if not path.startswith(self.prefix):
            return []
        rest = path[len(self.prefix):]
        return [(method, dict(zip(method.path_params, map(_path_value, found.groups()))))
                for method in self.methods
                if method.http_method == http_method and (found := method.template.fullmatch(rest))]

    @staticmethod
    def _fits(method: Method, values: dict[str, str]) -> bool:
        return all(re.fullmatch(method.params[n].get("pattern", ".*"), v) for n, v in values.items())

    def resolve(self, http_method: str, path: str) -> tuple[Method, dict[str, str]]:
        """The method serving ``path`` (URL path, query left out) and its path parameters."""
        candidates = self._candidates(http_method, path)
        # Methods that share a template (cloudresourcemanager's `v3/{+name}` for projects, folders
        # and organizations) are told apart by their parameters' patterns.
        for method, values in candidates:
            if self._fits(method, values):
                return method, values
        if candidates:
            return candidates[0]
        # Google's front end answers an unknown URL with a 404 page in these words.
        raise Refused(f"The requested URL {path} was not found on this server.", 404, "notFound",
                      "NOT_FOUND")

    def serves(self, http_method: str, path: str) -> bool:
        """Whether a method of this API serves ``path``, its parameters' patterns included: how one
        server tells apart APIs whose paths share a version prefix (OS Login's, IAM's and Service
        Usage's `v1/...`), as Google's hosts do."""
        return any(self._fits(method, values) for method, values in self._candidates(http_method, path))

    def check_request(self, http_method: str, url: str, raw_body: str) -> Method:
        """The request's method, once its parameters and body pass; Refused otherwise."""
        split = urlsplit(url)
        method, path_values = self.resolve(http_method, split.path)
        for name, value in path_values.items():
            _check_param(name, [value], method.params[name])
        query = parse_qs(split.query, keep_blank_values=True)
        known = {**self.system_params,
                 **{n: p for n, p in method.params.items() if p["location"] == "query"}}
        for name, values in query.items():
            if name not in known:
                raise Refused(f"Invalid JSON payload received. Unknown name \"{name}\": Cannot bind "
                              f"query parameter. Field '{name}' could not be found in request message.")
            _check_param(name, values, known[name])
        for name, spec in known.items():
            if spec.get("required") and spec["location"] == "query" and name not in query:
                raise Refused(f"Required field '{name}' not specified", reason="required")
        self._check_body(method, raw_body)
        return method

    def _check_body(self, method: Method, raw_body: str) -> None:
        try:
            body = json.loads(raw_body) if raw_body.strip() else None
        except json.JSONDecodeError as e:
            raise Refused(f"Invalid JSON payload received. {e.msg}.") from None
        if method.request is None:
            if body:   # the client sends no body (or {}) where the method takes none
                name = next(iter(body)) if isinstance(body, dict) else body
                raise Refused(f"Invalid JSON payload received. Unknown name \"{name}\": Cannot find field.")
            return
        if body is None:
            raise Refused("Required field 'resource' not specified", reason="required")
        root = _snake(method.request) + "_resource"
        problem = self.problem(body, {"$ref": method.request}, root, "resource")
        if problem:
            raise Refused(problem)

    # ---- the schema walk, for request bodies and answers alike

    def problem(self, value: Any, spec: dict, where: str, field_path: str) -> str | None:
        """The first way ``value`` breaks ``spec`` (discovery schema), or None. ``where`` is the
        front end's path of the value (proto names), ``field_path`` Compute's (JSON names)."""
        if "$ref" in spec:
            name = spec["$ref"]
            spec = {**self.schemas[name], "id": name}
        if value is None:   # proto3 JSON: null is the field's default
            return None
        kind = spec.get("type")
        if kind == "any":
            return None
        if kind == "object":
            return self._object(value, spec, where, field_path)
        if kind == "array":
            if not isinstance(value, list):
                return f"Invalid value at '{where}' (repeated), {json.dumps(value)}"
            items = {**spec["items"], **({"pattern": spec["pattern"]} if "pattern" in spec else {})}
            return next((p for i, item in enumerate(value)
                         if (p := self.problem(item, items, f"{where}[{i}]", f"{field_path}[{i}]"))), None)
        return _scalar(value, spec, where, field_path)

    def _object(self, value: Any, spec: dict, where: str, field_path: str) -> str | None:
        if not isinstance(value, dict):
            type_name = spec.get("id", field_path)
            return f"Invalid value at '{where}' (type.googleapis.com/google.cloud.compute.v1.{type_name}), " \
                   f"{json.dumps(value)}"
        if "properties" in spec:
            for key, item in value.items():
                if key not in spec["properties"]:
                    return f"Invalid JSON payload received. Unknown name \"{key}\" at '{where}': Cannot find field."
                if p := self.problem(item, spec["properties"][key], f"{where}.{_snake(key)}", f"{field_path}.{key}"):
                    return p
        elif "additionalProperties" in spec:   # a map, e.g. labels
            for key, item in value.items():
                if p := self.problem(item, spec["additionalProperties"], f"{where}[{key}]", f"{field_path}.{key}"):
                    return p
        return None

    # ---- answers

    def answer_problem(self, method: Method, code: int, body: Any) -> str | None:
        """How an answer breaks the method's response schema (or, for an error, Google's error body)."""
        if code >= 400:
            return _error_body_problem(code, body)
        if method.response is None:
            return None if body in (None, {}) else f"{method.id} answers no body, got {body!r}"
        return self.problem(body, {"$ref": method.response}, method.response, method.response)


def _snake(name: str) -> str:
    """A JSON (camelCase) name as the proto field name: provisioningModel -> provisioning_model."""
    return re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()


def _check_param(name: str, values: list[str], spec: dict) -> None:
    """A path or query parameter's values (strings, as the URL carries them) against its spec."""
    if len(values) > 1 and not spec.get("repeated"):
        raise Refused(f"Invalid value for field '{name}': {values}. The parameter is not repeated.")
    for value in values:
        typed: Any = value
        kind = spec.get("type")
        if kind == "boolean":
            if value.lower() not in ("true", "false"):
                raise Refused(f"Invalid value at '{name}' (TYPE_BOOL), \"{value}\"")
            typed = value.lower() == "true"
        elif kind == "integer" or spec.get("format") in ("int64", "uint64"):
            if not re.fullmatch(r"-?\d+", value):
                raise Refused(f"Invalid value at '{name}' ({PROTO_TYPES[kind, spec.get('format')]}), \"{value}\"")
            typed = value if kind == "string" else int(value)
        elif kind == "number":
            try:
                typed = float(value)
            except ValueError:
                raise Refused(f"Invalid value at '{name}' (TYPE_FLOAT), \"{value}\"") from None
        if problem := _scalar(typed, spec, name, name):
            raise Refused(problem)


def _scalar(value: Any, spec: dict, where: str, field_path: str) -> str | None:
    """A string, integer, number or boolean against its spec (type, format, range, enum, pattern)."""
    kind, fmt = spec.get("type"), spec.get("format")
    wrong = f"Invalid value at '{where}' ({PROTO_TYPES.get((kind, fmt), 'TYPE_STRING')}), {json.dumps(value)}"
    if kind == "boolean":
        return None if isinstance(value, bool) else wrong
    if kind == "number":
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) or \
            value in ("NaN", "Infinity", "-Infinity")
        return None if ok else wrong
    if kind == "integer" or fmt in INT_RANGES:
        if isinstance(value, bool) or not isinstance(value, (int, str)) or \
                (isinstance(value, str) and not re.fullmatch(r"-?\d+", value)):
            return wrong
        low, high = INT_RANGES[fmt or "int32"]
        if not low <= int(value) <= high:
            return f"Invalid value for field '{field_path}': '{value}'. Out of range for {fmt}."
        return None
    if not isinstance(value, str):
        return wrong
    if fmt == "byte":
        try:
            bare = value.replace("-", "+").replace("_", "/").rstrip("=")   # padded or not, as Google sends it
            base64.b64decode(bare + "=" * (-len(bare) % 4), validate=True)
        except ValueError:
            return wrong
    if fmt == "google-datetime":
        try:
            datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return f"Invalid value for field '{field_path}': '{value}'. Not an RFC 3339 timestamp."
    if fmt == "google-duration" and not DURATION.fullmatch(value):
        return f"Invalid value for field '{field_path}': '{value}'. Not a duration such as '3.5s'."
    if "enum" in spec and value not in spec["enum"]:
        return f"Invalid value for field '{field_path}': '{value}'. Must be one of {spec['enum']}."
    if "pattern" in spec and not re.fullmatch(spec["pattern"], value):
        return f"Invalid value for field '{field_path}': '{value}'. Must be a match of regex " \
               f"'{spec['pattern']}'"
    return None


def _error_body_problem(code: int, body: Any) -> str | None:
    """Google's error body: {"error": {"code": <the HTTP status>, "message": str, "errors": [{"message",
    "domain", "reason"}], "status"?: str}} (cloud.google.com/apis/design/errors, "HTTP mapping")."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(body) != {"error"}:
        return f"an error answer is {{\"error\": {{...}}}}, got {body!r}"
    if error.get("code") != code or not isinstance(error.get("message"), str):
        return f"error.code must be the HTTP status {code} and error.message a string, got {error!r}"
    if unknown := set(error) - {"code", "message", "errors", "status", "details"}:
        return f"unknown keys in an error body: {sorted(unknown)}"
    entries = error.get("errors", [])
    if not all(isinstance(e, dict) and set(e) <= {"message", "domain", "reason", "location", "locationType"}
               and isinstance(e.get("reason"), str) for e in entries):
        return f"error.errors entries are {{message, domain, reason}}, got {entries!r}"
    return None


@functools.cache
def api(document: str) -> Discovery:
    """A discovery document shipped in google-api-python-client (``storage.v1``, ``iam.v1``, ...), else
    committed in tests/fixtures/gcp/ (``cloudquotas.v1``: the contract of Google's client package, as
    google-api-python-client ships no discovery document of Cloud Quotas), parsed once per process."""
    shipped = DOCUMENTS / f"{document}.json"
    return Discovery(json.loads((shipped if shipped.exists() else FIXTURES / f"{document}.json").read_text()))


def compute() -> Discovery:
    """The Compute v1 discovery document."""
    return api("compute.v1")


@dataclass
class Contract:
    """What the fake received and answered, judged by the discovery document. ``rejected`` holds the
    refusals (a test that sends a bad request on purpose takes them with :meth:`take_rejected`);
    ``faults`` the answers Compute would never give. :meth:`check` fails a test that left any."""

    api: Discovery = field(default_factory=compute)
    rejected: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)

    def request(self, http_method: str, url: str, raw_body: str) -> tuple[Method | None, tuple[int, dict] | None]:
        """(the request's method, None) when it passes; (None, (status, error body)) when refused."""
        try:
            return self.api.check_request(http_method, url, raw_body), None
        except Refused as e:
            self.rejected.append(f"{http_method} {url}: {e}")
            return None, (e.code, e.body())

    def answer(self, method: Method, code: int, body: Any) -> tuple[int, Any]:
        """The answer when Compute could give it; otherwise a 500 naming the problem, recorded."""
        problem = self.api.answer_problem(method, code, body)
        if problem is None:
            return code, body
        self.faults.append(f"{method.id} answered {code}: {problem}")
        message = f"the fake answered what Compute never would ({method.id}): {problem}"
        return 500, {"error": {"code": 500, "message": message, "status": "INTERNAL",
                               "errors": [{"message": message, "domain": "global", "reason": "backendError"}]}}

    def take_rejected(self) -> list[str]:
        """The refusals so far, forgotten (they were expected)."""
        taken, self.rejected[:] = list(self.rejected), []
        return taken

    def check(self) -> None:
        """Raise AssertionError if the fake answered off contract or refused what no test expected."""
        assert not self.faults, "the fake Compute API answered what Compute never would:\n" + "\n".join(self.faults)
        assert not self.rejected, "requests refused by Compute's discovery document (a test that expects " \
            "this takes them with fake.contract.take_rejected()):\n" + "\n".join(self.rejected)
