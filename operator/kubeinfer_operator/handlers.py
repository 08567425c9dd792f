"""Thin kopf handlers: each kopf event becomes one reconcile (reconciler.py) of the model it concerns,
under that model's lock. create/update/resume reconcile the spec; events of the labelled children,
of the model's pods, and the periodic resync reconcile on drift or refresh the status; an optional
CRD appearing makes every model resync."""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import os
from typing import Any

import kopf

from .admission import AdmissionPolicy
from .common import FIELD_MANAGER
from .defaults import ClusterDefaults
from .gateway import OBJECTIVE_CRD_NAME, POOL_CRD_NAME, ROUTE_CRD_NAME
from .k8s import KINDS, REPORTING_INSTANCE, USER_AGENT, ApiError, KubeClient
from .reconciler import (
    GiveUp,
    Reconciler,
    RetryLater,
    Trigger,
    model_lock,
    owner_of_child,
    owner_of_pod,
)
from .render import OWNED_KINDS
from .resync import Resyncer
from .spec import API_VERSION, GROUP, KIND, PLURAL, VERSION
from .workload import LWS_CRD_NAME

# Tunables read once at import; tests shorten them through the environment.
RETRY_BASE_SECONDS = float(os.environ.get("KUBEINFER_RETRY_BASE_SECONDS", "5"))
RETRY_MAX_SECONDS = float(os.environ.get("KUBEINFER_RETRY_MAX_SECONDS", "300"))
REQUEST_TIMEOUT_SECONDS = float(os.environ.get("KUBEINFER_REQUEST_TIMEOUT_SECONDS", "30"))
# Full re-reconcile period. Child events repair drift at once, but a watch that fails or whose
# resourceVersion expired loses the events in between (kopf re-lists, and absence is no event); the
# resync catches them.
RESYNC_SECONDS = float(os.environ.get("KUBEINFER_RESYNC_SECONDS", "60"))
# How long discovery answers are cached: an optional CRD (ServiceMonitor, ScaledObject) installed
# after the operator started is picked up by the next resync after this.
DISCOVERY_TTL_SECONDS = float(os.environ.get("KUBEINFER_DISCOVERY_TTL_SECONDS", "60"))
ANNOTATION_PREFIX = GROUP
# The installation's default images and pull secrets for the pods the operator creates (the chart's
# global.imageRegistry, server.image, router.image, global.imagePullSecrets).
DEFAULTS = ClusterDefaults.from_environment(os.environ)
# what the cluster administrator allows models beyond the defaults (chart values admission.*)
POLICY = AdmissionPolicy.from_environment(os.environ)

MANAGED = {"app.kubernetes.io/managed-by": FIELD_MANAGER}


def backoff_delay(retry: int) -> float:
    return float(min(RETRY_BASE_SECONDS * (2 ** max(retry, 0)), RETRY_MAX_SECONDS))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Progress and the last-handled spec live in annotations: the CRD's structural schema would
    # prune kopf's default status.kopf field, and our status is ours alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.posting.level = logging.WARNING
    # One name for every write and Event (kopf's defaults are `kopf` and `dev`).
    settings.posting.reporting_component = FIELD_MANAGER
    settings.posting.reporting_instance = REPORTING_INSTANCE
    # Every watch stream ends after RESYNC_SECONDS; kopf then watches again from the last
    # resourceVersion it saw (the API server replays what came in between) and lists afresh only when
    # that version has expired (410), which drives resync_handler.
    if settings.watching.server_timeout is None:
        # kopf sends it as ?timeoutSeconds=, which the API server parses as an integer (60.0 is a 400).
        settings.watching.server_timeout = max(1, round(RESYNC_SECONDS))
    if settings.watching.client_timeout is None:
        settings.watching.client_timeout = RESYNC_SECONDS + 60
    kube = KubeClient.from_environment(
        request_timeout=REQUEST_TIMEOUT_SECONDS, discovery_ttl=DISCOVERY_TTL_SECONDS
    )
    memo.kube = kube
    events_logger = logging.getLogger("kubeinfer_operator.events")

    def post_event(namespace: str, name: str, uid: str, type_: str, reason: str, message: str) -> None:
        _post_event(kube, namespace, name, uid, type_, reason, message, events_logger)

    memo.reconciler = Reconciler(kube, DEFAULTS, post_event, policy=lambda: POLICY)
    resync_logger = logging.getLogger("kubeinfer_operator.resync")
    reconciler = memo.reconciler
    memo.resyncer = Resyncer(
        lambda ns, name: run(reconciler, ns, name, Trigger.RESYNC, resync_logger), RESYNC_SECONDS
    )
    # In kopf's context, so that kopf.event() works from the resync thread too.
    memo.resyncer.start(run=contextvars.copy_context().run)


@kopf.on.cleanup()
def close(memo: kopf.Memo, **_: Any) -> None:
    resyncer = getattr(memo, "resyncer", None)
    if resyncer is not None:
        resyncer.stop()
    kube = getattr(memo, "kube", None)
    if kube is not None:
        kube.close()


class _ConnectionInfo(kopf.ConnectionInfo):
    """kopf's connection with our User-Agent: kopf's own writes (progress annotations, finalizers) then
    show the operator's field manager, not `kopf` (the API server takes the manager from the agent)."""

    def as_http_headers(self) -> dict[str, str]:
        return {**super().as_http_headers(), "User-Agent": USER_AGENT}


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # The same credential order as KubeClient.from_environment: service account, then KUBECONFIG.
    info = kopf.login_via_client(**kwargs)
    if info is None:
        return None
    return _ConnectionInfo(**{f.name: getattr(info, f.name) for f in dataclasses.fields(info)})


def _post_event(
    kube: KubeClient,
    namespace: str,
    name: str,
    uid: str,
    type_: str,
    reason: str,
    message: str,
    logger: Any,
) -> None:
    ref = kopf.Body(
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"namespace": namespace, "name": name, "uid": uid},
        }
    )
    try:
        kopf.event(ref, type=type_, reason=reason, message=message)
        return
    except LookupError:
        pass
    # Outside kopf's per-object handlers (the resync thread) kopf has no event queue, so the Event is
    # posted directly: a transition the resync noticed first must be announced too.
    involved = {"apiVersion": API_VERSION, "kind": KIND, "name": name, "namespace": namespace, "uid": uid}
    try:
        kube.create_event(involved, type_, reason, message, component=FIELD_MANAGER)
    except ApiError as exc:
        logger.warning(f"event {reason} not posted: {exc}")


def run(
    reconciler: Reconciler,
    namespace: str,
    name: str,
    trigger: Trigger,
    logger: Any,
    child: dict[str, Any] | None = None,
) -> None:
    """A reconcile outside kopf's retries (child, pod and resync triggers): a failure is logged, and
    the next event or resync tries again."""
    try:
        with model_lock(namespace, name):
            reconciler.reconcile(namespace, name, trigger, logger, child=child)
    except (RetryLater, GiveUp) as exc:
        logger.warning(f"{trigger.value} reconcile of {namespace}/{name} postponed: {exc}")
    except ApiError as exc:
        logger.warning(f"{trigger.value} reconcile of {namespace}/{name} skipped: {exc}")


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
def reconcile_handler(body: kopf.Body, memo: kopf.Memo, logger: Any, retry: int, **_: Any) -> None:
    meta = body.get("metadata") or {}
    namespace, name = meta["namespace"], meta["name"]
    try:
        with model_lock(namespace, name):
            memo.reconciler.reconcile(namespace, name, Trigger.SPEC, logger)
    except RetryLater as exc:
        raise kopf.TemporaryError(str(exc), delay=backoff_delay(retry)) from exc
    except GiveUp as exc:
        raise kopf.PermanentError(str(exc)) from exc


@kopf.on.event(GROUP, VERSION, PLURAL, id="resync")
def resync_handler(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    # Every event registers the model with the operator-wide resync thread (resync.Resyncer). Events
    # without a type come from a (re)listing: at start, or after a watch's resourceVersion expired
    # (410) or its connection failed, when the events in between are lost: resync at once, to catch
    # what they said (e.g. a child deleted meanwhile).
    meta = body.get("metadata") or {}
    resyncer = getattr(memo, "resyncer", None)
    if resyncer is not None:
        if event.get("type") == "DELETED":
            resyncer.gone(meta["namespace"], meta["name"])
        else:
            resyncer.seen(meta["namespace"], meta["name"])
    if event.get("type") is not None:
        return
    run(memo.reconciler, meta["namespace"], meta["name"], Trigger.RESYNC, logger)


def _plain(body: Any) -> dict[str, Any]:
    return {k: _unwrap(v) for k, v in dict(body).items()}


def _unwrap(value: Any) -> Any:
    if hasattr(value, "items") and not isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unwrap(v) for v in value]
    return value


@kopf.on.event("", "v1", "pods", labels=MANAGED, id="pods")
def pod_event_handler(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """A model's pod changed (scheduled, pulled, crashed, became ready): refresh the model's status."""
    pod = _plain(body)
    owner, namespace = owner_of_pod(pod), (pod.get("metadata") or {}).get("namespace")
    if owner and namespace:
        run(memo.reconciler, namespace, owner, Trigger.PODS, logger, child=pod)


# Optional kinds the operator renders once their CRD exists: the Inference Extension's pool and
# objective and the Gateway API's route too (seen on a real API server, issue 48: without them here
# the pool came only with the resync and an expired discovery answer, up to two minutes after its CRD).
OPTIONAL_CRDS = frozenset(
    {
        "servicemonitors.monitoring.coreos.com",
        "scaledobjects.keda.sh",
        LWS_CRD_NAME,
        POOL_CRD_NAME,
        ROUTE_CRD_NAME,
        OBJECTIVE_CRD_NAME,
    }
)


@kopf.on.event("apiextensions.k8s.io", "v1", "customresourcedefinitions", id="optional-crds")
def crd_event_handler(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """The Prometheus Operator, KEDA, LWS or the Inference Extension installed (or removed) after the
    models: resync them now."""
    if (body.get("metadata") or {}).get("name") not in OPTIONAL_CRDS:
        return
    memo.kube.forget_discovery()
    resyncer = getattr(memo, "resyncer", None)
    if resyncer is not None:
        resyncer.trigger()


def _register_child_watch(kind: str) -> None:
    info = KINDS[kind]
    group, _, version = info.api_version.rpartition("/")

    @kopf.on.event(group, version, info.plural, labels=MANAGED, id=f"child-{kind.lower()}")
    def _child_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
        """A labelled child changed: restore it if it drifted or vanished, else refresh status."""
        child = {**_plain(body), "kind": kind}
        owner, namespace = owner_of_child(child), (child.get("metadata") or {}).get("namespace")
        if owner and namespace:
            run(memo.reconciler, namespace, owner, Trigger.CHILD, logger, child=child)


# Every owned kind but the Secret: a watch on Secrets would need list/watch, which reads every Secret of
# the namespace; the admin key's Secret is created once and never read back (credentials.py).
# The Inference Extension's kinds only where the installation renders them (chart value
# inferenceExtension.enabled, which grants list/watch on them).
WATCHED_CHILD_KINDS = tuple(
    kind
    for kind in OWNED_KINDS
    if kind != "Secret"
    and (DEFAULTS.inference_extension or kind not in ("InferencePool", "HTTPRoute", "InferenceObjective"))
)
for _kind in WATCHED_CHILD_KINDS:
    _register_child_watch(_kind)
