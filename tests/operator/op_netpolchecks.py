"""The refusals a real kube-apiserver makes to a NetworkPolicy's ports, peers, ipBlocks, policy types and
selector operators (k8s.io/kubernetes/pkg/apis/networking/validation, read for v1.36; label syntax is
op_apichecks' part). Messages name the field as the API server does (`spec.egress[1].to[0].ipBlock.
except[0]: Invalid value: "192.168.0.0/16": must be a strict subset of `cidr``); test_op_netpol_apiserver.py
holds the verdicts seen on kube-apiserver v1.36.2 (issue 48) that these reproduce."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

_PROTOCOLS = ("TCP", "UDP", "SCTP")
_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
# IANA_SVC_NAME (k8s.io/apimachinery/pkg/util/validation IsValidPortName)
_PORT_NAME = re.compile(r"^[-a-z0-9]+$")


def _port_name_errors(name: str, where: str) -> list[str]:
    if len(name) > 15:
        return [f'{where}: Invalid value: "{name}": must be no more than 15 characters']
    if not _PORT_NAME.match(name):
        return [
            f'{where}: Invalid value: "{name}": must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-)'
        ]
    if "--" in name or name.startswith("-") or name.endswith("-"):
        return [
            f'{where}: Invalid value: "{name}": must not contain consecutive hyphens or begin or end with a hyphen'
        ]
    if not re.search(r"[a-z]", name):
        return [f'{where}: Invalid value: "{name}": must contain at least one letter (a-z)']
    return []


def _port_errors(port: dict[str, Any], where: str) -> list[str]:
    errors = []
    protocol = port.get("protocol", "TCP")
    if protocol not in _PROTOCOLS:
        errors.append(
            f'{where}.protocol: Unsupported value: "{protocol}": supported values: "TCP", "UDP", "SCTP"'
        )
    number = port.get("port")
    if isinstance(number, int):
        if not 1 <= number <= 65535:
            errors.append(f"{where}.port: Invalid value: {number}: must be between 1 and 65535, inclusive")
    elif isinstance(number, str):
        errors += _port_name_errors(number, f"{where}.port")
    end = port.get("endPort")
    if end is not None:
        if not isinstance(number, int):
            errors.append(
                f"{where}.endPort: Invalid value: {end}: may not be specified when `port` is non-numeric"
            )
        elif end < number:
            # the API server reports `port` here, not endPort (seen on v1.36.2)
            errors.append(
                f"{where}.endPort: Invalid value: {number}: must be greater than or equal to `port`"
            )
        elif end > 65535:
            errors.append(f"{where}.endPort: Invalid value: {end}: must be between 1 and 65535, inclusive")
    return errors


def _cidr(value: Any, where: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network | None, list[str]]:
    try:
        return ipaddress.ip_network(str(value), strict=True), []
    except ValueError as exc:
        if "has host bits set" in str(exc):
            return None, [
                f'{where}: Invalid value: "{value}": must not have bits set beyond the prefix length'
            ]
        return None, [
            f'{where}: Invalid value: "{value}": must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)'
        ]


def _ip_block_errors(block: dict[str, Any], where: str) -> list[str]:
    cidr, errors = _cidr(block.get("cidr"), f"{where}.cidr")
    if "cidr" not in block:
        return [f"{where}.cidr: Required value"]
    for i, value in enumerate(block.get("except") or []):
        sub, sub_errors = _cidr(value, f"{where}.except[{i}]")
        errors += sub_errors
        if sub is None or cidr is None:
            continue
        strict_subset = (
            sub.version == cidr.version and sub.prefixlen > cidr.prefixlen and sub.subnet_of(cidr)  # type: ignore[arg-type]
        )
        if not strict_subset:
            errors.append(f'{where}.except[{i}]: Invalid value: "{value}": must be a strict subset of `cidr`')
    return errors


def _selector_operator_errors(selector: Any, where: str) -> list[str]:
    errors = []
    for i, expr in enumerate((selector or {}).get("matchExpressions") or []):
        op = expr.get("operator")
        at = f"{where}.matchExpressions[{i}]"
        if op not in _OPERATORS:
            errors.append(f'{at}.operator: Invalid value: "{op}": not a valid selector operator')
        elif op in ("In", "NotIn") and not expr.get("values"):
            errors.append(
                f"{at}.values: Required value: must be specified when `operator` is 'In' or 'NotIn'"
            )
        elif op in ("Exists", "DoesNotExist") and expr.get("values"):
            errors.append(
                f"{at}.values: Forbidden: may not be specified when `operator` is 'Exists' or 'DoesNotExist'"
            )
    return errors


def netpol_errors(spec: dict[str, Any]) -> list[str]:
    """The 422 field errors of a NetworkPolicy's spec besides label syntax (empty: valid)."""
    errors = _selector_operator_errors(spec.get("podSelector"), "spec.podSelector")
    for direction, side in (("ingress", "from"), ("egress", "to")):
        for i, rule in enumerate(spec.get(direction) or []):
            for j, port in enumerate(rule.get("ports") or []):
                errors += _port_errors(port, f"spec.{direction}[{i}].ports[{j}]")
            for j, peer in enumerate(rule.get(side) or []):
                where = f"spec.{direction}[{i}].{side}[{j}]"
                selectors = [k for k in ("podSelector", "namespaceSelector") if peer.get(k) is not None]
                if peer.get("ipBlock") is not None:
                    if selectors:
                        errors.append(f"{where}: Forbidden: may not specify both ipBlock and another peer")
                    errors += _ip_block_errors(peer["ipBlock"], f"{where}.ipBlock")
                elif not selectors:
                    errors.append(f"{where}: Required value: must specify a peer")
                for k in selectors:
                    errors += _selector_operator_errors(peer[k], f"{where}.{k}")
    types = spec.get("policyTypes") or []
    if len(types) > 2:
        errors.append(f"spec.policyTypes: Invalid value: {types}: may not specify more than two policyTypes")
    for i, t in enumerate(types):
        if t not in ("Ingress", "Egress"):
            errors.append(
                f'spec.policyTypes[{i}]: Unsupported value: "{t}": supported values: "Ingress", "Egress"'
            )
    return errors
