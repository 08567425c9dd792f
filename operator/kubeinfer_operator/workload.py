"""Which object runs a model's server pods, and under which name: a Deployment, or for
`spec.parallelism.nodes` > 1 a LeaderWorkerSet (lws.py renders it). Pure; shared by the renderers, the
status and the handover of the replica count."""

from __future__ import annotations

from .common import selector_labels
from .names import derived_name
from .spec import InferenceModel

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_PLURAL = "leaderworkersets"
LWS_CRD_NAME = f"{LWS_PLURAL}.leaderworkerset.x-k8s.io"
# Set by the LWS controller on every pod of a group; 0 is the leader.
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
# StatefulSet names above 52 characters break their pods' controller-revision-hash label; the
# worker StatefulSets are named `<lws>-<group index>`.
_MAX_LWS_NAME = 40


def multi_node(im: InferenceModel) -> bool:
    return im.spec.parallelism.nodes > 1


def workload_kind(im: InferenceModel) -> str:
    """The kind that runs the model's server pods."""
    return LWS_KIND if multi_node(im) else "Deployment"


def lws_name(im: InferenceModel) -> str:
    """`<child name>-lws` in at most 40 characters (names.derived_name: shortened with a hash when long)."""
    return derived_name(im.child_name, "lws", max_length=_MAX_LWS_NAME)


def leader_selector_labels(im: InferenceModel) -> dict[str, str]:
    """Extra labels that pick the pods serving the API: the leaders of a multi-node model (none else)."""
    return {WORKER_INDEX_LABEL: "0"} if multi_node(im) else {}


def workload_name(im: InferenceModel) -> str:
    return lws_name(im) if multi_node(im) else im.child_name


def workload_api_version(im: InferenceModel) -> str:
    return LWS_API_VERSION if multi_node(im) else "apps/v1"


def scale_target_ref(im: InferenceModel) -> dict[str, str]:
    """What an HPA or ScaledObject scales: the Deployment, or the LeaderWorkerSet through its scale
    subresource (whose selector, status.hpaPodSelector, picks the leaders: one metric source per group,
    the pods that serve the API and its metrics)."""
    return {"apiVersion": workload_api_version(im), "kind": workload_kind(im), "name": workload_name(im)}


def serving_selector_labels(im: InferenceModel) -> dict[str, str]:
    """The pods that serve the API: all of the model's, or only the group leaders of a multi-node model."""
    return {**selector_labels(im), **leader_selector_labels(im)}
