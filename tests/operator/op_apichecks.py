"""Refusals of the real API server that kmock and kubernetes-validate do not make: object names,
label syntax, a RollingUpdate with maxSurge and maxUnavailable both 0, negative quantities and the
int-or-percent fields. Messages follow k8s.io/kubernetes/pkg/apis/*/validation, so the emulator
answers a bad child with the same 422 a cluster would. Written from the API server's rules, not from
the operator's code: the two must agree by test, not by sharing."""

from __future__ import annotations

import re
from typing import Any

# The Inference Extension's and the Gateway API's kinds have their own checker; re-exported for the tests.
from op_gatewaychecks import GATEWAY_KINDS as GATEWAY_KINDS
from op_gatewaychecks import gateway_api_errors as gateway_api_errors
from op_netpolchecks import netpol_errors

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUB = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_PERCENT = re.compile(r"^[0-9]+%$")
_QUANTITY = re.compile(r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$")

# Kinds whose name the API server checks as a DNS-1035 label (everything else: DNS-1123 subdomain);
# the LWS webhook checks a LeaderWorkerSet's name so (it names a headless Service after it).
_DNS1035_KINDS = {"Service", "LeaderWorkerSet"}


def _subdomain(value: str) -> bool:
    return len(value) <= 253 and bool(_DNS1123_SUB.match(value))


def _label_errors(labels: dict[str, Any] | None, where: str) -> list[str]:
    errors = []
    for key, value in (labels or {}).items():
        prefix, _, name = str(key).rpartition("/")
        if (prefix and not _subdomain(prefix)) or len(name) > 63 or not _NAME_PART.match(name):
            errors.append(
                f"{where}: Invalid value: {key!r}: name part must consist of alphanumeric characters"
            )
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            errors.append(
                f"{where}: Invalid value: {value!r}: a valid label must be an empty string or consist of "
                "alphanumeric characters, '-', '_' or '.' (63 characters at most)"
            )
    return errors


def _name_errors(kind: str, name: str) -> list[str]:
    if kind in _DNS1035_KINDS:
        if len(name) > 63 or not _DNS1035.match(name):
            return [
                f"metadata.name: Invalid value: {name!r}: a DNS-1035 label must consist of lower case "
                "alphanumeric characters or '-', start with an alphabetic character (63 characters at most)"
            ]
        return []
    if not _subdomain(name):
        return [f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain must consist of ..."]
    return []


def _int_or_percent(value: Any, where: str) -> tuple[list[str], bool]:
    """Errors, and whether the value is zero."""
    if isinstance(value, int):
        return (
            [f"{where}: Invalid value: {value}: must be greater than or equal to 0"] if value < 0 else []
        ), (value == 0)
    if not isinstance(value, str) or not _PERCENT.match(value):
        return [
            f"{where}: Invalid value: {value!r}: a valid percent string must be a numeric string followed by an ending '%'"
        ], False
    return [], int(value[:-1]) == 0


def _quantity_errors(resources: dict[str, Any] | None, where: str) -> list[str]:
    errors = []
    for section in ("requests", "limits"):
        for key, value in ((resources or {}).get(section) or {}).items():
            text = str(value)
            if not _QUANTITY.match(text):
                errors.append(f"{where}.{section}[{key}]: Invalid value: {text!r}: quantities must match")
            elif text.startswith("-"):
                errors.append(
                    f"{where}.{section}[{key}]: Invalid value: {text!r}: must be greater than or equal to 0"
                )
    return errors


def _pod_errors(pod: dict[str, Any], where: str) -> list[str]:
    errors: list[str] = []
    errors += _label_errors(pod.get("nodeSelector"), f"{where}.nodeSelector")
    for field in ("priorityClassName", "runtimeClassName", "serviceAccountName"):
        if field in pod and not _subdomain(str(pod[field])):
            errors.append(f"{where}.{field}: Invalid value: {pod[field]!r}")
    for vol in pod.get("volumes") or []:
        if not _DNS1123_LABEL.match(vol.get("name", "")):
            errors.append(f"{where}.volumes.name: Invalid value: {vol.get('name')!r}")
        claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
        if claim is not None and not _subdomain(claim):
            errors.append(f"{where}.volumes.persistentVolumeClaim.claimName: Invalid value: {claim!r}")
    for c in pod.get("containers") or []:
        image = c.get("image")
        if not image or image != image.strip():
            errors.append(f"{where}.containers.image: Invalid value: {image!r}")
        errors += _quantity_errors(c.get("resources"), f"{where}.containers.resources")
        for env in c.get("env") or []:
            ref = (env.get("valueFrom") or {}).get("secretKeyRef")
            if ref is not None and not (
                _subdomain(ref.get("name", "")) and re.match(r"^[-._a-zA-Z0-9]+$", ref.get("key", ""))
            ):
                errors.append(f"{where}.containers.env.valueFrom.secretKeyRef: Invalid value: {ref!r}")
    return errors


_SECCOMP_POD = "seccomp.security.alpha.kubernetes.io/pod"
_SECCOMP_CONTAINER = "container.seccomp.security.alpha.kubernetes.io/"
_APPARMOR_CONTAINER = "container.apparmor.security.beta.kubernetes.io/"
_SECCOMP_FIELD = {"RuntimeDefault": "runtime/default", "Unconfined": "unconfined"}


def _pod_annotation_errors(template: dict[str, Any], where: str) -> list[str]:
    """pkg/apis/core/validation: AppArmor annotations must name a container of the pod; a legacy seccomp
    annotation must agree with the seccompProfile field where both are set (validateSeccompAnnotationsAndFields)."""
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    spec = template.get("spec") or {}
    names = {c.get("name") for c in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]}
    errors = []
    for key, value in annotations.items():
        if key.startswith(_APPARMOR_CONTAINER) and key[len(_APPARMOR_CONTAINER) :] not in names:
            errors.append(f"{where}.metadata.annotations[{key}]: Invalid value: container not found")
        pod_field = ((spec.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
        if key == _SECCOMP_POD and pod_field and _SECCOMP_FIELD.get(pod_field) != value:
            errors.append(
                f"{where}.metadata.annotations[{key}]: Forbidden: seccomp type in annotation and field must match"
            )
        if key.startswith(_SECCOMP_CONTAINER):
            container = key[len(_SECCOMP_CONTAINER) :]
            for c in spec.get("containers") or []:
                field = ((c.get("securityContext") or {}).get("seccompProfile") or {}).get(
                    "type"
                ) or pod_field
                if c.get("name") == container and field and _SECCOMP_FIELD.get(field) != value:
                    errors.append(
                        f"{where}.metadata.annotations[{key}]: Forbidden: seccomp type in annotation and field must match"
                    )
    return errors


def api_errors(obj: dict[str, Any]) -> list[str]:
    """What the API server would answer with 422 for this object (empty: accepted)."""
    kind = obj.get("kind", "")
    meta = obj.get("metadata") or {}
    # generateName: the server appends 5 characters to it.
    errors = _name_errors(kind, str(meta.get("name") or (meta.get("generateName", "") + "x1234")))
    errors += _label_errors(meta.get("labels"), "metadata.labels")
    spec = obj.get("spec") or {}
    errors += _label_errors((spec.get("selector") or {}).get("matchLabels"), "spec.selector.matchLabels")
    if kind == "NetworkPolicy":
        errors += netpol_errors(spec)
        # Every LabelSelector of a policy (the pods it selects, its peers' pods and namespaces) is
        # validated like metadata.labels (ValidateLabelSelector).
        errors += _label_errors(
            (spec.get("podSelector") or {}).get("matchLabels"), "spec.podSelector.matchLabels"
        )
        for direction, side in (("ingress", "from"), ("egress", "to")):
            for rule in spec.get(direction) or []:
                for peer in rule.get(side) or []:
                    for selector in ("podSelector", "namespaceSelector"):
                        errors += _label_errors(
                            (peer.get(selector) or {}).get("matchLabels"),
                            f"spec.{direction}.{side}.{selector}.matchLabels",
                        )
    if kind == "Service":
        errors += _label_errors(spec.get("selector"), "spec.selector")
    if kind == "Deployment":
        template = spec.get("template") or {}
        errors += _label_errors(
            (template.get("metadata") or {}).get("labels"), "spec.template.metadata.labels"
        )
        rolling = (spec.get("strategy") or {}).get("rollingUpdate") or {}
        surge_err, surge_zero = _int_or_percent(
            rolling.get("maxSurge", "25%"), "spec.strategy.rollingUpdate.maxSurge"
        )
        unav_err, unav_zero = _int_or_percent(
            rolling.get("maxUnavailable", "25%"), "spec.strategy.rollingUpdate.maxUnavailable"
        )
        errors += surge_err + unav_err
        if surge_zero and unav_zero:
            errors.append(
                "spec.strategy.rollingUpdate.maxUnavailable: Invalid value: 0: may not be 0 when `maxSurge` is 0"
            )
        errors += _pod_errors(template.get("spec") or {}, "spec.template.spec")
        errors += _pod_annotation_errors(template, "spec.template")
    if kind == "LeaderWorkerSet":
        # kubernetes-sigs/lws pkg/webhooks/leaderworkerset_webhook.go (v0.9.0), generalValidate
        if int(spec.get("replicas", 1)) < 0:
            errors.append("spec.replicas: Invalid value: replicas must be equal or greater than 0")
        lwt = spec.get("leaderWorkerTemplate") or {}
        if int(lwt.get("size", 1)) < 1:
            errors.append(
                "spec.leaderWorkerTemplate.size: Invalid value: size must be equal or greater than 1"
            )
        rolling = (spec.get("rolloutStrategy") or {}).get("rollingUpdateConfiguration") or {}
        where = "spec.rolloutStrategy.rollingUpdateConfiguration"
        surge_err, surge_zero = _int_or_percent(rolling.get("maxSurge", 0), f"{where}.maxSurge")
        unav_err, unav_zero = _int_or_percent(rolling.get("maxUnavailable", 1), f"{where}.maxUnavailable")
        errors += surge_err + unav_err
        if surge_zero and unav_zero and int(spec.get("replicas", 1)) != 0:
            errors.append(f"{where}.maxUnavailable: Invalid value: 0: must not be 0 when `maxSurge` is 0")
        for role in ("leaderTemplate", "workerTemplate"):
            template = lwt.get(role) or {}
            errors += _label_errors(
                (template.get("metadata") or {}).get("labels"),
                f"spec.leaderWorkerTemplate.{role}.metadata.labels",
            )
            errors += _pod_errors(template.get("spec") or {}, f"spec.leaderWorkerTemplate.{role}.spec")
    if kind == "PodDisruptionBudget":
        for field in ("minAvailable", "maxUnavailable"):
            if field in spec:
                errors += _int_or_percent(spec[field], f"spec.{field}")[0]
    if kind == "Job":
        if len(str(meta.get("name") or "")) > 63:
            errors.append("metadata.name: Invalid value: must be no more than 63 characters (a label value)")
        pod = (spec.get("template") or {}).get("spec") or {}
        if pod.get("restartPolicy") not in ("Never", "OnFailure"):
            errors.append(
                f"spec.template.spec.restartPolicy: Unsupported value: {pod.get('restartPolicy')!r}: "
                'supported values: "OnFailure", "Never"'
            )
        if int(spec.get("backoffLimit", 6)) < 0:
            errors.append("spec.backoffLimit: Invalid value: must be greater than or equal to 0")
        errors += _pod_errors(pod, "spec.template.spec")
    if kind == "PersistentVolumeClaim":
        if not spec.get("accessModes"):
            errors.append("spec.accessModes: Required value: at least 1 access mode is required")
        storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage")
        if storage is None:
            errors.append("spec.resources[storage]: Required value")
        elif not _QUANTITY.match(str(storage)) or _quantity_value(storage) <= 0:
            errors.append(f"spec.resources[storage]: Invalid value: {storage!r}: must be greater than zero")
    if kind == "HorizontalPodAutoscaler":
        if int(spec.get("minReplicas", 1)) < 1:
            errors.append("spec.minReplicas: Invalid value: must be greater than or equal to 1")
        if int(spec.get("maxReplicas", 1)) < int(spec.get("minReplicas", 1)):
            errors.append("spec.maxReplicas: Invalid value: must be greater than or equal to `minReplicas`")
    return errors


def _quantity_value(value: Any) -> float:
    m = re.match(r"^[+]?([0-9.]+)([KMGTPE]i|[numkMGTPE])?$", str(value))
    if m is None:
        return float("nan")
    units: dict[str, float] = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
    units |= {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
    return float(m.group(1)) * units.get(m.group(2) or "", 1)


def update_errors(kind: str, old: dict[str, Any], new_spec: dict[str, Any]) -> list[str]:
    """What the API server refuses in an update of a live object whose spec would become `new_spec`
    (the patch already merged): a Job's pod template is immutable, and a claim's spec is immutable
    after creation except a larger storage request (k8s.io/kubernetes/pkg/apis/batch|core/validation)."""
    old_spec = old.get("spec") or {}
    if kind == "Job" and new_spec.get("template") != old_spec.get("template"):
        return ["spec.template: Invalid value: field is immutable"]
    if kind == "PersistentVolumeClaim":

        def without_storage(spec: dict[str, Any]) -> dict[str, Any]:
            out = {k: v for k, v in spec.items() if k != "resources"}
            requests = dict((spec.get("resources") or {}).get("requests") or {})
            requests.pop("storage", None)
            return {**out, "requests": requests}

        if without_storage(new_spec) != without_storage(old_spec):
            return [
                "spec: Forbidden: spec is immutable after creation except resources.requests and "
                "volumeAttributesClassName for bound claims"
            ]
        before = ((old_spec.get("resources") or {}).get("requests") or {}).get("storage")
        after = ((new_spec.get("resources") or {}).get("requests") or {}).get("storage")
        if before is not None and after is not None and _quantity_value(after) < _quantity_value(before):
            return ["spec.resources.requests.storage: Forbidden: field can not be less than previous value"]
    return []


_BINARY = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]


def canonical_quantity(value: Any) -> Any:
    """The API server's canonical form for the common cases: fractions of a plain number become
    milli-units ("0.5" -> "500m"), fractional binary units step down ("1.5Gi" -> "1536Mi"), whole
    milli-units step up ("2000m" -> "2"). Other spellings are returned unchanged."""
    from decimal import Decimal

    text = str(value)
    m = re.match(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|m)?$", text)
    if m is None:
        return value
    number, suffix = Decimal(m.group(1)), m.group(2) or ""
    if suffix == "" and number != number.to_integral_value():
        return f"{int(number * 1000)}m" if (number * 1000) == (number * 1000).to_integral_value() else value
    if suffix == "m" and number % 1000 == 0:
        return str(int(number / 1000))
    if suffix in _BINARY[1:] and number != number.to_integral_value():
        i = _BINARY.index(suffix)
        while i > 0 and number != number.to_integral_value():
            number, i = number * 1024, i - 1
        return f"{int(number)}{_BINARY[i]}"
    return value if not isinstance(value, int) else str(value)


def canonicalize_resources(obj: dict[str, Any]) -> None:
    """Rewrite a Deployment's container requests and limits as the API server stores them."""
    pod = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    for c in pod.get("containers") or []:
        for section in ("requests", "limits"):
            values = (c.get("resources") or {}).get(section)
            if isinstance(values, dict):
                for key in list(values):
                    values[key] = canonical_quantity(values[key])
