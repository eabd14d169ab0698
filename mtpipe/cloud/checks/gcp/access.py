"""Checks before spending of how the VM is reached: its network and subnetwork exist and fit, an
external IP is allowed (without one: IAP for SSH, run by gcloud as the account of the Application
Default Credentials, and a Cloud NAT for the setup's downloads), a firewall rule admits SSH from
where it comes, and where OS Login is on, 2-step verification is off and our key is in the caller's
OS Login profile (its POSIX user name is the SSH user). Each failure is a ConfigError naming the key
and the fix, raised before the firewall rule or the VM exists. What the checks decide
(``ssh.os_login`` and ``ssh.user``) is written into the config the insert and the SSH client read.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess

from google.oauth2.credentials import Credentials as UserCredentials

from mtpipe.cloud.on_vm import ssh
from mtpipe.cloud.providers import interface
from mtpipe.cloud.providers.gcp import ssh_route
from mtpipe.cloud.providers.gcp.compute import Compute
from mtpipe.cloud.providers.gcp.google_apis import GoogleApis, denies, enforced, member
from mtpipe.cloud.providers.interface import ProviderError
from mtpipe.cloud.settings.vm_config import VmConfig, with_login
from mtpipe.errors import ConfigError

# The permission to log in with administrator rights (the setup runs sudo apt-get): in
# roles/compute.osAdminLogin, which roles/compute.admin and roles/owner include.
LOGIN_PERMISSION = "compute.instances.osAdminLogin"
NAT_ALL = ("ALL_SUBNETWORKS_ALL_IP_RANGES", "ALL_SUBNETWORKS_ALL_PRIMARY_IP_RANGES")
GCLOUD_TIMEOUT_S = 60


def _say(line: str) -> None:
    print(f"mtpipe: {line}", flush=True)


def check_region(cfg: VmConfig, compute: Compute) -> None:
    """What the checks of the first zone check of its region, for another zone the VM may be created
    in: the subnetwork there and, without an external IP, a Cloud NAT."""
    check_network(cfg, compute)
    if not cfg.external_ip:
        check_nat(cfg, compute)


def _name(url: str) -> str:
    return url.rsplit("/", 1)[-1]


def check_network(cfg: VmConfig, compute: Compute) -> None:
    """``network`` exists; ``subnetwork`` (when set) exists in the zone's region and belongs to it;
    a custom-mode network (autoCreateSubnetworks false) has ``subnetwork`` set."""
    region = interface.region(cfg.zone)
    network = compute.get_network(cfg.network)
    if network is None:
        names = compute.network_names()
        raise ConfigError("vm.network", f"network {cfg.network!r} does not exist in project {cfg.project} "
                          f"(its networks: {', '.join(names) or 'none'})",
                          "set network: to one of them in conf/vm.yaml, or create it: gcloud compute networks "
                          f"create {cfg.network} --subnet-mode=auto --project {cfg.project}")
    if cfg.subnetwork:
        subnetwork = compute.get_subnetwork(cfg.subnetwork)
        if subnetwork is None or _name(subnetwork.network) != cfg.network:
            names = compute.subnetwork_names(cfg.network)
            where = "does not exist" if subnetwork is None else \
                f"belongs to network {_name(subnetwork.network)}, not {cfg.network}"
            raise ConfigError("vm.subnetwork", f"subnetwork {cfg.subnetwork!r} of region {region} {where} "
                              f"(network {cfg.network} has there: {', '.join(names) or 'none'})",
                              "set subnetwork: to one of them in conf/vm.yaml (or network: to the "
                              "subnetwork's network)")
    elif "auto_create_subnetworks" in network and not network.auto_create_subnetworks:
        names = compute.subnetwork_names(cfg.network)
        fix = (f"set subnetwork: to one of them ({', '.join(names)}) in conf/vm.yaml" if names else
               f"create one: gcloud compute networks subnets create mtpipe --network {cfg.network} --region "
               f"{region} --range 10.128.0.0/20 --project {cfg.project}, then set subnetwork: mtpipe")
        raise ConfigError("vm.subnetwork", f"network {cfg.network} is a custom-mode VPC: a VM in it needs a "
                          f"subnetwork of region {region}, and subnetwork is null", fix)


def check_external_ip(cfg: VmConfig, compute: Compute, apis: GoogleApis) -> None:
    """With ``external_ip: true`` the organisation policy compute.vmExternalIpAccess allows the VM
    one (a policy that cannot be read is said and passed over); without, SSH goes through a proxy
    command that is on PATH (gcloud for IAP, as the credentials' account: :func:`check_iap_account`)
    and a Cloud NAT serves the VM's subnetwork."""
    if cfg.external_ip:
        instance = f"projects/{cfg.project}/zones/{cfg.zone}/instances/{cfg.name}"
        try:
            policy = apis.effective_policy(cfg.project, "compute.vmExternalIpAccess")
        except ProviderError as err:
            _say(f"could not read the organisation policy compute.vmExternalIpAccess ({err}); going on as if "
                 "it allowed an external IP (if it does not, Compute refuses the insert: set external_ip: false)")
            return
        if denies(policy, instance):
            raise ConfigError("vm.external_ip", "the organisation policy constraints/compute.vmExternalIpAccess "
                              f"forbids an external IP for VM {cfg.name} in project {cfg.project}",
                              "set external_ip: false in conf/vm.yaml: SSH then goes through an IAP tunnel "
                              "(gcloud compute start-iap-tunnel; role roles/iap.tunnelResourceAccessor) and the "
                              f"VM downloads through a Cloud NAT of region {interface.region(cfg.zone)}")
        return
    proxy = ssh_route.proxy_command(cfg) or ""
    program = shlex.split(proxy)[0] if proxy else ""
    if program and shutil.which(program) is None:
        raise ConfigError("vm.ssh.proxy_command", f"{program} is not on PATH, and SSH to a VM without an "
                          f"external IP runs `{proxy}`",
                          "install the Google Cloud CLI (cloud.google.com/sdk/docs/install) and run `gcloud auth "
                          "login`, or set ssh.proxy_command in conf/vm.yaml")
    if ssh_route.through_iap(cfg):
        check_iap_account(program, apis)
    check_nat(cfg, compute)


def gcloud_account(program: str) -> str:
    """The account gcloud runs as: the service account it impersonates (``gcloud config get-value
    auth/impersonate_service_account``), else its login (``account``); '' when it has none."""
    return gcloud_value(program, "auth/impersonate_service_account") or gcloud_value(program, "account")


def gcloud_value(program: str, key: str) -> str:
    """``gcloud config get-value KEY``; '' when unset (gcloud then prints `(unset)` on stderr)."""
    command = [program, "config", "get-value", key]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=GCLOUD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ConfigError("vm.ssh.proxy_command", f"`{shlex.join(command)}` failed ({err})",
                          f"check that `{program}` works (`{program} info`)") from err
    if done.returncode != 0:
        raise ConfigError("vm.ssh.proxy_command", f"`{shlex.join(command)}` failed (exit {done.returncode}): "
                          f"{done.stderr.strip()}", f"check that `{program}` works (`{program} info`)")
    return done.stdout.strip()


def check_gcloud(cfg: VmConfig, apis: GoogleApis) -> str:
    """The quota project of the Application Default Credentials and, where SSH goes through IAP (gcloud
    runs the tunnel), gcloud's account and project.
    User credentials without a quota project fail here: Service Usage and the Organization Policy API
    refuse such calls ("requires a quota project"), and gcloud warns of it at `gcloud auth
    application-default login` when no project is set. Whether SSH through IAP runs as the same
    account is the SSH route's check (:func:`check_iap_account`)."""
    credentials = apis.credentials
    if isinstance(credentials, UserCredentials) and not credentials.quota_project_id:
        raise ConfigError("ADC quota project", "the Application Default Credentials are a user's, with no quota "
                          "project: Service Usage and the Organization Policy API refuse their calls",
                          f"gcloud auth application-default set-quota-project {cfg.project or 'PROJECT'}")
    quota = getattr(credentials, "quota_project_id", None) or "none needed"
    if not ssh_route.through_iap(cfg):
        return f"ADC quota project {quota}; gcloud is not used (SSH goes straight to the VM's external IP)"
    if shutil.which("gcloud") is None:
        return f"ADC quota project {quota}; gcloud is not on PATH (the SSH route's line says what to do)"
    account, project = gcloud_account("gcloud"), gcloud_value("gcloud", "project")
    other = f" (mtpipe passes --project {cfg.project} to it)" if cfg.project and project != cfg.project else ""
    return f"ADC quota project {quota}; gcloud account {account or '(none)'}, project {project or '(none)'}{other}"


def check_iap_account(program: str, apis: GoogleApis) -> None:
    """SSH through IAP runs `gcloud compute start-iap-tunnel` as gcloud's active account, while these
    checks (the tunnel permission among them: mtpipe.cloud.checks.gcp.caller) and the insert use the
    Application Default Credentials: both must be one account. Credentials whose account is not
    known here (anonymous ones) are said and passed over."""
    account, adc = gcloud_account(program), apis.account()
    if not account:
        raise ConfigError("vm.ssh.proxy_command", f"SSH to a VM without an external IP runs `{program} compute "
                          f"start-iap-tunnel`, and {program} has no active account",
                          f"`{program} auth login {adc or 'ACCOUNT'}` (the account of your Application Default "
                          "Credentials)")
    if adc is None:
        _say(f"IAP tunnel as gcloud's account {account}; the account of the Application Default Credentials, "
             "which the permissions are tested with, cannot be read here: make sure it is the same")
    elif adc.lower() != account.lower():
        raise ConfigError("vm.ssh.proxy_command", f"SSH to the VM goes through `{program} compute "
                          f"start-iap-tunnel`, which runs as gcloud's account {account}, while the checks before "
                          f"spending and the VM's creation use the Application Default Credentials, of {adc}: the "
                          "IAP permission tested here would not be the tunnel's",
                          f"`{program} config set account {adc}` (after `{program} auth login {adc}` if gcloud "
                          f"does not have it yet), or `{program} auth application-default login` as {account}")
    else:
        _say(f"IAP tunnel as {account}, the account of the Application Default Credentials")


def check_nat(cfg: VmConfig, compute: Compute) -> None:
    """A VM without an external IP reaches apt, PyPI and the Hub only through a Cloud NAT: some
    Cloud Router of the region on ``network`` has a NAT for all its subnetworks or for the VM's."""
    region, subnetwork = interface.region(cfg.zone), cfg.subnetwork or cfg.network   # auto mode: named as the network
    try:
        routers = compute.list_routers()
    except ProviderError as err:
        _say(f"could not list the Cloud Routers of {region} ({err}); going on as if a Cloud NAT served the VM")
        return
    for router in routers:
        if _name(router.network) != cfg.network:
            continue
        for nat in router.nats:
            if nat.source_subnetwork_ip_ranges_to_nat in NAT_ALL or any(
                    _name(s.name) == subnetwork for s in nat.subnetworks):
                return
    raise ConfigError("vm.external_ip", f"with external_ip: false the VM reaches the internet (apt, PyPI, the "
                      f"Hub) only through a Cloud NAT, and network {cfg.network} has none for subnetwork "
                      f"{subnetwork} in {region}",
                      f"create one: gcloud compute routers create mtpipe-nat --network {cfg.network} --region "
                      f"{region} --project {cfg.project} && gcloud compute routers nats create mtpipe-nat "
                      f"--router mtpipe-nat --region {region} --auto-allocate-nat-external-ips "
                      f"--nat-all-subnet-ip-ranges --project {cfg.project}")


def check_firewall(cfg: VmConfig, compute: Compute) -> bool:
    """Some enabled ingress rule of ``network`` admits tcp:22 from where SSH comes (ssh_route.sources)
    to the VM; else vm_up will create ``firewall.name`` for those ranges (then True). When SSH goes
    straight from this machine (sources unknown) only a rule open to 0.0.0.0/0 is known to admit it."""
    sources = ssh_route.sources(cfg)
    wanted = sources or [ssh_route.ANYWHERE]
    found = ssh_route.admitting(compute.list_firewalls(cfg.network), wanted, [cfg.name], cfg.service_account)
    if found:
        _say(f"SSH from {', '.join(wanted)}: firewall rule {', '.join(found)} of network {cfg.network} admits it")
        return False
    if sources:
        _say(f"SSH from {', '.join(sources)}: no firewall rule of network {cfg.network} admits it; vm_up creates "
             f"{cfg.firewall.name}")
        return True
    raise ConfigError("vm.firewall.source_ranges", f"no firewall rule of network {cfg.network} admits tcp:22 "
                      f"from anywhere (0.0.0.0/0) to VM {cfg.name}, and SSH would come straight from this "
                      "machine, whose public address mtpipe does not know",
                      "set external_ip: false in conf/vm.yaml (SSH through IAP: vm_up admits "
                      f"{ssh_route.IAP_RANGE} if no rule does), or list your address there as "
                      "firewall.source_ranges: [ADDRESS/32] (vm_up creates a rule for it)")


def os_login_source(cfg: VmConfig, compute: Compute, apis: GoogleApis) -> str | None:
    """What turns OS Login on for the VM: the project metadata enable-oslogin, or the organisation
    policy compute.requireOsLogin; None when neither does (a policy that cannot be read is said)."""
    value = compute.project_metadata().get("enable-oslogin", "")
    if value.lower() == "true":
        return f"project metadata enable-oslogin={value}"
    try:
        policy = apis.effective_policy(cfg.project, "compute.requireOsLogin")
    except ProviderError as err:
        _say(f"could not read the organisation policy compute.requireOsLogin ({err}); going by the project "
             "metadata, which does not enable OS Login (set ssh.os_login: true in conf/vm.yaml if your "
             "organisation enforces it)")
        return None
    return "organisation policy constraints/compute.requireOsLogin" if enforced(policy) else None


def check_os_login(cfg: VmConfig, compute: Compute, apis: GoogleApis,
                   import_key: bool = True) -> tuple[str, VmConfig]:
    """Where OS Login is on: 2-step verification is off for the account (an unattended SSH cannot
    answer its challenge), the caller may log in as an administrator, and (``import_key``) our public
    key goes into their OS Login profile (oslogin users.importSshPublicKey); ``ssh.user`` becomes the
    profile's primary POSIX user name. Returns what it is, and ``cfg`` with ``ssh.os_login`` decided."""
    if cfg.ssh.os_login is False:
        return "off (ssh.os_login: false): SSH keys go into the VM's metadata", cfg
    why = "ssh.os_login: true" if cfg.ssh.os_login is True else os_login_source(cfg, compute, apis)
    if why is None:
        return "off (neither the project metadata nor the organisation policy turns it on)", with_login(cfg, False)
    account = cfg.ssh.os_login_account or apis.account()
    if not account:
        raise ConfigError("vm.ssh.os_login_account", f"OS Login is on ({why}), and the Google credentials do "
                          "not say whose OS Login profile gets the SSH key",
                          "set ssh.os_login_account: YOU@EXAMPLE.COM (the account of your credentials) in "
                          "conf/vm.yaml")
    check_two_step(cfg, compute, account)
    try:
        granted = LOGIN_PERMISSION in apis.granted(cfg.project, [LOGIN_PERMISSION])
    except ProviderError as err:
        _say(f"could not test {LOGIN_PERMISSION} ({err}); going on")
        granted = True
    if not granted:
        raise ConfigError("vm.ssh.os_login", f"OS Login is on ({why}) and {account} lacks {LOGIN_PERMISSION} "
                          f"on project {cfg.project}: the VM would refuse the SSH login (and the setup's sudo)",
                          f"gcloud projects add-iam-policy-binding {cfg.project} --member {member(account)} --role "
                          "roles/compute.osAdminLogin (from outside the organisation also "
                          "roles/compute.osLoginExternalUser on the organisation)")
    if not import_key:
        return f"on ({why}): vm_up imports the SSH key into the OS Login profile of {account}", with_login(cfg, True)
    try:
        profile = apis.import_ssh_key(account, cfg.project, ssh.ssh_public_key(cfg))
    except ProviderError as err:
        raise ConfigError("vm.ssh.os_login", f"OS Login is on ({why}) and Google refused to import the SSH key "
                          f"into the OS Login profile of {account} ({err})",
                          f"check that ssh.os_login_account is the account of your credentials and that it may "
                          f"use OS Login in {cfg.project} (roles/compute.osAdminLogin)") from err
    accounts = profile.get("posixAccounts", [])
    primary = next((a for a in accounts if a.get("primary")), accounts[0] if accounts else {})
    if not primary.get("username"):
        raise ConfigError("vm.ssh.os_login", f"the OS Login profile of {account} has no POSIX account",
                          f"log in once with `gcloud compute ssh` to a VM of {cfg.project}, or ask an admin")
    user = primary["username"]
    _say(f"OS Login ({why}): the SSH key is in the OS Login profile of {account}; SSH as {user}")
    return f"on ({why}), SSH as {user}", with_login(cfg, True, user)


def check_two_step(cfg: VmConfig, compute: Compute, account: str) -> None:
    """OS Login 2-step verification (project metadata ``enable-oslogin-2fa``; the VM's own metadata
    does not set it) makes every SSH login of a user wait for a second factor, which vm_up's SSH
    cannot give: the VM would never become reachable. Google does not enforce it on service accounts
    (cloud.google.com/compute/docs/instances/managing-instance-access)."""
    value = compute.project_metadata().get("enable-oslogin-2fa", "")
    if value.lower() != "true" or account.endswith(".gserviceaccount.com"):
        return
    raise ConfigError("vm.ssh.os_login", f"OS Login 2-step verification is on in project {cfg.project} (project "
                      f"metadata enable-oslogin-2fa={value}): each SSH login as {account} would wait for a second "
                      "factor that vm_up's unattended SSH cannot give, and the VM would be deleted after "
                      "ssh.ready_timeout_s without ever being reached",
                      "run as a service account, on which Google does not enforce 2-step verification, by "
                      "impersonating it (no key file: organisations created since May 2024 forbid service-account "
                      "keys, iam.disableServiceAccountKeyCreation): `gcloud config set "
                      "auth/impersonate_service_account SA` and `gcloud auth application-default login "
                      "--impersonate-service-account SA` (you need roles/iam.serviceAccountTokenCreator on SA, "
                      "and SA roles/compute.osAdminLogin; the checks then run as SA), or ask the project's owner "
                      "to turn it off: gcloud compute project-info add-metadata --metadata "
                      f"enable-oslogin-2fa=FALSE --project {cfg.project}")
