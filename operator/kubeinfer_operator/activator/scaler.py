"""The activator's view of its model's workload, through the operator's one API module (k8s.py).

Reads the Deployment or LeaderWorkerSet (spec.replicas, status.readyReplicas: LWS counts ready groups)
and writes only its scale subresource. Blocking calls: the controller runs them in a thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..k8s import ApiError, KubeClient


@dataclass(frozen=True)
class WorkloadState:
    """`desired`: spec.replicas; `ready`: status.readyReplicas (replicas, or LWS groups)."""

    desired: int
    ready: int


class Scaler:
    def __init__(self, client: KubeClient, kind: str, namespace: str, name: str) -> None:
        if kind not in ("Deployment", "LeaderWorkerSet"):
            raise ValueError(f"the activator scales a Deployment or a LeaderWorkerSet, not {kind}")
        self.client = client
        self.kind = kind
        self.namespace = namespace
        self.name = name

    def read(self) -> WorkloadState | None:
        """None when the workload does not exist (the model was deleted, or is not rendered yet)."""
        obj = self.client.get(self.kind, self.namespace, self.name)
        if obj is None or (obj.get("metadata") or {}).get("deletionTimestamp"):
            return None
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        return WorkloadState(
            desired=int(spec.get("replicas") or 0), ready=int(status.get("readyReplicas") or 0)
        )

    def scale(self, replicas: int) -> bool:
        """False when the workload is gone."""
        try:
            return self.client.set_scale(self.kind, self.namespace, self.name, replicas) is not None
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
