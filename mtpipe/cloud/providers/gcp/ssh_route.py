"""How SSH reaches the VM: the route (its external IP, an IAP tunnel, another proxy command), the
addresses it comes from as the VM's firewall sees them, and which firewall rules admit it.

Firewall semantics are Compute's (cloud.google.com/firewall/docs/firewalls): a rule applies to
INGRESS traffic unless it says EGRESS, to every VM of its network unless it names target tags or
target service accounts, to every port of its protocols unless it lists ports; among the rules that
match a connection the one with the lowest priority number wins, and a deny rule wins a tie.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from typing import Any

IAP_RANGE = "35.235.240.0/20"   # where IAP's TCP forwarding connects from (Google's IAP docs)
ANYWHERE = "0.0.0.0/0"
# What `external_ip: false` uses when ssh.proxy_command is null: gcloud's IAP tunnel on stdin/stdout.
IAP_TUNNEL = ("gcloud compute start-iap-tunnel {name} {port} --listen-on-stdin --zone {zone} "
              "--project {project}")
DEFAULT_PRIORITY = 1000         # a rule's priority when it does not set one


def proxy_command(cfg: Any) -> str | None:
    """The command SSH runs to reach the VM (placeholders filled), or None: straight to its external IP.
    ``ssh.proxy_command`` when set; else the IAP tunnel when the VM has no external IP."""
    template = cfg.ssh.proxy_command or (None if cfg.external_ip else IAP_TUNNEL)
    if not template:
        return None
    return template.format(name=cfg.name, zone=cfg.zone, project=cfg.project, port=int(cfg.ssh.port))


def through_iap(cfg: Any) -> bool:
    """Whether SSH goes through an IAP tunnel (then it comes from IAP_RANGE)."""
    return "start-iap-tunnel" in (proxy_command(cfg) or "")


def sources(cfg: Any) -> list[str] | None:
    """The address ranges SSH to the VM comes from: ``firewall.source_ranges`` when set, else IAP's
    range when SSH goes through IAP; None when it goes straight from this machine, whose public
    address mtpipe does not know (only a rule admitting 0.0.0.0/0 is then known to let it in)."""
    if cfg.firewall.source_ranges:
        return [str(r) for r in cfg.firewall.source_ranges]
    return [IAP_RANGE] if through_iap(cfg) else None


def _ports_cover(ports: Iterable[str], port: int) -> bool:
    listed = list(ports)
    for entry in listed:
        low, _, high = entry.partition("-")
        if int(low) <= port <= int(high or low):
            return True
    return not listed   # no ports: every port


def _matches_port(entries: Iterable[Any], port: int) -> bool:
    return any(e.I_p_protocol in ("tcp", "all", "6") and _ports_cover(e.ports, port) for e in entries)


def _targets(rule: Any, tags: Sequence[str], service_account: str) -> bool:
    if rule.target_service_accounts:
        return service_account in rule.target_service_accounts
    if rule.target_tags:
        return bool(set(rule.target_tags) & set(tags))
    return True


def _networks(ranges: Iterable[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    return [ipaddress.ip_network(r, strict=False) for r in ranges]


def _applies(rule: Any, port: int, tags: Sequence[str], service_account: str) -> bool:
    """An enabled INGRESS rule for tcp:``port`` that targets a VM with ``tags`` and ``service_account``."""
    entries = rule.allowed or rule.denied
    return (not rule.disabled and (rule.direction or "INGRESS") == "INGRESS"
            and _matches_port(entries, port) and _targets(rule, tags, service_account))


def admitting(rules: Iterable[Any], ranges: Sequence[str], tags: Sequence[str], service_account: str,
              port: int = 22) -> list[str] | None:
    """The names of the firewall rules (compute_v1.Firewall) that admit tcp:``port`` from every one of
    ``ranges`` to a VM with network tags ``tags`` and ``service_account``, or None when some range is
    not admitted: no allow rule holds it, or a deny rule of equal or higher precedence overlaps it."""
    applying = [r for r in rules if _applies(r, port, tags, service_account)]

    def priority(rule: Any) -> int:
        return rule.priority if "priority" in rule else DEFAULT_PRIORITY

    used: list[str] = []
    for source in _networks(ranges):
        allow = [r for r in applying if r.allowed and any(
            source.version == n.version and source.subnet_of(n) for n in _networks(r.source_ranges))]
        best = min(allow, key=priority, default=None)
        if best is None or any(priority(d) <= priority(best) and any(
                source.version == n.version and source.overlaps(n) for n in _networks(d.source_ranges))
                for d in applying if d.denied):
            return None
        used.append(best.name)
    return sorted(set(used))
