"""CustomResourceDefinitions refused as kube-apiserver refuses them, for the kmock that Helm installs the
chart into (tests/deploy/deploy_helpers.py; tests/ is on sys.path).

Two refusals a real API server (v1.36.2) made to our CRD and kmock did not (issue 29), both 422 Invalid
`CustomResourceDefinition.apiextensions.k8s.io "<name>" is invalid: [<errors>]`:
- a `default` that fails a rule of its node, evaluated as written (tests/crd_cel.py);
- a rule whose estimated cost, or a CRD whose total, is over the budget (tests/crd_cost.py, an upper
  bound: this may refuse a little more than the API server, never less).
"""

from __future__ import annotations

from typing import Any

import crd_cel
import crd_cost
from kmock import KubernetesError


def crd_errors(crd: dict[str, Any]) -> list[str]:
    """The API server's field errors for the CRD's CEL defaults and rule costs."""
    errors: list[str] = []
    versions = (crd.get("spec") or {}).get("versions") or []
    schemas = [((v or {}).get("schema") or {}).get("openAPIV3Schema") for v in versions]
    for i, schema in enumerate(schemas):
        if not isinstance(schema, dict):
            continue
        # The API server validates its internal version, where a schema that every version shares
        # lives in spec.validation (seen on v1.36.2 with our one-version CRD).
        shared = all(s == schemas[0] for s in schemas)
        if shared and i > 0:
            break
        prefix = "spec.validation.openAPIV3Schema" if shared else f"spec.versions[{i}].schema.openAPIV3Schema"
        defaults = crd_cel.default_errors(schema, prefix)
        if defaults:  # v1.36.2 reported only these while any default failed (costs came after)
            errors += defaults
            continue
        costs = crd_cost.rule_costs(schema)
        for rule in costs:
            if rule.total > crd_cost.STATIC_ESTIMATED_COST_LIMIT:
                message = crd_cost.budget_message(
                    "estimated rule cost", rule.total, crd_cost.STATIC_ESTIMATED_COST_LIMIT
                )
                errors.append(f"{prefix}.{rule.field_path}: Forbidden: {message}")
        total = min(crd_cost.UNKNOWN, sum(r.total for r in costs))
        if total > crd_cost.STATIC_ESTIMATED_CRD_COST_LIMIT:
            for rule in sorted(costs, key=lambda r: -r.total)[:4]:  # the API server's MostExpensive
                errors.append(
                    f"{prefix}.{rule.field_path}: Forbidden: contributed to estimated rule cost total "
                    "exceeding cost limit for entire OpenAPIv3 schema"
                )
            what = "x-kubernetes-validations estimated rule cost total for entire OpenAPIv3 schema"
            message = crd_cost.budget_message(what, total, crd_cost.STATIC_ESTIMATED_CRD_COST_LIMIT)
            errors.append(f"{prefix}: Forbidden: {message}")
    return errors


def crd_refusal(crd: Any) -> KubernetesError | None:
    """The 422 for a CRD the API server would refuse, else None."""
    if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
        return None
    errors = crd_errors(crd)
    if not errors:
        return None
    name = (crd.get("metadata") or {}).get("name", "")
    return KubernetesError(
        status=422,
        reason="Invalid",
        message=f'CustomResourceDefinition.apiextensions.k8s.io "{name}" is invalid: [{", ".join(errors)}]',
    )
