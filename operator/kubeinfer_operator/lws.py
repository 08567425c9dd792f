"""Multi-node replicas: `spec.parallelism.nodes` M > 1 renders a LeaderWorkerSet instead of a Deployment.

A LeaderWorkerSet (https://github.com/kubernetes-sigs/lws, API `leaderworkerset.x-k8s.io/v1`) runs
`replicas` groups of `size` pods: one leader (worker index 0) and M-1 workers, created and restarted as
a unit. The LWS controller injects `LWS_LEADER_ADDRESS`, `LWS_GROUP_SIZE` and `LWS_WORKER_INDEX` into
every pod; the server reads them itself (docs/design.md, "Multi-node contract"), so every pod runs the
same command line with `--tensor-parallel-size` = resources.gpu.count x M, and the operator renders
none of those variables. The leader serves the HTTP API (probes on /ready and /health, the Service,
the ServiceMonitor and the router select leaders only) and hosts torch's rendezvous store on
DIST_PORT; a worker serves only `GET /health` (503 while it loads and joins, 200 while its step loop
runs) on the same port, which its probes use. A rank that dies breaks the group's collectives and
every process exits, and `RecreateGroupOnPodRestart` restarts the whole group, as a TP group cannot
survive the loss of one rank.

Names: the LWS controller creates a headless Service named after the LWS (the pods' DNS subdomain,
which LWS_LEADER_ADDRESS points into), so the LWS cannot share the name of the model's own ClusterIP
Service: it is `<child name>-lws`, short enough that the StatefulSets and pods LWS derives from it
(`<lws>-<group>-<index>` plus a revision hash label) stay valid.

Pure functions; handlers.reconcile applies the result.
"""

from __future__ import annotations

import copy
from typing import Any

from .cache import LoaderEstimate
from .common import (
    CONTAINER_NAME,
    STARTUP_PROBE_PERIOD_SECONDS,
    Manifest,
    desired_replicas,
    startup_failure_threshold,
)
from .defaults import ClusterDefaults
from .deployment import render_deployment
from .spec import InferenceModel
from .workload import LWS_API_VERSION as LWS_API_VERSION
from .workload import LWS_CRD_NAME as LWS_CRD_NAME
from .workload import LWS_KIND as LWS_KIND
from .workload import LWS_PLURAL as LWS_PLURAL
from .workload import WORKER_INDEX_LABEL as WORKER_INDEX_LABEL
from .workload import leader_selector_labels as leader_selector_labels
from .workload import lws_name as lws_name
from .workload import multi_node as multi_node
from .workload import scale_target_ref as scale_target_ref
from .workload import workload_api_version as workload_api_version
from .workload import workload_kind as workload_kind
from .workload import workload_name as workload_name

# torch's TCPStore on the leader (the server's MASTER_PORT default); gloo/NCCL then open further
# pod-to-pod connections on ephemeral ports.
DIST_PORT = 29500

# The Degraded reason while the cluster does not serve the LeaderWorkerSet API.
CRD_MISSING_REASON = "LeaderWorkerSetCRDMissing"
CRD_MISSING_MESSAGE = (
    f"spec.parallelism.nodes > 1 needs the LeaderWorkerSet API ({LWS_API_VERSION}), which this cluster "
    "does not serve: install the LWS controller (https://github.com/kubernetes-sigs/lws); nothing was "
    "changed, and the model is reconciled once the CRD appears"
)


def _worker_template(template: dict[str, Any], startup_timeout_seconds: int) -> dict[str, Any]:
    """The leader's pod template turned into a worker's: the same container and command line (the server
    decides its role from LWS_WORKER_INDEX), probes on the worker's own /health, no API ports."""
    worker = copy.deepcopy(template)
    (container,) = (c for c in worker["spec"]["containers"] if c["name"] == CONTAINER_NAME)
    container["ports"] = [p for p in container["ports"] if p["name"] == "http"]
    health = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
    # 503 while the worker loads its shard and joins the group, so loading gets the startup timeout.
    container["startupProbe"] = {
        **health,
        "periodSeconds": STARTUP_PROBE_PERIOD_SECONDS,
        "failureThreshold": startup_failure_threshold(startup_timeout_seconds),
    }
    # Ready (the group counts as ready only with every worker ready) and alive while the step loop runs.
    container["readinessProbe"] = {**health, "periodSeconds": 5, "failureThreshold": 3}
    container["livenessProbe"] = {**health, "periodSeconds": 10, "failureThreshold": 3}
    # Nothing routes to a worker: no endpoint propagation to wait for before SIGTERM.
    container.pop("lifecycle", None)
    return worker


def render_leaderworkerset(
    im: InferenceModel, defaults: ClusterDefaults | None = None, estimate: LoaderEstimate | None = None
) -> Manifest:
    """The LeaderWorkerSet of a multi-node model: the Deployment's pod template for the leader (plus the
    rendezvous port), its worker variant for the others, `size` M, one group per replica. `estimate`: the
    loader's memory estimate, the memory of every pod of the group (each holds 1/M of the ranks)."""
    spec = im.spec
    deployment = render_deployment(im, defaults, estimate)
    leader = copy.deepcopy(deployment["spec"]["template"])
    (container,) = (c for c in leader["spec"]["containers"] if c["name"] == CONTAINER_NAME)
    container["ports"].append({"name": "dist", "containerPort": DIST_PORT, "protocol": "TCP"})
    worker = _worker_template(deployment["spec"]["template"], spec.probes.startup_timeout_seconds)
    metadata = {**deployment["metadata"], "name": lws_name(im)}
    lws_spec: dict[str, Any] = {
        # LeaderReady would deadlock: the leader is ready only once its workers have joined.
        "startupPolicy": "LeaderCreated",
        "rolloutStrategy": {
            "type": "RollingUpdate",
            # In groups, as the Deployment's are in pods.
            "rollingUpdateConfiguration": {
                "maxSurge": spec.rollout.max_surge,
                "maxUnavailable": spec.rollout.effective_max_unavailable,
            },
        },
        "leaderWorkerTemplate": {
            "size": spec.parallelism.nodes,
            # One lost rank breaks the group's collectives: restart the group as a unit.
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": leader,
            "workerTemplate": worker,
        },
    }
    # Else the autoscaler (or the activator) owns the group count (handover.py), as with a Deployment.
    if not spec.replicas_delegated:
        lws_spec = {"replicas": desired_replicas(im), **lws_spec}
    return {"apiVersion": LWS_API_VERSION, "kind": LWS_KIND, "metadata": metadata, "spec": lws_spec}


def workload_view(lws: dict[str, Any] | None) -> dict[str, Any] | None:
    """A live LeaderWorkerSet as the Deployment-shaped object status.compute_status reads: its group
    counts and generations (LWS's own conditions mean other things than a Deployment's and are left out;
    pod-level reasons come from the pods)."""
    if lws is None:
        return None
    status = lws.get("status") or {}
    return {
        "metadata": {"generation": (lws.get("metadata") or {}).get("generation", 0)},
        "spec": {"replicas": (lws.get("spec") or {}).get("replicas", 1)},
        "status": {
            key: status[key]
            for key in ("replicas", "readyReplicas", "updatedReplicas", "observedGeneration")
            if key in status
        },
    }


def as_workload(kind: str, live: dict[str, Any] | None) -> dict[str, Any] | None:
    """A live workload (Deployment or LeaderWorkerSet) in the shape status.compute_status reads."""
    return workload_view(live) if kind == LWS_KIND else live
