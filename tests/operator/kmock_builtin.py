"""The built-in kinds the operator writes, as kube-apiserver v1.36.2 decodes and validates them, for kmock.

kmock stored any Deployment, Service, ... whatever it held: an unknown field, a string `replicas`, a
container without a name or a Deployment whose selector misses its template's labels all passed the mock
and failed (or were silently dropped) on a real cluster. This module gives kmock what the real server
does before it stores such an object:

- the schemas: `schemas/builtin.k8s.io_openapi_v3.json`, the server's own `/openapi/v3` components
  reachable from the kinds below, trimmed to the structural keys; `builtin_schemas()` resolves them for
  kmock_pruning (unknown fields are dropped, and refused or warned about under `fieldValidation`);
- the JSON decoder's type errors (`400 BadRequest ... json: cannot unmarshal string into Go struct field
  DeploymentSpec.spec.replicas of type int32`), `type_error`;
- the validation refusals with their causes (`422 Invalid`, a `FieldValueRequired` cause naming
  `spec.template.spec.containers[0].name`), `invalid_causes` and `update_causes`: selectors, containers,
  ports wherever the server checks them, probes, requests against limits, budgets, HPA metrics;
- a merge patch whose result has a type error: `patch_type_error`, a 422 on the field `patch`.

kmock_builtin_answers.json holds the real server's answers that test_op_kmock_builtin.py replays here.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
from decimal import Decimal
from typing import Any

from kmock import KubernetesError
from op_apichecks import canonical_quantity

SCHEMA_FILE = pathlib.Path(__file__).parent / "schemas" / "builtin.k8s.io_openapi_v3.json"
# plural -> (kind, the group the error messages qualify the kind with; "" for the core group)
PLURALS = {
    "deployments": ("Deployment", "apps"),
    "services": ("Service", ""),
    "serviceaccounts": ("ServiceAccount", ""),
    "configmaps": ("ConfigMap", ""),
    "horizontalpodautoscalers": ("HorizontalPodAutoscaler", "autoscaling"),
    "poddisruptionbudgets": ("PodDisruptionBudget", "policy"),
    "networkpolicies": ("NetworkPolicy", "networking.k8s.io"),
    "jobs": ("Job", "batch"),
    "persistentvolumeclaims": ("PersistentVolumeClaim", ""),
}
# Definitions decoded from a JSON string or number alike (resource.Quantity, intstr.IntOrString).
_SCALARS = (
    "io.k8s.apimachinery.pkg.api.resource.Quantity",
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString",
)


@functools.cache
def _definitions() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())["definitions"]  # type: ignore[no-any-return]


def _resolve(node: dict[str, Any], seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """`node` with its `$ref`s (and single-`$ref` allOf) inlined; an object from a definition carries
    `x-go-type` (`v1.Container`) and `x-go-struct` (`Container`) for the decoder's messages."""
    ref = node.get("$ref")
    if ref is None and len(node.get("allOf") or []) == 1:
        ref = node["allOf"][0].get("$ref")
    if ref is not None:
        assert ref not in seen, f"recursive schema at {ref}"  # none among the kinds kept
        if ref in _SCALARS:
            return {"x-scalar": True}
        target = _resolve(_definitions()[ref], (*seen, ref))
        if target.get("type") == "object" or "properties" in target:
            parts = ref.split(".")
            target = {**target, "x-go-type": f"{parts[-2]}.{parts[-1]}", "x-go-struct": parts[-1]}
        return target
    out = {k: v for k, v in node.items() if k not in ("properties", "items", "additionalProperties")}
    if "properties" in node:
        out["properties"] = {k: _resolve(v, seen) for k, v in node["properties"].items()}
        out.setdefault("type", "object")
    if isinstance(node.get("items"), dict):
        out["items"] = _resolve(node["items"], seen)
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _resolve(node["additionalProperties"], seen)
    if node.get("format") == "int-or-string":
        out["x-scalar"] = True
    return out


@functools.cache
def _schemas() -> dict[str, dict[str, Any]]:
    kinds = json.loads(SCHEMA_FILE.read_text())["kinds"]
    return {plural: _resolve({"$ref": kinds[kind]}) for plural, (kind, _) in PLURALS.items()}


def builtin_schemas() -> dict[str, dict[str, Any]]:
    """Structural schemas by plural, for kmock_pruning (shared: callers must not mutate them)."""
    return dict(_schemas())


def _go_type(schema: dict[str, Any]) -> str:
    if "x-go-type" in schema:
        return str(schema["x-go-type"])
    kind = schema.get("type")
    if kind == "integer":
        return str(schema.get("format") or "int64")
    if kind == "boolean":
        return "bool"
    if kind == "number":
        return "float64"
    if kind == "array":
        return "[]" + _go_type(schema.get("items") or {})
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return "map[string]" + _go_type(schema["additionalProperties"])
    return "string"


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return "string"


def _fits(value: Any, schema: dict[str, Any]) -> bool:
    if value is None or not schema:
        return True  # null decodes into anything; a schemaless node takes any JSON
    if schema.get("x-scalar"):
        return not isinstance(value, dict | list)
    kind = schema.get("type") or ("object" if "properties" in schema else None)
    return {
        "integer": isinstance(value, int | float) and not isinstance(value, bool),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "string": isinstance(value, str),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
    }.get(str(kind), True)


def _first_type_error(value: Any, schema: dict[str, Any], struct: str, path: str) -> str | None:
    """Go's decoder reports the first mismatch in document order: the innermost struct, the field's
    JSON path without indices or map keys, and the Go type it wanted."""
    if not _fits(value, schema):
        return (
            f"json: cannot unmarshal {_json_type(value)} into Go struct field {struct}.{path} "
            f"of type {_go_type(schema)}"
        )
    if isinstance(value, dict) and "properties" in schema:
        inner = str(schema.get("x-go-struct") or struct)
        for key, sub in value.items():
            sub_schema = schema["properties"].get(key)
            if sub_schema is not None:
                found = _first_type_error(sub, sub_schema, inner, f"{path}.{key}" if path else key)
                if found:
                    return found
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for sub in value.values():
            found = _first_type_error(sub, schema["additionalProperties"], struct, path)
            if found:
                return found
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for sub in value:
            found = _first_type_error(sub, schema["items"], struct, path)
            if found:
                return found
    return None


def type_error(plural: str, obj: dict[str, Any]) -> KubernetesError | None:
    """The real server's 400 for a create or replace body of a built-in kind whose JSON does not fit
    its Go types (None when it fits, or for a kind without a schema here)."""
    if plural not in PLURALS or not isinstance(obj, dict):
        return None
    kind = PLURALS[plural][0]
    schema = _schemas()[plural]
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
    found = _first_type_error(body, schema, kind, "")
    if found is None:
        return None
    version = str(obj.get("apiVersion") or "").rsplit("/", 1)[-1]
    return KubernetesError(
        status=400,
        reason="BadRequest",
        message=f'{kind} in version "{version}" cannot be handled as a {kind}: {found}',
    )


def _required(field: str, detail: str = "") -> dict[str, str]:
    message = "Required value" + (f": {detail}" if detail else "")
    return {"reason": "FieldValueRequired", "message": message, "field": field}


def _invalid(field: str, value: Any, detail: str) -> dict[str, str]:
    shown = json.dumps(value, separators=(",", ":"))
    return {"reason": "FieldValueInvalid", "message": f"Invalid value: {shown}: {detail}", "field": field}


def _forbidden(field: str, detail: str) -> dict[str, str]:
    return {"reason": "FieldValueForbidden", "message": f"Forbidden: {detail}", "field": field}


def _duplicate(field: str, value: Any) -> dict[str, str]:
    return {
        "reason": "FieldValueDuplicate",
        "message": f"Duplicate value: {json.dumps(value)}",
        "field": field,
    }


def _nonnegative(value: Any, field: str) -> list[dict[str, str]]:
    """ValidateNonnegativeField; an absent field is Go's zero value."""
    number = value or 0
    return [_invalid(field, number, "must be greater than or equal to 0")] if number < 0 else []


# apimachinery's util/validation messages (IsValidPortNum, IsValidPortName, IsDNS1123Label, ...).
_PORT_RANGE = "must be between 1 and 65535, inclusive"
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start "
    "and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used "
    "for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
_CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_CONFIG_KEY_MSG = (
    "a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or "
    "'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')"
)


def _port_name_messages(name: str) -> list[str]:
    """IsValidPortName: an IANA service name (a named container port, a targetPort or probe port)."""
    messages = []
    if len(name) > 15:
        messages.append("must be no more than 15 characters")
    if not re.match(r"^[-a-z0-9]+$", name):
        messages.append("must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-)")
    if not re.search(r"[a-z]", name):
        messages.append("must contain at least one letter (a-z)")
    if "--" in name:
        messages.append("must not contain consecutive hyphens")
    if name.startswith("-") or name.endswith("-"):
        messages.append("must not begin or end with a hyphen")
    return messages


def _port_number(value: Any, field: str) -> list[dict[str, str]]:
    number = value or 0
    return [] if 1 <= number <= 65535 else [_invalid(field, number, _PORT_RANGE)]


def _port_num_or_name(value: Any, field: str) -> list[dict[str, str]]:
    """ValidatePortNumOrName: an int-or-string port (targetPort, a probe's, a NetworkPolicy's)."""
    if isinstance(value, str):
        return [_invalid(field, value, msg) for msg in _port_name_messages(value)]
    return _port_number(value, field)


def _dns1123_label(value: str, field: str) -> list[dict[str, str]]:
    causes = [_invalid(field, value, "must be no more than 63 characters")] if len(value) > 63 else []
    if not _DNS1123_LABEL.match(value):
        causes.append(_invalid(field, value, _DNS1123_LABEL_MSG))
    return causes


def _label_values(labels: dict[str, Any], field: str) -> list[dict[str, str]]:
    """ValidateLabels' value half (the keys stay with op_apichecks): the path is the map's, not a key's.
    The newer content package says "bytes" where the port-name check says "characters"."""
    causes = []
    for value in labels.values():
        if not isinstance(value, str):
            continue
        if len(value.encode()) > 63:
            causes.append(_invalid(field, value, "must be no more than 63 bytes"))
        if not _LABEL_VALUE.match(value):
            causes.append(_invalid(field, value, _LABEL_VALUE_MSG))
    return causes


def _amount(value: Any) -> Decimal | None:
    """A resource.Quantity's value (None when it does not parse; op_apichecks refuses those)."""
    match = re.match(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([KMGTPE]i|[numkMGTPE])?$", str(value).strip())
    if match is None:
        return None
    binary = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
    decimal = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
    suffix = match.group(2) or ""
    scale = Decimal(2) ** binary[suffix] if suffix in binary else Decimal(10) ** decimal[suffix]
    return Decimal(match.group(1)) * scale


def _overcommittable(resource: str) -> bool:
    """helper.IsOvercommitAllowed: native resources (no domain, or kubernetes.io) but not hugepages;
    an extended resource such as nvidia.com/gpu must request exactly its limit."""
    native = "/" not in resource or "kubernetes.io/" in resource
    return native and not resource.startswith("hugepages-")


def _resource_causes(resources: dict[str, Any], field: str) -> list[dict[str, str]]:
    """validateResourceRequirements' request/limit pairing. The real server walks the requests map in Go's
    random order; here the body's order, so a case must not break two resources at once."""
    limits = resources.get("limits") or {}
    causes = []
    for name, request in (resources.get("requests") or {}).items():
        shown = canonical_quantity(request)
        if name in limits:
            wanted, limit = _amount(request), _amount(limits[name])
            if wanted is None or limit is None:
                continue
            limit_shown = canonical_quantity(limits[name])
            if wanted != limit and not _overcommittable(name):
                causes.append(
                    _invalid(f"{field}.requests", shown, f"must be equal to {name} limit of {limit_shown}")
                )
            elif wanted > limit:
                causes.append(
                    _invalid(
                        f"{field}.requests",
                        shown,
                        f"must be less than or equal to {name} limit of {limit_shown}",
                    )
                )
        elif not _overcommittable(name):
            causes.append(_required(f"{field}.limits", "Limit must be set for non overcommitable resources"))
    return causes


_HANDLERS = ("exec", "httpGet", "tcpSocket", "grpc", "sleep")


def _probe_causes(probe: dict[str, Any], field: str, single_success: bool) -> list[dict[str, str]]:
    """validateProbe after defaulting: a zero period, timeout or threshold is defaulted (10, 1, 1, 3), so
    only negatives are refused; liveness and startup probes must succeed once (successThreshold 1)."""
    causes: list[dict[str, str]] = []
    present = [h for h in _HANDLERS if probe.get(h) is not None]
    for extra in present[1:]:
        causes.append(_forbidden(f"{field}.{extra}", "may not specify more than 1 handler type"))
    if not present:
        causes.append(_required(field, "must specify a handler type"))
    elif present[0] in ("httpGet", "tcpSocket"):
        causes += _port_num_or_name(probe[present[0]].get("port"), f"{field}.{present[0]}.port")
    elif present[0] == "grpc":
        causes += _port_number(probe["grpc"].get("port"), f"{field}.grpc.port")
    for key in (
        "initialDelaySeconds",
        "timeoutSeconds",
        "periodSeconds",
        "successThreshold",
        "failureThreshold",
    ):
        causes += _nonnegative(probe.get(key), f"{field}.{key}")
    success = probe.get("successThreshold") or 1
    if single_success and success != 1:
        causes.append(_invalid(f"{field}.successThreshold", success, "must be 1"))
    return causes


def _container_port_causes(ports: list[dict[str, Any]], field: str) -> list[dict[str, str]]:
    causes, names = [], set()
    for i, port in enumerate(ports):
        name = port.get("name") or ""
        if name:
            messages = _port_name_messages(name)
            causes += [_invalid(f"{field}[{i}].name", name, msg) for msg in messages]
            if not messages and name in names:
                causes.append(_duplicate(f"{field}[{i}].name", name))
            names.add(name)
        if not port.get("containerPort"):
            causes.append(_required(f"{field}[{i}].containerPort"))
        else:
            causes += _port_number(port["containerPort"], f"{field}[{i}].containerPort")
    return causes


def _env_causes(env: list[dict[str, Any]], field: str) -> list[dict[str, str]]:
    """RelaxedEnvironmentVariableValidation is on in 1.36: any printable ASCII but '=' ("1BAD" passes)."""
    causes = []
    for i, var in enumerate(env):
        name = var.get("name") or ""
        if not name:
            causes.append(_required(f"{field}[{i}].name"))
        elif not all(" " <= ch <= "~" and ch != "=" for ch in name):
            causes.append(
                _invalid(
                    f"{field}[{i}].name",
                    name,
                    "a valid environment variable name must consist only of printable ASCII characters "
                    "other than '='",
                )
            )
    return causes


def _container_causes(container: dict[str, Any], field: str) -> list[dict[str, str]]:
    """validateContainerCommon, then the probes (validateContainers), in the server's order."""
    causes = []
    if not container.get("name"):
        causes.append(_required(f"{field}.name"))
    if not container.get("image"):
        causes.append(_required(f"{field}.image"))
    causes += _container_port_causes(container.get("ports") or [], f"{field}.ports")
    causes += _env_causes(container.get("env") or [], f"{field}.env")
    causes += _resource_causes(container.get("resources") or {}, f"{field}.resources")
    for probe, single_success in (("livenessProbe", True), ("readinessProbe", False), ("startupProbe", True)):
        if container.get(probe) is not None:
            causes += _probe_causes(container[probe], f"{field}.{probe}", single_success)
    return causes


def _pod_causes(template: dict[str, Any], where: str) -> list[dict[str, str]]:
    """ValidatePodTemplateSpec: the template's labels (the path has no `metadata`: ObjectMeta is inlined
    in the internal type), then the containers."""
    causes = _label_values(((template.get("metadata") or {}).get("labels")) or {}, f"{where}.labels")
    spec = template.get("spec") or {}
    containers = spec.get("containers") or []
    if not containers:
        return [*causes, _required(f"{where}.spec.containers")]
    for i, container in enumerate(containers):
        causes += _container_causes(container, f"{where}.spec.containers[{i}]")
    return causes


def _selector_matches(selector: dict[str, Any], labels: dict[str, Any]) -> bool:
    """matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist) against a label map."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and key in labels and labels[key] in values)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def _deployment_causes(spec: dict[str, Any]) -> list[dict[str, str]]:
    causes = _nonnegative(spec.get("replicas"), "spec.replicas")
    selector = spec.get("selector")
    labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    if selector is None:
        causes.append(_required("spec.selector"))
    elif not (selector.get("matchLabels") or selector.get("matchExpressions")):
        causes.append(_invalid("spec.selector", selector, "empty selector is invalid for deployment"))
    if (selector is None or selector.get("matchLabels") or selector.get("matchExpressions")) and not (
        selector is not None and _selector_matches(selector, labels)
    ):
        causes.append(
            _invalid("spec.template.metadata.labels", labels, "`selector` does not match template `labels`")
        )
    return causes + _pod_causes(spec.get("template") or {}, "spec.template")


def _service_causes(spec: dict[str, Any]) -> list[dict[str, str]]:
    """validateServicePort: a name is required once there are two ports; an int targetPort of 0 is
    defaulted to the port (so passes), a string one is an IANA port name."""
    ports = spec.get("ports") or []
    causes, names = [], set()
    for i, port in enumerate(ports):
        where = f"spec.ports[{i}]"
        name = port.get("name") or ""
        if len(ports) > 1 and not name:
            causes.append(_required(f"{where}.name"))
        elif name:
            causes += _dns1123_label(name, f"{where}.name")
            if name in names:
                causes.append(_duplicate(f"{where}.name", name))
            names.add(name)
        causes += _port_number(port.get("port"), f"{where}.port")
        if port.get("targetPort") not in (None, 0, ""):
            causes += _port_num_or_name(port["targetPort"], f"{where}.targetPort")
    return causes


def _int_or_percent(value: Any, field: str) -> list[dict[str, str]]:
    """ValidatePositiveIntOrPercent and IsNotMoreThan100Percent (a PDB's budgets)."""
    if not isinstance(value, str):
        return _nonnegative(value, field)
    if not re.match(r"^[0-9]+%$", value):
        return [
            _invalid(
                field,
                value,
                "a valid percent string must be a numeric string followed by an ending '%' "
                "(e.g. '1%',  or '93%', regex used for validation is '[0-9]+%')",
            )
        ]
    return [_invalid(field, value, "must not be greater than 100%")] if int(value[:-1]) > 100 else []


def _pdb_causes(spec: dict[str, Any]) -> list[dict[str, str]]:
    causes = []
    if spec.get("minAvailable") is not None and spec.get("maxUnavailable") is not None:
        # The value shown is the internal Go struct, marshalled with its Go field names.
        shown = {
            "MinAvailable": spec["minAvailable"],
            "Selector": spec.get("selector"),
            "MaxUnavailable": spec["maxUnavailable"],
            "UnhealthyPodEvictionPolicy": spec.get("unhealthyPodEvictionPolicy"),
        }
        causes.append(_invalid("spec", shown, "minAvailable and maxUnavailable cannot be both set"))
    for key in ("minAvailable", "maxUnavailable"):
        if spec.get(key) is not None:
            causes += _int_or_percent(spec[key], f"spec.{key}")
    return causes


def _metric_target_causes(target: dict[str, Any], field: str) -> list[dict[str, str]]:
    causes = []
    kind = target.get("type") or ""
    if not kind:
        causes.append(_required(f"{field}.type", "must specify a metric target type"))
    if kind not in ("Utilization", "Value", "AverageValue"):
        causes.append(_invalid(f"{field}.type", kind, "must be either Utilization, Value, or AverageValue"))
    for key in ("value", "averageValue"):
        amount = _amount(target[key]) if target.get(key) is not None else None
        if amount is not None and amount <= 0:
            causes.append(_invalid(f"{field}.{key}", canonical_quantity(target[key]), "must be positive"))
    utilization = target.get("averageUtilization")
    if utilization is not None and utilization < 1:
        causes.append(_invalid(f"{field}.averageUtilization", utilization, "must be greater than 0"))
    return causes


def _metric_causes(metric: dict[str, Any], field: str) -> list[dict[str, str]]:
    """validateMetricSpec for the sources the operator renders (Pods) and the defaulted one (Resource)."""
    causes = []
    if metric.get("pods") is not None:
        source, where = metric["pods"], f"{field}.pods"
        if not (source.get("metric") or {}).get("name"):
            causes.append(_required(f"{where}.metric.name", "must specify a metric name"))
        target = source.get("target") or {}
        causes += _metric_target_causes(target, f"{where}.target")
        if target.get("averageValue") is None:
            causes.append(
                _required(f"{where}.target.averageValue", "must specify a positive target averageValue")
            )
    elif metric.get("resource") is not None:
        source, where = metric["resource"], f"{field}.resource"
        if not source.get("name"):
            causes.append(_required(f"{where}.name", "must specify a resource name"))
        target = source.get("target") or {}
        causes += _metric_target_causes(target, f"{where}.target")
        if target.get("averageUtilization") is None and target.get("averageValue") is None:
            causes.append(
                _required(
                    f"{where}.target.averageUtilization",
                    "must set either a target raw value or a target utilization",
                )
            )
    return causes


def _hpa_causes(spec: dict[str, Any]) -> list[dict[str, str]]:
    """validateHorizontalPodAutoscalerSpec in its order (HPAScaleToZero is off: minReplicas >= 1)."""
    causes = []
    maximum, minimum = spec.get("maxReplicas") or 0, spec.get("minReplicas")
    if minimum is not None and minimum < 1:
        causes.append(_invalid("spec.minReplicas", minimum, "must be greater than or equal to 1"))
    if maximum == 0:
        causes.append(_required("spec.maxReplicas", "must be set and greater than 0"))
    elif maximum < 0:
        causes.append(_invalid("spec.maxReplicas", maximum, "must be greater than or equal to 1"))
    if maximum < (1 if minimum is None else minimum):
        causes.append(_invalid("spec.maxReplicas", maximum, "must be greater than or equal to `minReplicas`"))
    ref = spec.get("scaleTargetRef") or {}
    if not ref.get("kind"):
        causes.append(_required("spec.scaleTargetRef.kind"))
    if not ref.get("name"):
        causes.append(_required("spec.scaleTargetRef.name"))
    if "/" not in str(ref.get("apiVersion") or "") and ref.get("apiVersion") != "v1":
        causes.append(
            _invalid(
                "spec.scaleTargetRef.apiVersion",
                ref.get("apiVersion") or "",
                "apiVersion must specify API group",
            )
        )
    # With no metrics the server defaults one (cpu Utilization 80%): a Resource metric.
    metrics = spec.get("metrics") or []
    for i, metric in enumerate(metrics):
        causes += _metric_causes(metric, f"spec.metrics[{i}]")
    if minimum == 0 and not any(m.get("type") in ("Object", "External") for m in metrics):
        causes.append(
            _forbidden(
                "spec.metrics",
                "must specify at least one Object or External metric to support scaling to zero replicas",
            )
        )
    for direction in ("scaleUp", "scaleDown"):
        window = ((spec.get("behavior") or {}).get(direction) or {}).get("stabilizationWindowSeconds")
        where = f"spec.behavior.{direction}.stabilizationWindowSeconds"
        if window is not None and window < 0:
            causes.append(_invalid(where, window, "must be greater than or equal to zero"))
        if window is not None and window > 3600:
            causes.append(_invalid(where, window, "must be less than or equal to 3600"))
    return causes


def _netpol_causes(spec: dict[str, Any]) -> list[dict[str, str]]:
    """ValidateNetworkPolicyPort: a port given is a number in range or an IANA port name."""
    causes = []
    for direction in ("ingress", "egress"):
        for i, rule in enumerate(spec.get(direction) or []):
            for j, port in enumerate(rule.get("ports") or []):
                if port.get("port") is not None:
                    causes += _port_num_or_name(port["port"], f"spec.{direction}[{i}].ports[{j}].port")
    return causes


def _configmap_causes(obj: dict[str, Any]) -> list[dict[str, str]]:
    """IsConfigMapKey for data and binaryData keys."""
    causes = []
    for section in ("data", "binaryData"):
        for key in obj.get(section) or {}:
            if len(key) > 253:
                causes.append(_invalid(f"{section}[{key}]", key, "must be no more than 253 characters"))
            if not _CONFIG_KEY.match(key):
                causes.append(_invalid(f"{section}[{key}]", key, _CONFIG_KEY_MSG))
            if key in (".", "..") or key.startswith(".."):
                causes.append(
                    _invalid(
                        f"{section}[{key}]",
                        key,
                        f"must not be '{key}'" if key in (".", "..") else "must not start with '..'",
                    )
                )
    return causes


def _pvc_causes(spec: dict[str, Any]) -> list[dict[str, str]]:
    storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage")
    if storage is None:
        return [_required("spec.resources[storage]")]
    amount = _amount(storage)
    if amount is not None and amount <= 0:
        return [_invalid("spec.resources[storage]", canonical_quantity(storage), "must be greater than zero")]
    return []


def invalid_causes(plural: str, obj: dict[str, Any]) -> list[dict[str, str]]:
    """The validation causes the real server gives a create of `obj` (k8s.io/kubernetes
    pkg/apis/{apps,core,autoscaling,batch,policy,networking}/validation, as far as the recorded answers
    go), judged as the server does after its defaulting (an absent probe period is not refused)."""
    spec = obj.get("spec") or {}
    if plural == "deployments":
        return _deployment_causes(spec)
    if plural == "jobs":
        return _nonnegative(spec.get("backoffLimit"), "spec.backoffLimit") + _pod_causes(
            spec.get("template") or {}, "spec.template"
        )
    if plural == "services":
        return _service_causes(spec)
    if plural == "horizontalpodautoscalers":
        return _hpa_causes(spec)
    if plural == "poddisruptionbudgets":
        return _pdb_causes(spec)
    if plural == "networkpolicies":
        return _netpol_causes(spec)
    if plural == "configmaps":
        return _configmap_causes(obj)
    if plural == "persistentvolumeclaims":
        return _pvc_causes(spec)
    return []


def update_causes(
    plural: str, old: dict[str, Any], new_spec: dict[str, Any], *, revalidate: bool = True
) -> list[dict[str, str]]:
    """An update of the live `old` to `new_spec` (the patch merged): the spec is validated again as at
    create (ValidateXUpdate calls ValidateXSpec first), then the immutable fields it changes.
    `revalidate=False` for a server-side apply: kmock merges it like a merge patch, keeping the fields
    the applier owned and dropped (a PDB's maxUnavailable after a switch to minAvailable), which the
    real server removes first; validating that merge would refuse what the server accepts."""
    old_spec = old.get("spec") or {}
    causes = invalid_causes(plural, {**old, "spec": new_spec}) if revalidate else []
    if plural == "deployments" and new_spec.get("selector") != old_spec.get("selector"):
        causes.append(_invalid("spec.selector", new_spec.get("selector"), "field is immutable"))
    if plural == "jobs" and new_spec.get("template") != old_spec.get("template"):
        # The real message shows the template as a Go struct dump (uids included): only the tail is kept.
        causes.append(
            {
                "reason": "FieldValueInvalid",
                "message": "Invalid value: ...: field is immutable",
                "field": "spec.template",
            }
        )
    if (
        plural == "services"
        and old_spec.get("clusterIP")
        and new_spec.get("clusterIP") != old_spec["clusterIP"]
    ):
        causes.append(_invalid("spec.clusterIPs[0]", [new_spec.get("clusterIP")], "may not change once set"))
    return causes


def patch_type_error(plural: str, patched: dict[str, Any]) -> KubernetesError | None:
    """A merge patch whose result does not decode into the kind's Go types: not create's 400 but a 422
    on a `patch` field, the whole patched object (as JSON) its value, the same decoder message its tail."""
    if plural not in PLURALS or not isinstance(patched, dict):
        return None
    body = {k: v for k, v in patched.items() if k not in ("apiVersion", "kind")}
    found = _first_type_error(body, _schemas()[plural], PLURALS[plural][0], "")
    if found is None:
        return None
    cause = _invalid("patch", json.dumps(patched, separators=(",", ":")), found)
    return KubernetesError(
        status=422,
        reason="Invalid",
        message=f' "" is invalid: patch: {cause["message"]}',
        details={"causes": [cause]},
    )


def refusal(plural: str, obj: dict[str, Any], name: str, causes: list[dict[str, str]]) -> KubernetesError:
    """The 422 for `causes` as the real server words it: `Deployment.apps "d" is invalid: ...`."""
    kind, group = PLURALS[plural]
    listed = [f"{c['field']}: {c['message']}" for c in causes]
    joined = listed[0] if len(listed) == 1 else "[" + ", ".join(listed) + "]"
    qualified = f"{kind}.{group}" if group else kind
    return KubernetesError(
        status=422,
        reason="Invalid",
        message=f'{qualified} "{name}" is invalid: {joined}',
        details={"name": name, "group": group, "kind": kind, "causes": causes},
    )
