"""Thin kopf handlers. create/update/resume run one idempotent reconcile; events on the labelled
children repair drift and refresh the InferenceModel's status from the Deployment."""

from __future__ import annotations

import contextvars
import datetime
import logging
import os
import threading
from typing import Any

import kopf

from . import adapter_sync, credentials
from . import cache as model_cache
from .adapters import desired_adapters, runtime_updates
from .admission import AdmissionPolicy
from .defaults import ClusterDefaults
from .handover import HANDOVER_MANAGER, handover_count, owns_replicas, render_handover
from .k8s import KINDS, ApiError, KubeClient
from .lws import (
    CRD_MISSING_MESSAGE,
    CRD_MISSING_REASON,
    LWS_CRD_NAME,
    LWS_KIND,
    as_workload,
    multi_node,
    workload_kind,
    workload_name,
)
from .policy import model_policy_errors
from .render import (
    CACHE_KINDS,
    FIELD_MANAGER,
    MODEL_ANNOTATION,
    Capabilities,
    child_metadata,
    is_subset,
    render_all,
    selector_labels,
)
from .resync import Resyncer
from .spec import API_VERSION, GROUP, KIND, PLURAL, VERSION, InferenceModel, InvalidSpecError, semantic_errors
from .status import ReconcileOutcome, compute_status, failed_status, same_status

# Tunables read once at import; tests shorten them through the environment.
RETRY_BASE_SECONDS = float(os.environ.get("KUBEINFER_RETRY_BASE_SECONDS", "5"))
RETRY_MAX_SECONDS = float(os.environ.get("KUBEINFER_RETRY_MAX_SECONDS", "300"))
REQUEST_TIMEOUT_SECONDS = float(os.environ.get("KUBEINFER_REQUEST_TIMEOUT_SECONDS", "30"))
# Full re-reconcile period. Child events repair drift at once, but a watch stream that drops while a
# child is deleted loses that event (kopf re-lists, and absence is no event); the resync catches it.
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


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
    # Ending every watch stream periodically makes kopf re-list, which drives resync_handler.
    if settings.watching.server_timeout is None:
        # kopf sends it as ?timeoutSeconds=, which the API server parses as an integer (60.0 is a 400).
        settings.watching.server_timeout = max(1, round(RESYNC_SECONDS))
    if settings.watching.client_timeout is None:
        settings.watching.client_timeout = RESYNC_SECONDS + 60
    memo.kube = KubeClient.from_environment(
        request_timeout=REQUEST_TIMEOUT_SECONDS, discovery_ttl=DISCOVERY_TTL_SECONDS
    )
    kube = memo.kube
    resync_logger = logging.getLogger("kubeinfer_operator.resync")
    memo.resyncer = Resyncer(lambda ns, name: resync_model(kube, ns, name, resync_logger), RESYNC_SECONDS)
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


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # The same credential order as KubeClient.from_environment: service account, then KUBECONFIG.
    return kopf.login_via_client(**kwargs)


def _write_status(
    kube: KubeClient,
    namespace: str,
    name: str,
    new: dict[str, Any],
    old: dict[str, Any] | None,
    logger: Any,
    retry: int | None = None,
    uid: str | None = None,
) -> None:
    """Write status if it changed. With `retry` given (the reconcile's success path) a failed write
    is retried through kopf, so a finished reconcile never leaves a stale status behind; otherwise
    (the write only accompanies an error that is retried anyway) the failure is logged. A change of
    phase or of the Degraded reason is also posted as a Kubernetes Event on the InferenceModel."""
    new = carry_adapters(new, old)
    if same_status(old, new):
        return
    try:
        kube.patch_status(namespace, name, new)
    except ApiError as exc:
        if retry is not None and exc.transient:
            raise kopf.TemporaryError(str(exc), delay=backoff_delay(retry)) from exc
        logger.warning(f"status not written: {exc}")
        return
    if uid is not None:
        _post_transition(kube, namespace, name, uid, old, new, logger)


def _transition_key(status: dict[str, Any] | None) -> tuple[str, str]:
    conds = {c.get("type"): c for c in (status or {}).get("conditions") or []}
    degraded = conds.get("Degraded") or {}
    reason = str(degraded.get("reason") or "") if degraded.get("status") == "True" else ""
    return str((status or {}).get("phase") or ""), reason


def _cache_key(status: dict[str, Any] | None) -> tuple[str, str]:
    cache = (status or {}).get("cache") or {}
    return str(cache.get("phase") or ""), str(cache.get("reason") or "")


def _post_event(
    kube: KubeClient, namespace: str, name: str, uid: str, type_: str, reason: str, message: str, logger: Any
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
    # Outside kopf's per-object handlers (the resync thread, tests calling reconcile directly) kopf
    # has no event queue, so the Event is posted directly: a transition the resync noticed first
    # must be announced too.
    involved = {"apiVersion": API_VERSION, "kind": KIND, "name": name, "namespace": namespace, "uid": uid}
    try:
        kube.create_event(involved, type_, reason, message, component=FIELD_MANAGER)
    except ApiError as exc:
        logger.warning(f"event {reason} not posted: {exc}")


def _post_transition(
    kube: KubeClient,
    namespace: str,
    name: str,
    uid: str,
    old: dict[str, Any] | None,
    new: dict[str, Any],
    logger: Any,
) -> None:
    if _cache_key(old) != _cache_key(new) and new.get("cache"):
        cache = new["cache"]
        _post_event(
            kube,
            namespace,
            name,
            uid,
            "Warning" if cache.get("phase") == "Failed" else "Normal",
            str(cache.get("reason") or "Cache" + str(cache.get("phase"))),
            f"cache {cache.get('phase')}: {cache.get('message') or ''}".rstrip(": "),
            logger,
        )
    if _transition_key(old) == _transition_key(new):
        return
    conds = {c.get("type"): c for c in new.get("conditions") or []}
    degraded = conds.get("Degraded") or {}
    ready = conds.get("Ready") or {}
    warning = degraded.get("status") == "True"
    source = degraded if warning else ready
    _post_event(
        kube,
        namespace,
        name,
        uid,
        "Warning" if warning else "Normal",
        str(source.get("reason") or new.get("phase") or "StatusChanged"),
        f"{new.get('phase')}: {source.get('message') or ''}".rstrip(": "),
        logger,
    )


def _capabilities(kube: KubeClient) -> Capabilities:
    return Capabilities(
        service_monitor=kube.serves(KINDS["ServiceMonitor"].api_version, KINDS["ServiceMonitor"].plural),
        keda=kube.serves(KINDS["ScaledObject"].api_version, KINDS["ScaledObject"].plural),
        defaults=DEFAULTS,
        leader_worker_set=kube.serves(KINDS[LWS_KIND].api_version, KINDS[LWS_KIND].plural),
    )


def lws_missing(im: InferenceModel, caps: Capabilities) -> bool:
    """A multi-node spec on a cluster without the LeaderWorkerSet API: nothing can be applied."""
    return multi_node(im) and not caps.leader_worker_set


def _live_workload(kube: KubeClient, im: InferenceModel) -> dict[str, Any] | None:
    """The model's live Deployment or LeaderWorkerSet, shaped for compute_status (None if unreadable).
    Without the LeaderWorkerSet API nothing multi-node exists: what still runs (a Deployment) is shown."""
    kind, name = workload_kind(im), workload_name(im)
    try:
        if kind == LWS_KIND and not _capabilities(kube).leader_worker_set:
            kind, name = "Deployment", im.child_name
    except ApiError:
        return None
    return as_workload(kind, _safe_get(kube, kind, im.namespace, name))


def reconcile(body: dict[str, Any], kube: KubeClient, logger: Any, retry: int = 0) -> None:
    """Render every child, apply it, remove children no longer wanted, then write status.

    Raises kopf.PermanentError for a spec that cannot be deployed and kopf.TemporaryError (with
    exponential backoff) when the API fails; the status says which in both cases.
    """
    meta = body.get("metadata") or {}
    namespace, name = meta["namespace"], meta["name"]
    if meta.get("deletionTimestamp"):
        return  # being deleted: garbage collection removes the children, nothing to apply
    previous = body.get("status")
    try:
        im = InferenceModel.from_manifest(body)
    except InvalidSpecError as exc:
        status = failed_status(meta.get("generation"), str(exc), previous, _now())
        _write_status(kube, namespace, name, status.to_dict(), previous, logger, uid=meta.get("uid"))
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc

    problems = semantic_errors(im.spec) + model_policy_errors(im, POLICY, DEFAULTS)
    if problems:
        message = "; ".join(problems)
        existing = _live_workload(kube, im)
        status = compute_status(im, existing, ReconcileOutcome(invalid_spec=message), previous, _now())
        _write_status(kube, namespace, name, status.to_dict(), previous, logger, uid=im.uid)
        raise kopf.PermanentError(f"invalid spec: {message}")

    monitoring_skipped: str | None = None
    cache: model_cache.CacheState | None = None
    try:
        caps = _capabilities(kube)
        if lws_missing(im, caps):
            # Nothing applied or deleted: a running single-node Deployment keeps serving the old spec.
            # The CRD watch (crd_event_handler) or the next resync reconciles once the API is served.
            logger.warning(f"{namespace}/{name}: {CRD_MISSING_MESSAGE}")
            wanted = {obj["kind"]: obj for obj in render_all(im, caps).objects}
            refresh_status(im, body, _live_workload(kube, im), wanted, kube, logger, caps)
            return
        cache = sync_cache(
            im, kube, logger, was_shared=bool((previous or {}).get("cache")), defaults=caps.defaults
        )
        plan = render_all(im, caps, cache_ready=cache is None or cache.ready)
        monitoring_skipped = plan.monitoring_skipped_reason
        if im.spec.autoscaled and im.spec.scaling.autoscaler == "KEDA" and not caps.keda:
            raise ApiError(
                404, "CRDNotInstalled", "keda.sh/v1alpha1 ScaledObject is not served", "autoscaling"
            )
        deployment: dict[str, Any] | None = None
        # the pods' admin key first: a pod whose Secret is missing cannot start
        credentials.ensure_admin_secret(kube, im, child_metadata(im), caps.defaults)
        for obj in plan.objects:
            if obj["kind"] in CACHE_KINDS:
                continue  # applied by sync_cache
            is_workload = (obj["kind"], obj["metadata"]["name"]) == (workload_kind(im), workload_name(im))
            if is_workload and im.spec.replicas_delegated:
                hand_over_replicas(im, obj, kube, logger)
            live = kube.apply(obj)
            if is_workload:
                deployment = as_workload(obj["kind"], live)
        for ref in plan.absent:
            if kube.delete(ref.kind, namespace, ref.name, owner_uid=im.uid):
                logger.info(f"deleted {ref.kind} {namespace}/{ref.name}: no longer wanted by the spec")
    except ApiError as exc:
        # A failure before the cache was judged (applying the claim) keeps its last known phase.
        outcome = ReconcileOutcome(
            apply_error=str(exc),
            monitoring_skipped_reason=monitoring_skipped,
            cache=cache if cache is not None else _previous_cache(im, previous),
        )
        live_deployment = _live_workload(kube, im)
        status = compute_status(im, live_deployment, outcome, previous, _now(), _pods(kube, im))
        _write_status(kube, namespace, name, status.to_dict(), previous, logger, uid=im.uid)
        if exc.transient:
            raise kopf.TemporaryError(str(exc), delay=backoff_delay(retry)) from exc
        raise kopf.PermanentError(str(exc)) from exc

    if deployment is None and cache is not None and not cache.ready:
        deployment = _live_workload(kube, im)  # an older one may serve
    outcome = ReconcileOutcome(monitoring_skipped_reason=monitoring_skipped, cache=cache)
    pods = _pods(kube, im)
    status = compute_status(im, deployment, outcome, previous, _now(), pods)
    new = {**status.to_dict(), **adapters_status(im, pods, logger)}
    _write_status(kube, namespace, name, new, previous, logger, retry=retry, uid=im.uid)


def sync_cache(
    im: InferenceModel,
    kube: KubeClient,
    logger: Any,
    was_shared: bool = True,
    defaults: ClusterDefaults | None = None,
) -> model_cache.CacheState | None:
    """cache.mode Shared: apply the claim (or read the adopted one), create the loader Job for the
    current model, revision and adapters if it does not exist (a Job is never edited: its template is
    immutable), delete this model's loader Jobs of earlier loads, and judge the cache's phase.
    None when the model has no shared cache (its old loader Jobs are deleted then)."""
    current = model_cache.job_name(im) if im.spec.cache.shared else None
    jobs = []
    if im.spec.cache.shared or was_shared:
        jobs = kube.list("Job", im.namespace, model_cache.loader_selector(im))
    for old in jobs:
        if not _labelled(old, model_cache.loader_selector(im)):
            continue
        jname = (old.get("metadata") or {}).get("name")
        if jname != current and kube.delete("Job", im.namespace, str(jname), owner_uid=im.uid):
            logger.info(f"deleted loader Job {im.namespace}/{jname}: the model's load changed")
    if not im.spec.cache.shared:
        return None
    if model_cache.adopts_claim(im):
        claim = kube.get("PersistentVolumeClaim", im.namespace, model_cache.claim_name(im))
    else:
        claim = kube.apply(model_cache.render_claim(im))
    state = model_cache.judge(im, claim, None)
    if state.phase != "Pending" or state.reason != "LoaderPending":
        return state  # no claim, or one that cannot serve: no loader
    job = kube.get("Job", im.namespace, model_cache.job_name(im))
    if job is None:
        logger.info(f"creating loader Job {im.namespace}/{model_cache.job_name(im)} for {im.spec.model.uri}")
        job = kube.apply(model_cache.render_job(im, defaults))
    pods: list[dict[str, Any]] = []
    if model_cache.judge(im, claim, job).phase != "Ready":
        selector = f"{model_cache.JOB_NAME_LABEL}={model_cache.job_name(im)}"
        pods = [
            p
            for p in kube.list("Pod", im.namespace, selector)
            if ((p.get("metadata") or {}).get("labels") or {}).get(model_cache.JOB_NAME_LABEL)
            == model_cache.job_name(im)
        ]
    return model_cache.judge(im, claim, job, pods)


def hand_over_replicas(im: InferenceModel, obj: dict[str, Any], kube: KubeClient, logger: Any) -> None:
    """Before an apply without spec.replicas: make sure some manager other than ours holds the count
    (see handover.py), so the apply cannot reset it to 1."""
    live = kube.get(obj["kind"], im.namespace, obj["metadata"]["name"])
    if live is None:
        # First apply: create at the autoscaler's floor, then hand that count over below.
        live = kube.apply({**obj, "spec": {**obj["spec"], "replicas": handover_count(im, None)}})
    if owns_replicas(live):
        count = handover_count(im, live)
        logger.info(
            f"handing spec.replicas={count} of {obj['kind']} {obj['metadata']['name']} to the autoscaler"
        )
        kube.apply(render_handover(im, count), field_manager=HANDOVER_MANAGER)


def _pods(kube: KubeClient, im: InferenceModel) -> list[dict[str, Any]] | None:
    """The model's pods (None if they cannot be listed: status then reads the Deployment alone)."""
    wanted = selector_labels(im)
    selector = ",".join(f"{k}={v}" for k, v in wanted.items())
    try:
        pods = kube.list("Pod", im.namespace, selector)
    except ApiError:
        return None
    return [
        p
        for p in pods
        if all(((p.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in wanted.items())
    ]


def _labelled(obj: dict[str, Any], selector: str) -> bool:
    """Whether obj carries every k=v label of selector (a lister need not filter)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, _, v in (part.partition("=") for part in selector.split(",")))


def adapters_status(im: InferenceModel, pods: list[dict[str, Any]] | None, logger: Any) -> dict[str, Any]:
    """status.adapters/adapterCount: synced through the running pods' run-time routes and read back
    from their /v1/models (adapter_sync.py); {} (keep the previous value) when the pods are unknown."""
    if not im.spec.adapters:
        return {"adapters": [], "adapterCount": 0}
    if not runtime_updates(im):
        # behind an API key the operator cannot ask the pods: the list their template was started with
        names = sorted(desired_adapters(im))
        return {"adapters": names, "adapterCount": len(names)}
    if pods is None:
        return {}
    result = adapter_sync.sync_pods(im, pods, token=credentials.admin_token(im, DEFAULTS))
    for pod in result.pods:
        if pod.loaded or pod.unloaded:
            logger.info(f"pod {pod.pod}: adapters loaded {list(pod.loaded)}, unloaded {list(pod.unloaded)}")
    for error in result.errors:
        logger.warning(f"adapters of {im.namespace}/{im.name}: {error}")
    served = result.served
    return {"adapters": served, "adapterCount": len(served)}


def carry_adapters(new: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
    """A status write that did not look at the pods keeps the adapters last seen."""
    if "adapters" in new or not old or "adapters" not in old:
        return new
    return {**new, "adapters": old["adapters"], "adapterCount": old.get("adapterCount", len(old["adapters"]))}


def _safe_get(kube: KubeClient, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return kube.get(kind, namespace, name)
    except ApiError:
        return None


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
def reconcile_handler(body: kopf.Body, memo: kopf.Memo, logger: Any, retry: int, **_: Any) -> None:
    meta = body.get("metadata") or {}
    with model_lock(meta["namespace"], meta["name"]):
        try:
            fresh = memo.kube.get("InferenceModel", meta["namespace"], meta["name"])
        except ApiError as exc:
            raise kopf.TemporaryError(str(exc), delay=backoff_delay(retry)) from exc
        if fresh is None:
            return  # deleted meanwhile
        reconcile(fresh, memo.kube, logger, retry)


_LOCKS: dict[tuple[str, str], threading.RLock] = {}
_LOCKS_GUARD = threading.Lock()


def model_lock(namespace: str, name: str) -> threading.RLock:
    """One reconcile or status write per InferenceModel at a time, each reading the model afresh
    under the lock: whichever path (spec change, child event, resync) runs last saw the newest spec,
    so a slow reconcile of an older spec can never have the last word."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault((namespace, name), threading.RLock())


@kopf.on.event(GROUP, VERSION, PLURAL, id="resync")
def resync_handler(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    # Every event registers the model with the operator-wide resync thread (resync.Resyncer). Events
    # without a type come from a (re)listing after a watch stream ended: resync at once, to catch what
    # a dropped stream lost (e.g. a child deleted while its watch reconnected).
    meta = body.get("metadata") or {}
    resyncer = getattr(memo, "resyncer", None)
    if resyncer is not None:
        if event.get("type") == "DELETED":
            resyncer.gone(meta["namespace"], meta["name"])
        else:
            resyncer.seen(meta["namespace"], meta["name"])
    if event.get("type") is not None:
        return
    resync_model(memo.kube, meta["namespace"], meta["name"], logger)


def children_drifted(body: dict[str, Any], kube: KubeClient) -> bool:
    """True if a wanted child is missing or differs, or an unwanted one still exists."""
    meta = body.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return False
    try:
        im = InferenceModel.from_manifest(body)
    except InvalidSpecError:
        return False
    if semantic_errors(im.spec):
        return False
    caps = _capabilities(kube)
    if lws_missing(im, caps):
        return False  # nothing can be applied; the CRD watch and the resync notice the API appearing
    cache_ready = True
    if im.spec.cache.shared:
        # A cache that is not filled yet is re-judged on every resync (an adopted claim created
        # later, a Job finished while a watch was down).
        cache_ready = (((body.get("status") or {}).get("cache") or {}).get("phase")) == "Ready"
        if not cache_ready:
            return True
    plan = render_all(im, caps, cache_ready=cache_ready)
    for obj in plan.objects:
        live = kube.get(obj["kind"], im.namespace, obj["metadata"]["name"])
        if live is None:
            return True
        if obj["kind"] != "Job" and not is_subset(obj, live):  # a Job is never edited
            return True
    return any(_owned_by(kube.get(ref.kind, im.namespace, ref.name), im) for ref in plan.absent)


def _owned_by(live: dict[str, Any] | None, im: InferenceModel) -> bool:
    """Whether a live child is this model's (only those are ever deleted, so only they are drift)."""
    refs = ((live or {}).get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == im.uid for ref in refs)


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


def _owner_name(body: dict[str, Any]) -> str | None:
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "InferenceModel" and ref.get("apiVersion", "").startswith(f"{GROUP}/"):
            return str(ref.get("name"))
    return None


def on_child_event(
    kind: str, event_type: str | None, child: dict[str, Any], kube: KubeClient, logger: Any
) -> None:
    """A labelled child changed: restore it if it drifted or vanished, refresh status from a Deployment."""
    owner = _owner_name(child)
    meta = child.get("metadata") or {}
    namespace = meta.get("namespace")
    if owner is None or namespace is None:
        return
    with model_lock(namespace, owner):
        _on_child_event_locked(kind, event_type, child, owner, namespace, kube, logger)


def _on_child_event_locked(
    kind: str,
    event_type: str | None,
    child: dict[str, Any],
    owner: str,
    namespace: str,
    kube: KubeClient,
    logger: Any,
) -> None:
    meta = child.get("metadata") or {}
    owner_body = kube.get("InferenceModel", namespace, owner)
    if owner_body is None or (owner_body.get("metadata") or {}).get("deletionTimestamp"):
        return  # the owner is gone: garbage collection removes the children
    owner_uid = (owner_body.get("metadata") or {}).get("uid")
    if not any(ref.get("uid") == owner_uid for ref in meta.get("ownerReferences") or []):
        return  # a stale child of an earlier object with the same name
    try:
        im = InferenceModel.from_manifest(owner_body)
    except InvalidSpecError:
        return  # the owner's own handler reports it
    if semantic_errors(im.spec):
        return

    name = str(meta.get("name"))
    if kind == "Job":
        # A loader Job started, finished or failed: the cache's phase, and maybe the Deployment, follow.
        logger.info(f"loader Job {namespace}/{name} changed ({event_type or 'listed'}): reconciling")
        try:
            reconcile(owner_body, kube, logger)
        except (kopf.TemporaryError, kopf.PermanentError) as exc:
            logger.warning(f"reconcile after loader Job {namespace}/{name} postponed: {exc}")
        return
    objects = render_all(im, _capabilities(kube), cache_ready=_cache_ready(owner_body, im)).objects
    wanted = {obj["kind"]: obj for obj in objects}  # the model's own win (they come last)
    # Judged by kind and name: the router's children share kinds with the model's.
    desired = next((o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name), None)
    # Events can arrive late; judge the child as it is now.
    current = kube.get(kind, namespace, name)
    if current is not None and (current.get("metadata") or {}).get("uid") != meta.get("uid"):
        return  # replaced meanwhile; its own events cover it
    if current is None and desired is None:
        return  # an unwanted child is gone (e.g. the router after routing was turned off)
    if current is None or desired is None or not is_subset(desired, current):
        logger.info(f"{kind} {namespace}/{meta.get('name')} drifted ({event_type or 'listed'}): reconciling")
        try:
            reconcile(owner_body, kube, logger)
        except (kopf.TemporaryError, kopf.PermanentError) as exc:
            logger.warning(f"drift repair of {namespace}/{owner} postponed: {exc}")
        return

    if (kind, name) == (workload_kind(im), workload_name(im)):  # not the router's
        refresh_status(im, owner_body, as_workload(kind, current), wanted, kube, logger)


def _cache_ready(owner_body: dict[str, Any], im: InferenceModel) -> bool:
    if not im.spec.cache.shared:
        return True
    return (((owner_body.get("status") or {}).get("cache") or {}).get("phase")) == "Ready"


def _previous_cache(im: InferenceModel, previous: dict[str, Any] | None) -> model_cache.CacheState | None:
    """The cache's phase as the last reconcile judged it (Job events reconcile, so it is current)."""
    if not im.spec.cache.shared:
        return None
    old = (previous or {}).get("cache") or {}
    if not old.get("phase"):
        return model_cache.CacheState(
            "Pending", model_cache.claim_name(im), None, "LoaderPending", "the cache is not judged yet"
        )
    return model_cache.CacheState(
        str(old["phase"]),
        str(old.get("claimName") or model_cache.claim_name(im)),
        old.get("jobName"),
        str(old.get("reason") or ""),
        str(old.get("message") or ""),
    )


def refresh_status(
    im: InferenceModel,
    owner_body: dict[str, Any],
    deployment: dict[str, Any] | None,
    wanted: dict[str, dict[str, Any]],
    kube: KubeClient,
    logger: Any,
    caps: Capabilities | None = None,
) -> None:
    """Recompute and write status from the live workload and pods, without applying anything."""
    previous = owner_body.get("status")
    prev_degraded = next(
        (c for c in (previous or {}).get("conditions") or [] if c.get("type") == "Degraded"), None
    )
    # A pending retry after an API failure keeps its Degraded note until a reconcile succeeds.
    apply_error = None
    if (
        prev_degraded
        and prev_degraded.get("status") == "True"
        and prev_degraded.get("reason") == "ApplyFailed"
    ):
        apply_error = prev_degraded.get("message") or "apply failed"
    skipped = None
    if not im.spec.monitoring.service_monitor.enabled:
        skipped = "Disabled"
    elif "ServiceMonitor" not in wanted:
        skipped = "CRDNotInstalled"
    elif kube.get("ServiceMonitor", im.namespace, im.child_name) is None:
        skipped = "NotApplied"  # report only what exists; the resync applies it
    blocked = lws_missing(im, caps or _capabilities(kube))
    outcome = ReconcileOutcome(
        apply_error=apply_error,
        monitoring_skipped_reason=skipped,
        cache=_previous_cache(im, previous),
        blocked_reason=CRD_MISSING_REASON if blocked else None,
        blocked_message=CRD_MISSING_MESSAGE if blocked else "",
    )
    pods = _pods(kube, im)
    status = compute_status(im, deployment, outcome, previous, _now(), pods)
    # a pod that became ready or was unreachable last time gets its adapters here
    new = {**status.to_dict(), **adapters_status(im, pods, logger)}
    _write_status(kube, im.namespace, im.name, new, previous, logger, uid=im.uid)


def on_pod_event(pod: dict[str, Any], kube: KubeClient, logger: Any) -> None:
    """A model's pod changed (scheduled, pulled, crashed, became ready): refresh the model's status."""
    meta = pod.get("metadata") or {}
    owner = (meta.get("annotations") or {}).get(MODEL_ANNOTATION)
    namespace = meta.get("namespace")
    if not owner or not namespace:
        return
    with model_lock(namespace, owner):
        owner_body = kube.get("InferenceModel", namespace, owner)
        if owner_body is None or (owner_body.get("metadata") or {}).get("deletionTimestamp"):
            return
        try:
            im = InferenceModel.from_manifest(owner_body)
        except InvalidSpecError:
            return
        if semantic_errors(im.spec):
            return
        if ((meta.get("labels") or {}).get("app.kubernetes.io/instance")) != im.child_name:
            return  # a pod of another model that copied the annotation
        plan = render_all(im, _capabilities(kube), cache_ready=_cache_ready(owner_body, im))
        wanted = {obj["kind"]: obj for obj in plan.objects}
        refresh_status(im, owner_body, _live_workload(kube, im), wanted, kube, logger)


@kopf.on.event("", "v1", "pods", labels=MANAGED, id="pods")
def pod_event_handler(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    try:
        on_pod_event(_plain(body), memo.kube, logger)
    except ApiError as exc:
        logger.warning(f"pod event not handled: {exc}")


def resync_model(kube: KubeClient, namespace: str, name: str, logger: Any) -> None:
    """Reconcile one model if a child is missing, drifted, or newly possible (an optional CRD)."""
    try:
        with model_lock(namespace, name):
            # A listing may be older than the latest spec; a stale snapshot must never be applied.
            plain = kube.get("InferenceModel", namespace, name)
            if plain is None:
                return
            if children_drifted(plain, kube):
                logger.info(f"resync of {namespace}/{name}: children missing, drifted or newly possible")
                reconcile(plain, kube, logger)
    except (kopf.TemporaryError, kopf.PermanentError) as exc:
        logger.warning(f"resync of {namespace}/{name} postponed: {exc}")
    except ApiError as exc:
        logger.warning(f"resync of {namespace}/{name} skipped: {exc}")


# Optional kinds the operator renders once their CRD exists.
OPTIONAL_CRDS = frozenset({"servicemonitors.monitoring.coreos.com", "scaledobjects.keda.sh", LWS_CRD_NAME})


@kopf.on.event("apiextensions.k8s.io", "v1", "customresourcedefinitions", id="optional-crds")
def crd_event_handler(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """The Prometheus Operator, KEDA or LWS installed (or removed) after the models: resync them now."""
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
        try:
            on_child_event(kind, event.get("type"), _plain(body), memo.kube, logger)
        except ApiError as exc:
            logger.warning(f"{kind} event not handled: {exc}")


for _kind in (
    "Deployment",
    "Service",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "ServiceMonitor",
    "ScaledObject",
    "Job",
    LWS_KIND,
):
    _register_child_watch(_kind)
