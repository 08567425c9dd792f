"""The Gateway API Inference Extension's objective header as a request priority.

The extension's endpoint picker orders requests by the `InferenceObjective` the header
`x-gateway-inference-objective` names (its priority: higher first); the operator renders one objective
per model from `spec.routing.gateway.priority` and passes the same value to the server as
`--objective-priority NAME=P` in the server's terms (vLLM's request `priority`: lower first). A request
that names a known objective and sets no `priority` of its own is then queued here as the gateway
ordered it; a body's own `priority` wins (the client said so), and an objective name the server was
not given changes nothing (it may be another pool's; the picker, not this server, owns objectives).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The extension's header (gateway-api-inference-extension, "InferenceObjective").
OBJECTIVE_HEADER = "x-gateway-inference-objective"


def apply_objective_priority(
    headers: Mapping[str, str], body: Any, objectives: tuple[tuple[str, int], ...]
) -> Any:
    """The request body with `priority` set from the objective its header names, when the body is a JSON
    object without `priority` (or with `priority: null`, which the request parser reads as unset) and the
    name is one of `objectives` ((name, priority) pairs); otherwise the body unchanged. Never raises: a
    malformed body is left for the request parser to refuse."""
    if not objectives or not isinstance(body, dict) or body.get("priority") is not None:
        return body
    name = (headers.get(OBJECTIVE_HEADER) or "").strip()
    priority = dict(objectives).get(name)
    return body if priority is None else {**body, "priority": priority}
