"""Who the VM runs as, and whether that identity may use the buckets the run needs.

The VM runs `dvc pull/push` and the training stages as its service account, not as the laptop's
user, and from the DVC config of the commit vm_run ships, not from the laptop's. So:

* :func:`shipped_remote`: the default DVC remote is read from HEAD's `.dvc/config` (what the VM
  gets); a remote only in `.dvc/config.local` or in an uncommitted edit, or a laptop remote other
  than the shipped one, stops the run before anything exists.
* :func:`check_identity` (before the insert): conf/vm.yaml's `service_account` (an email, or
  `default`: the project's Compute default service account, from Compute's projects.get) must hold
  `storage.objects.create/get/list` on the DVC remote's bucket and also `delete` on the work bucket
  (`run.env` MTPIPE_WORK_BUCKET). The allow policies that can grant it are read: the bucket's
  (storage buckets.getIamPolicy), its project's and that project's folders' and organization's
  (Cloud Resource Manager getIamPolicy); roles become permissions through a table of the
  predefined storage and basic roles, else IAM roles.get. A permission proven missing stops the
  run with the `gcloud` command that grants it.
* What the laptop cannot prove (a policy it may not read, a group or domain member, a conditional
  grant, a role it cannot read) is probed from the VM by :func:`probe_from_vm` right after SSH is
  ready, before the setup: an object written, read, listed and deleted as the VM, with the token
  of its metadata server and the GCS JSON API (curl, which the image has).

Not read: IAM deny policies and VPC Service Controls, which can refuse what an allow policy grants.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import requests
from configobj import ConfigObj
from google.auth.transport.requests import AuthorizedSession

from mtpipe.cloud.on_vm.ssh import Remote, run
from mtpipe.cloud.providers.gcp.api_errors import client_kwargs
from mtpipe.cloud.providers.gcp.compute import ComputeZone
from mtpipe.cloud.providers.gcp.google_apis import Unknown
from mtpipe.cloud.providers.gcp.idle_watch import METADATA_HOST
from mtpipe.cloud.providers.interface import ProviderError
from mtpipe.cloud.settings.vm_config import VmConfig, VmError
from mtpipe.errors import ConfigError
from mtpipe.maxtext.run_dir import WORK_BUCKET_ENV

STORAGE_API = "https://storage.googleapis.com"
CRM_API = "https://cloudresourcemanager.googleapis.com"
IAM_API = "https://iam.googleapis.com"
IAM_ENDPOINT_ENV = "MTPIPE_IAM_ENDPOINT"   # Resource Manager and IAM elsewhere (the loopback fake)
CREATE, GET, LIST, DELETE = (f"storage.objects.{a}" for a in ("create", "get", "list", "delete"))
OBJECTS = frozenset((CREATE, GET, LIST, DELETE))
_ALL, _READ, _BUCKET = OBJECTS, frozenset((GET, LIST)), frozenset((CREATE, DELETE, LIST))
# What predefined roles grant of OBJECTS: cloud.google.com/storage/docs/access-control/iam-roles and,
# for the basic roles, cloud.google.com/iam/docs/roles-overview#basic. Any other role: IAM roles.get.
ROLE_PERMISSIONS = {
    "roles/owner": _ALL, "roles/editor": _ALL, "roles/viewer": _READ,
    "roles/storage.admin": _ALL, "roles/storage.objectAdmin": _ALL, "roles/storage.objectUser": _ALL,
    "roles/storage.objectCreator": frozenset((CREATE,)), "roles/storage.objectViewer": _READ,
    "roles/storage.legacyBucketOwner": _BUCKET, "roles/storage.legacyBucketWriter": _BUCKET,
    "roles/storage.legacyBucketReader": frozenset((LIST,)),
    "roles/storage.legacyObjectOwner": frozenset((GET,)), "roles/storage.legacyObjectReader": frozenset((GET,)),
}
# Bucket members that stand for a project's basic role holders, and the role each stands for.
CONVENIENCE = {"projectOwner": "roles/owner", "projectEditor": "roles/editor", "projectViewer": "roles/viewer"}
PUBLIC = frozenset(("allUsers", "allAuthenticatedUsers"))
OPAQUE = ("group:", "domain:", "principalSet:", "principal:")   # membership not readable here
EMAIL = re.compile(r"[^@\s]+@[^@\s]+\.gserviceaccount\.com")
REMOTE_FIX = "`dvc remote add -d {name} {url}` (without --local) and `git commit .dvc/config`"


@dataclass(frozen=True)
class Target:
    """A bucket path the VM uses: the setting that names it, its gs:// URL, the GCS endpoint the
    VM's clients use, and the object permissions the run needs there."""

    key: str
    url: str
    endpoint: str
    needed: frozenset[str]

    @property
    def bucket(self) -> str:
        return self.url.removeprefix("gs://").split("/", 1)[0]

    @property
    def prefix(self) -> str:
        rest = self.url.removeprefix("gs://").partition("/")[2].strip("/")
        return f"{rest}/" if rest else ""


# ------------------------------------------------------------ the remote vm_run ships


def _config(text: str) -> ConfigObj:
    return ConfigObj(text.splitlines())


def _default(*configs: ConfigObj) -> tuple[str, str]:
    """(name, url) of the default remote of DVC configs merged in order (later wins); '' when unset."""
    name = next((c["core"]["remote"] for c in reversed(configs) if c.get("core", {}).get("remote")), "")
    url = next((c[f'remote "{name}"']["url"] for c in reversed(configs)
                if name and c.get(f'remote "{name}"', {}).get("url")), "")
    return name, url


def shipped_remote(root: Path) -> tuple[str, dict]:
    """(name, settings) of the default DVC remote in HEAD's `.dvc/config`: what `dvc pull/push`
    read on the VM. The laptop's default remote (with `.dvc/config.local` and uncommitted edits)
    must be the same URL: the VM pushes where this checkout pulls."""
    shown = subprocess.run(["git", "show", "HEAD:.dvc/config"], cwd=root, capture_output=True, text=True)
    head = _config(shown.stdout if shown.returncode == 0 else "")
    files = {where: _config(path.read_text()) if path.exists() else _config("")
             for where, path in (("an uncommitted edit of .dvc/config", root / ".dvc" / "config"),
                                 (".dvc/config.local", root / ".dvc" / "config.local"))}
    name, url = _default(head)
    here_name, here_url = _default(*files.values())
    where = next((w for w, c in reversed(files.items()) if c.get("core", {}).get("remote")
                  or c.get(f'remote "{here_name}"', {}).get("url")), "")
    if not url:
        if not here_url:
            raise ConfigError("core.remote", "no default DVC remote in HEAD's .dvc/config: the VM pulls "
                              "and pushes through it", REMOTE_FIX.format(name="gcs", url="gs://BUCKET/PATH"))
        raise ConfigError("core.remote", f"the default DVC remote {here_name} ({here_url}) is only in {where}; "
                          "vm_run ships HEAD, whose .dvc/config has none, so `dvc pull` on the VM would fail "
                          "with 'no remote'", REMOTE_FIX.format(name=here_name, url=here_url))
    if here_url != url:
        raise ConfigError("core.remote", f"this checkout's default DVC remote is {here_name} ({here_url}, from "
                          f"{where}) but vm_run ships {name} ({url}, HEAD's .dvc/config): the VM would push "
                          "where `dvc pull` here does not look",
                          f"commit the remote you use ({REMOTE_FIX.format(name=here_name, url=here_url)}), or "
                          "drop the other one from .dvc/config.local (`dvc remote default --local --unset`)")
    return name, dict(head[f'remote "{name}"'])


def targets(cfg: VmConfig, root: Path) -> list[Target]:
    """The gs:// paths the VM will use: the shipped DVC remote (pull, push) and the work bucket
    (run.env MTPIPE_WORK_BUCKET: checkpoints written, read, listed and deleted)."""
    name, remote = shipped_remote(root)
    found = []
    if remote["url"].startswith("gs://"):
        found.append(Target(f"remote.{name}.url", remote["url"].rstrip("/"),
                            (remote.get("endpointurl") or STORAGE_API).rstrip("/"), frozenset((CREATE, GET, LIST))))
    work = str(cfg.run.env.get(WORK_BUCKET_ENV) or "")
    if work.startswith("gs://"):
        endpoint = str(cfg.run.env.get("STORAGE_EMULATOR_HOST") or STORAGE_API).rstrip("/")
        found.append(Target(f"vm.run.env.{WORK_BUCKET_ENV}", work.rstrip("/"), endpoint, OBJECTS))
    return found


# ------------------------------------------------------------ the VM's identity, from the laptop


def service_account(cfg: VmConfig) -> str:
    """The email the VM runs as: conf/vm.yaml's `service_account`, `default` being the project's
    Compute default service account (projects.get's defaultServiceAccount)."""
    if cfg.service_account != "default":
        if not EMAIL.fullmatch(cfg.service_account):
            raise ConfigError("vm.service_account", f"{cfg.service_account!r} is neither `default` nor a "
                              "service account's email", "set service_account: default (the project's Compute "
                              "default service account) or NAME@PROJECT.iam.gserviceaccount.com in conf/vm.yaml")
        return cfg.service_account
    return ComputeZone(cfg.project, cfg.zone).default_service_account()


NODE_DELETE = "tpu.nodes.delete"   # what the Cloud TPU API checks to delete a node, or a queued resource's


def check_node_self_delete(cfg: VmConfig) -> str:
    """The Cloud TPU API route: the node's service account may delete the node and its queued resource
    (its idle watch does, with that account's token), as far as the project's allow policy shows: a role
    bound there to the account without a condition that includes ``tpu.nodes.delete`` (IAM roles.get).
    Unknown (google_apis.Unknown) where that cannot be told here: the policy or a role unreadable, or no
    such grant on the project (folders, the organisation and groups are not read). The node tests it
    itself at boot, and vm_run says its answer before training (mtpipe.cloud.checks.self_delete)."""
    try:
        email = service_account(cfg)
    except ProviderError as err:
        raise Unknown(f"which service account the node runs as cannot be read here ({err})") from err
    reader = PolicyReader()
    policy = reader.read(f"{reader.crm}/v3/projects/{cfg.project}:getIamPolicy", {"options": {"requestedPolicyVersion": 3}})
    if policy is None:
        raise Unknown(f"the IAM policy of project {cfg.project} could not be read here (getIamPolicy): whether "
                      f"{email} holds {NODE_DELETE} is tested on the node at boot, and vm_run says it")
    roles = [b["role"] for b in policy.get("bindings", [])
             if f"serviceAccount:{email}" in b.get("members", []) and not b.get("condition")]
    unread = []
    for role in roles:
        found = reader.read(f"{reader.iam}/v1/{role}")
        if found is None:
            unread.append(role)
        elif NODE_DELETE in found.get("includedPermissions", []):
            return f"{email} may delete its node and queued resource ({NODE_DELETE} through {role} on {cfg.project})"
    raise Unknown(f"project {cfg.project}'s IAM policy grants {email} no role read here with {NODE_DELETE}"
                  + (f" (roles not readable: {', '.join(unread)})" if unread else "")
                  + " (folders, the organisation and groups are not read); the node tests it at boot. Without it "
                  f"the idle node cannot delete itself: `gcloud projects add-iam-policy-binding {cfg.project} "
                  f"--member serviceAccount:{email} --role roles/tpu.admin`")


def grant_command(target: Target, email: str) -> str:
    return (f"gcloud storage buckets add-iam-policy-binding gs://{target.bucket} "
            f"--member=serviceAccount:{email} --role=roles/storage.objectAdmin")


@dataclass
class Access:
    """What the allow policies read so far grant the VM's account, and what they leave unknown."""

    granted: set[str] = field(default_factory=set)
    unknown: list[str] = field(default_factory=list)

    def cannot_tell(self, why: str) -> None:
        if why not in self.unknown:
            self.unknown.append(why)


class PolicyReader:
    """The laptop's reads (its credentials): allow policies, resources, roles. A read that fails
    (refused, missing, unreachable) is None: the laptop cannot tell, the VM probe will."""

    def __init__(self) -> None:
        self.session = AuthorizedSession(client_kwargs()["credentials"])
        base = os.environ.get(IAM_ENDPOINT_ENV, "").rstrip("/")
        self.crm, self.iam = base or CRM_API, base or IAM_API
        self.roles: dict[str, frozenset[str] | None] = {}

    def read(self, url: str, body: dict | None = None) -> dict | None:
        try:
            answer = self.session.request("POST" if body is not None else "GET", url, json=body, timeout=30)
            return answer.json() if answer.status_code == 200 else None
        except (requests.RequestException, OSError, ValueError):
            return None

    def permissions(self, role: str) -> frozenset[str] | None:
        """What ``role`` grants of OBJECTS; None when the role cannot be read."""
        if role in ROLE_PERMISSIONS:
            return ROLE_PERMISSIONS[role]
        if role not in self.roles:
            got = self.read(f"{self.iam}/v1/{role}")
            self.roles[role] = None if got is None else frozenset(got.get("includedPermissions", [])) & OBJECTS
        return self.roles[role]

    def access(self, target: Target, email: str) -> Access:
        """The allow policies that can grant ``email`` object permissions on the target's bucket:
        the bucket's, then (when that is not enough) its project's and the project's ancestors'."""
        bucket, holders, unread = f"gs://{target.bucket}", {f"serviceAccount:{email}"}, []
        policy = self.read(f"{target.endpoint}/storage/v1/b/{target.bucket}/iam?optionsRequestedPolicyVersion=3")
        if policy is None:   # a grant on the project may still prove it
            unread.append(f"the IAM policy of {bucket} could not be read here (storage.buckets.getIamPolicy)")
        bindings = [(bucket, b) for b in (policy or {}).get("bindings", [])]
        found = self._evaluate(bindings, holders)
        if target.needed <= found.granted:
            return found
        info = self.read(f"{target.endpoint}/storage/v1/b/{target.bucket}?fields=projectNumber")
        resource = f"projects/{info['projectNumber']}" if info else ""
        while resource:
            # an organization has no parent to look up; a project or folder names its own
            node = {} if resource.startswith("organizations/") else self.read(f"{self.crm}/v3/{resource}")
            policy = self.read(f"{self.crm}/v3/{resource}:getIamPolicy", {"options": {"requestedPolicyVersion": 3}})
            if policy is None or node is None:
                unread.append(f"the IAM policy of {resource} could not be read here (get, getIamPolicy)")
                break
            level = [(resource, b) for b in policy.get("bindings", [])]
            if resource.startswith("projects/"):   # the bucket's project; its ancestors are folders, an organization
                for _, b in level:   # the account's basic roles on the bucket's project: convenience members
                    if holders & set(b.get("members", [])) and not b.get("condition"):
                        holders |= {f"{c}:{p}" for c, role in CONVENIENCE.items() if role == b["role"]
                                    for p in (node.get("projectId"), resource.removeprefix("projects/")) if p}
            bindings += level
            resource = node.get("parent", "")
        if not info:
            unread.append(f"{bucket}'s project could not be read here (storage.buckets.get)")
        found = self._evaluate(bindings, holders)
        for why in unread:
            found.cannot_tell(why)
        return found

    def _evaluate(self, bindings: Iterable[tuple[str, dict]], holders: set[str]) -> Access:
        """What ``bindings`` grant the account (whose principals are ``holders``) of OBJECTS, and the
        grants whose reach the laptop cannot see. (A bucket's projectEditor:-style members count once
        the project's policy is read; when it cannot be, :meth:`access` says so.)"""
        found = Access()
        for where, binding in bindings:
            role, members = binding["role"], set(binding.get("members", []))
            opaque = sorted(m for m in members - holders if m.startswith(OPAQUE))
            if not (members & (holders | PUBLIC)) and not opaque:
                continue
            granted = self.permissions(role)
            if granted is None:
                found.cannot_tell(f"role {role} (bound on {where}) could not be read here (IAM roles.get)")
                continue
            if not granted:
                continue
            if members & (holders | PUBLIC) and binding.get("condition"):
                found.cannot_tell(f"{role} on {where} is granted under a condition")
            elif members & (holders | PUBLIC):
                found.granted |= granted
            for member in opaque:
                found.cannot_tell(f"{member} holds {role} on {where} (whether the VM's account is one of "
                                  "them is not visible here)")
        return found


def check_identity(cfg: VmConfig, root: Path) -> list[Target]:
    """Before the insert: the VM's service account may use every target, as far as the allow
    policies readable here show. Raises ConfigError when a needed permission is proven missing;
    returns the targets the laptop could not prove, for :func:`probe_from_vm`."""
    wanted = targets(cfg, root)
    if not wanted:
        return []
    try:
        email = service_account(cfg)
    except ProviderError as err:   # e.g. no compute.projects.get: the VM's metadata server knows it
        print(f"mtpipe: cannot tell from here which service account the VM will run as ({err}): the VM will "
              "try the buckets right after SSH is ready, before the setup", flush=True)
        return wanted
    reader, unproven = PolicyReader(), []
    for target in wanted:
        found = reader.access(target, email)
        missing = sorted(target.needed - found.granted)
        if not missing:
            continue
        if found.unknown:
            print(f"mtpipe: cannot prove from here that the VM's service account {email} may "
                  f"{_verbs(missing)} {target.url} ({'; '.join(found.unknown)}): the VM will try it right after "
                  "SSH is ready, before the setup", flush=True)
            unproven.append(target)
            continue
        raise ConfigError("vm.service_account", f"the VM would run as {email}, which may not {_verbs(missing)} "
                          f"{target.url} ({target.key}): no allow policy on the bucket, its project, folders or "
                          f"organization grants it {', '.join(missing)}",
                          f"`{grant_command(target, email)}`, or set service_account: in conf/vm.yaml to an "
                          "account that holds it (`default` is the project's Compute default service account)")
    return unproven


def _verbs(permissions: Iterable[str]) -> str:
    words = {CREATE: "write", GET: "read", LIST: "list", DELETE: "delete"}
    return "/".join(words[p] for p in sorted(permissions, key=list(words).index))


# ------------------------------------------------------------ the VM's identity, from the VM


def probe_script(wanted: list[Target], metadata_host: str, per_call_s: float) -> str:
    """Bash for the VM: the metadata server's token for its service account, then for each target an
    object written, read, listed and deleted through the GCS JSON API; prints `EMAIL <email>` and
    `<target index> <action> <HTTP status>` lines (000: no answer). The token stays in a file
    readable by the user only, never in a command line."""
    account = f"http://{metadata_host}/computeMetadata/v1/instance/service-accounts/default"
    lines = ["set -u", 'h=$(mktemp) && trap \'rm -f "$h"\' EXIT',
             f"curl() {{ command curl -s --max-time {per_call_s:g} \"$@\"; }}",
             f"email=$(curl -f -H 'Metadata-Flavor: Google' {shlex.quote(account + '/email')}) "
             "|| { echo NOTOKEN; exit 0; }",
             f"tok=$(curl -f -H 'Metadata-Flavor: Google' {shlex.quote(account + '/token')} "
             "| sed -n 's/.*\"access_token\" *: *\"\\([^\"]*\\)\".*/\\1/p')",
             '[ -n "$tok" ] || { echo NOTOKEN; exit 0; }',
             'echo "EMAIL $email"', 'printf "Authorization: Bearer %s\\n" "$tok" > "$h"',
             "code() { curl -o /dev/null -w '%{http_code}' -H @\"$h\" \"$@\"; }"]
    for i, target in enumerate(wanted):
        name = f"{target.prefix}.mtpipe-identity-probe-{uuid.uuid4().hex}"
        objects, one = f"{target.endpoint}/storage/v1/b/{target.bucket}/o", quote(name, safe="")
        upload = f"{target.endpoint}/upload/storage/v1/b/{target.bucket}/o?uploadType=media&name={one}"
        lines += [f"echo {i} create $(code -X POST -H 'Content-Type: text/plain' --data-binary probe "
                  f"{shlex.quote(upload)})",
                  f"echo {i} get $(code {shlex.quote(f'{objects}/{one}?alt=media')})",
                  f"echo {i} list $(code {shlex.quote(f'{objects}?prefix={quote(name, safe="")}&maxResults=1')})",
                  f"echo {i} delete $(code -X DELETE {shlex.quote(f'{objects}/{one}')})"]
    return "\n".join(lines)


def probe_from_vm(remote: Remote, cfg: VmConfig, wanted: list[Target]) -> None:
    """Right after SSH is ready, before the setup: the VM's own identity uses each target. Raises
    ConfigError naming the `gcloud` grant when GCS refuses it, or VmError when the VM cannot ask."""
    timeout_s = float(cfg.remote_probe_timeout_s)
    host = str(cfg.run.env.get("GCE_METADATA_HOST") or METADATA_HOST)
    calls = 2 + 4 * len(wanted)
    print(f"mtpipe: probing {', '.join(t.url for t in wanted)} from the VM as its service account", flush=True)
    rc, out = run(remote, probe_script(wanted, host, max(timeout_s / calls, 2.0)), stream=False)
    lines = out.decode(errors="replace").split("\n")
    if rc != 0 or "NOTOKEN" in lines or not lines[0].startswith("EMAIL "):
        raise VmError(f"the VM got no token for a service account from its metadata server ({host}), so "
                      "`dvc pull` there would fail: set service_account: in conf/vm.yaml (default: the project's "
                      "Compute default service account) and scopes: [https://www.googleapis.com/auth/cloud-platform]")
    email = lines[0].removeprefix("EMAIL ").strip()
    answers = {(int(i), action): code for i, action, code in (line.split() for line in lines[1:] if line.strip())}
    words = {"create": CREATE, "get": GET, "list": LIST, "delete": DELETE}
    for i, target in enumerate(wanted):
        for action, permission in words.items():
            code = answers.get((i, action), "000")
            if permission not in target.needed or code.startswith("2"):
                continue
            if code == "000":
                raise VmError(f"the VM could not reach {target.endpoint} within {timeout_s / calls:.0f} s to "
                              f"{_verbs([permission])} {target.url}: check its network (external IP, or Cloud NAT "
                              "/ Private Google Access)")
            raise ConfigError("vm.service_account", f"from the VM, its service account {email} may not "
                              f"{_verbs([permission])} {target.url} ({target.key}): GCS answered {code} to "
                              f"{permission}", f"`{grant_command(target, email)}`, or set service_account: in "
                              "conf/vm.yaml to an account that holds it; then rerun")
    print(f"mtpipe: the VM's service account {email} may use {', '.join(t.url for t in wanted)}", flush=True)
