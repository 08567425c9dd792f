"""One reconcile of one InferenceModel, in the order controller-runtime's Reconcilers read:

1. observe: the model as it is now, which optional APIs the cluster serves, the shared cache's claim,
   loader Jobs and pods, and the children the trigger asks about (`observe`); once
   it is known that something will be written, its Namespace (one being deleted is left alone: no
   apply, no status, no Event) and what the status reports, the live workload and pods
   (`observe_status_inputs`). These reads are API calls, not an informer's cache, so each is made only
   when a decision or the status needs it;
2. compute what is desired (`desire`): render.render_all, pure;
3. apply it (`apply`): the cache's claim and loader Job, every child by server-side apply, the
   autoscaler's replica handover, deletion of children no longer wanted; only when the trigger calls
   for it (`should_apply`): always for a spec change, on drift for a child event or a resync, never
   for a pod event;
4. write status (`outcome_of` and status.compute_status, pure; then one merge patch and, on a change
   of phase, a Kubernetes Event).

Each step runs once, in that order. A model being deleted is left alone too (garbage collection removes
its children), and a create the API server refuses because the namespace is being terminated ends the
reconcile quietly. Errors come back as RetryLater or GiveUp, which handlers.py turns into kopf's; this
module knows nothing of kopf. kube (k8s.KubeClient) is the only way to the API server.
"""

from __future__ import annotations

import datetime
import enum
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from . import adapter_sync, credentials
from . import cache as model_cache
from .adapters import desired_adapters, runtime_updates
from .admission import AdmissionPolicy
from .canary import canary_view_name
from .common import MODEL_ANNOTATION, child_metadata, selector_labels
from .defaults import ClusterDefaults
from .deployment import (
    IMAGE_VOLUME_MIN_VERSION,
    IMAGE_VOLUME_UNSUPPORTED_REASON,
    image_volume_unsupported_message,
)
from .handover import HANDOVER_MANAGER, handover_count, owns_replicas, render_handover
from .k8s import KINDS, ApiError, KubeClient
from .lws import CRD_MISSING_MESSAGE, CRD_MISSING_REASON, as_workload
from .memory import BELOW_ESTIMATE, recorded_estimate
from .memory import CONDITION as MEMORY_CONDITION
from .policy import model_policy_errors
from .render import CACHE_KINDS, Capabilities, ChildRef, RenderPlan, is_subset, render_all
from .spec import GROUP, InferenceModel, InvalidSpecError, semantic_errors
from .status import ReconcileOutcome, compute_status, failed_status, same_status
from .workload import LWS_KIND, multi_node, workload_kind, workload_name


class Trigger(enum.Enum):
    """What started a reconcile; it decides only whether the apply step runs."""

    SPEC = "spec"  # created, updated, resumed, or its loader Job changed: apply, then status
    RESYNC = "resync"  # periodic, a re-listing, an optional CRD appeared: apply only on drift
    CHILD = "child"  # a child changed: apply on drift, else refresh status (when it is the workload)
    PODS = "pods"  # one of its pods changed: status only


class RetryLater(Exception):
    """The API failed in a way worth retrying (handlers: kopf.TemporaryError with backoff)."""


class GiveUp(Exception):
    """The spec cannot be deployed, or the API refused it for good (handlers: kopf.PermanentError)."""


@dataclass(frozen=True)
class CacheObservation:
    """cache.mode Shared: the claim, the current load's loader Job and its pods, and every loader Job
    of this model (earlier loads' are deleted)."""

    claim: dict[str, Any] | None
    job: dict[str, Any] | None
    loader_pods: list[dict[str, Any]]
    loader_jobs: list[dict[str, Any]]


@dataclass(frozen=True)
class Observed:
    """Everything a reconcile reads before it decides anything."""

    body: dict[str, Any]  # the InferenceModel as read now
    im: InferenceModel | None  # None: the spec does not parse
    invalid: str | None  # why the spec cannot be deployed (parse or semantic errors)
    caps: Capabilities
    workload: dict[str, Any] | None  # the live Deployment/LeaderWorkerSet, shaped for status
    pods: list[dict[str, Any]] | None  # None: not listed, or not listable
    cache: CacheObservation | None  # a model with (or, until cleaned up, once with) a shared cache
    children: Mapping[ChildRef, dict[str, Any] | None] = field(default_factory=dict)
    # An oci:// model on an API server without image volumes: why (nothing is applied then).
    image_volume_blocked: str | None = None
    canary_workload: dict[str, Any] | None = None  # spec.canary's live Deployment, shaped for status

    @property
    def previous(self) -> dict[str, Any] | None:
        status = self.body.get("status")
        return dict(status) if status else None

    @property
    def lws_missing(self) -> bool:
        """A multi-node spec on a cluster without the LeaderWorkerSet API: nothing can be applied."""
        return self.im is not None and multi_node(self.im) and not self.caps.leader_worker_set

    @property
    def blocked(self) -> tuple[str, str] | None:
        """(reason, message) when the cluster lacks an API the spec needs: nothing is applied."""
        if self.lws_missing:
            return CRD_MISSING_REASON, CRD_MISSING_MESSAGE
        if self.image_volume_blocked is not None:
            return IMAGE_VOLUME_UNSUPPORTED_REASON, self.image_volume_blocked
        return None


@dataclass
class Applied:
    """What the apply step did, as far as it got."""

    workload: dict[str, Any] | None = None  # the workload as the API server answered the apply
    cache: model_cache.CacheState | None = None


# (namespace, name, uid, type, reason, message): post a Kubernetes Event on the InferenceModel.
PostEvent = Callable[[str, str, str, str, str, str], None]
# The administrator's admission policy (admission.py), read at each reconcile: handlers.POLICY.
PolicySource = Callable[[], AdmissionPolicy]

_LOCKS: dict[tuple[str, str], threading.RLock] = {}
_LOCKS_GUARD = threading.Lock()


def model_lock(namespace: str, name: str) -> threading.RLock:
    """One reconcile per InferenceModel at a time, each reading the model afresh under the lock:
    whichever trigger (spec change, child event, resync) runs last saw the newest spec, so a slow
    reconcile of an older spec can never have the last word."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault((namespace, name), threading.RLock())


def now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    def __init__(
        self,
        kube: KubeClient,
        defaults: ClusterDefaults,
        post_event: PostEvent,
        policy: PolicySource = AdmissionPolicy,
    ) -> None:
        self.kube = kube
        self.defaults = defaults
        self.post_event = post_event
        self.policy = policy

    # --- entry points (under model_lock)

    def reconcile(
        self,
        namespace: str,
        name: str,
        trigger: Trigger,
        logger: Any,
        child: dict[str, Any] | None = None,
    ) -> None:
        """Observe, desire, apply (if the trigger calls for it), write status. `child`: the child
        (Trigger.CHILD, its `kind` set) or pod (Trigger.PODS) from the watch event. Raises RetryLater
        (also when the status of a finished apply could not be written) or GiveUp."""
        try:
            body = self.kube.get("InferenceModel", namespace, name)
            if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                return  # deleted meanwhile, or being deleted: garbage collection removes the children
            ref = _child_ref(child) if trigger is Trigger.CHILD and child is not None else None
            if ref is not None:
                if not _owned_by(child, (body.get("metadata") or {}).get("uid")):
                    return  # a stale child of an earlier object with the same name
                if ref.kind == "Job":
                    # A loader Job started, finished or failed: the cache's phase, and maybe the
                    # Deployment, follow.
                    trigger, ref = Trigger.SPEC, None
            observed = self.observe(body, trigger, ref)
            if observed.invalid is not None and trigger is not Trigger.SPEC:
                return  # the spec's own handler reports it
            if trigger is Trigger.PODS and not _pod_of(child, observed.im):
                return
            if ref is not None and not _child_current(child, observed):
                return
            plan = desire(observed) if observed.invalid is None else None
            apply_now = plan is not None and should_apply(trigger, observed, plan, ref)
            if plan is not None and not apply_now and not _refreshes_status(trigger, ref, observed.im):
                return  # nothing to apply, no status to refresh
            # Something is about to be written: not into a namespace being deleted.
            if self.kube.namespace_terminating(namespace):
                logger.info(f"{namespace}/{name}: the namespace is being terminated; the model is left alone")
                return
            observed = self.observe_status_inputs(observed, applying=apply_now)
        except ApiError as exc:
            raise RetryLater(str(exc)) from exc
        if plan is None:
            self._report_invalid(observed, logger)
            return
        im = observed.im
        assert im is not None
        applied: Applied | None = None
        if apply_now:
            if trigger is not Trigger.SPEC:
                logger.info(f"{namespace}/{name}: children missing, drifted or newly possible: reconciling")
            applied = Applied()
            try:
                self.apply(observed, plan, applied, logger)
            except ApiError as exc:
                if exc.namespace_terminating:
                    logger.info(
                        f"{namespace}/{name}: the namespace is being terminated; nothing more is applied"
                    )
                    return
                outcome = outcome_of(observed, plan, applied, error=str(exc))
                workload = applied.workload if applied.workload is not None else observed.workload
                status = compute_status(
                    im, workload, outcome, observed.previous, now(), observed.pods, observed.canary_workload
                )
                self.write_status(observed, status.to_dict(), logger)
                raise (RetryLater if exc.transient else GiveUp)(str(exc)) from exc
        outcome = outcome_of(observed, plan, applied)
        workload = (
            applied.workload if applied is not None and applied.workload is not None else observed.workload
        )
        status = compute_status(
            im, workload, outcome, observed.previous, now(), observed.pods, observed.canary_workload
        )
        new = {**status.to_dict(), **self.adapters_status(im, observed.pods, logger)}
        self.write_status(observed, new, logger, strict=applied is not None)

    # --- 1. observe

    def capabilities(self) -> Capabilities:
        def served(kind: str) -> bool:
            return self.kube.serves(KINDS[kind].api_version, KINDS[kind].plural)

        return Capabilities(
            service_monitor=served("ServiceMonitor"),
            keda=served("ScaledObject"),
            defaults=self.defaults,
            leader_worker_set=served(LWS_KIND),
            hpa=served("HorizontalPodAutoscaler"),
            # Not even asked about unless the installation renders them (its RBAC would refuse them).
            inference_pool=self.defaults.inference_extension and served("InferencePool"),
            http_route=self.defaults.inference_extension and served("HTTPRoute"),
            inference_objective=self.defaults.inference_extension and served("InferenceObjective"),
            inference_extension=self.defaults.inference_extension,
        )

    def observe(self, body: dict[str, Any], trigger: Trigger, child: ChildRef | None = None) -> Observed:
        caps = self.capabilities()
        try:
            im = InferenceModel.from_manifest(body)
        except InvalidSpecError as exc:
            return Observed(body, None, str(exc), caps, None, None, None)

        # an admin policy violation is reported like an invalid spec (Degraded/InvalidSpec, nothing applied)
        problems = semantic_errors(im.spec) + model_policy_errors(im, self.policy(), self.defaults)
        if problems:
            return Observed(body, im, "; ".join(problems), caps, None, None, None)
        # Any trigger may apply, and the plan depends on the cache being filled: always judged afresh.
        cache = self._cache(im, body)
        refs: list[ChildRef] = []
        if trigger is Trigger.RESYNC:
            plan = render_all(im, caps, cache_ready=_previous_cache_ready(body, im))
            refs = [ChildRef(o["kind"], o["metadata"]["name"]) for o in plan.objects] + list(plan.absent)
        elif child is not None:
            refs = [child]
        children = {ref: self.kube.get(ref.kind, im.namespace, ref.name) for ref in refs}
        return Observed(body, im, None, caps, None, None, cache, children, self._image_volume_blocked(im))

    def _image_volume_blocked(self, im: InferenceModel) -> str | None:
        """Why an oci:// model's image volume cannot work on this API server (None: it can, or the
        version is unknown and the pods will tell)."""
        canary = im.spec.canary
        if not (im.spec.model.uri.startswith("oci://") or (canary and canary.model.uri.startswith("oci://"))):
            return None
        try:
            version = self.kube.server_version()
        except ApiError:
            return None
        if version is None or version >= IMAGE_VOLUME_MIN_VERSION:
            return None
        return image_volume_unsupported_message(version)

    def observe_status_inputs(self, observed: Observed, applying: bool) -> Observed:
        """What only the status reports (read once it is known that a status is written): the live
        workload and pods, and, without an apply, the ServiceMonitor that exists."""
        im = observed.im
        if im is None:
            return observed
        children = dict(observed.children)
        monitor = ChildRef("ServiceMonitor", im.child_name)
        if not applying and observed.invalid is None and monitor not in children:
            children[monitor] = self.kube.get(monitor.kind, im.namespace, monitor.name)
        return replace(
            observed,
            workload=self._workload(im, observed.caps, children),
            pods=self._pods(im) if observed.invalid is None else None,
            children=children,
            canary_workload=self._canary_workload(im, children),
        )

    def _canary_workload(self, im: InferenceModel, seen: Mapping[ChildRef, Any]) -> dict[str, Any] | None:
        """spec.canary's live Deployment (None without a canary, or unreadable)."""
        if im.spec.canary is None:
            return None
        ref = ChildRef("Deployment", canary_view_name(im))
        if ref in seen:
            return as_workload(ref.kind, seen[ref])
        try:
            return as_workload(ref.kind, self.kube.get(ref.kind, im.namespace, ref.name))
        except ApiError:
            return None

    def _workload(
        self, im: InferenceModel, caps: Capabilities, seen: Mapping[ChildRef, Any]
    ) -> dict[str, Any] | None:
        """The live Deployment or LeaderWorkerSet (None if unreadable), as already read for the
        trigger if it was. Without the LeaderWorkerSet API nothing multi-node exists: what still runs
        (a Deployment) is shown."""
        kind, name = workload_kind(im), workload_name(im)
        if kind == LWS_KIND and not caps.leader_worker_set:
            kind, name = "Deployment", im.child_name
        if ChildRef(kind, name) in seen:
            return as_workload(kind, seen[ChildRef(kind, name)])
        try:
            return as_workload(kind, self.kube.get(kind, im.namespace, name))
        except ApiError:
            return None

    def _pods(self, im: InferenceModel) -> list[dict[str, Any]] | None:
        """The model's pods (None if they cannot be listed: status then reads the workload alone)."""
        wanted = selector_labels(im)
        try:
            pods = self.kube.list("Pod", im.namespace, ",".join(f"{k}={v}" for k, v in wanted.items()))
        except ApiError:
            return None
        return [p for p in pods if _labels_match(p, wanted)]

    def _cache(self, im: InferenceModel, body: dict[str, Any]) -> CacheObservation | None:
        was_shared = bool((body.get("status") or {}).get("cache"))
        if not (im.spec.cache.shared or was_shared):
            return None
        selector = model_cache.loader_selector(im)
        jobs = [j for j in self.kube.list("Job", im.namespace, selector) if _labelled(j, selector)]
        if not im.spec.cache.shared:
            return CacheObservation(None, None, [], jobs)
        claim = self.kube.get("PersistentVolumeClaim", im.namespace, model_cache.claim_name(im))
        jname = model_cache.job_name(im)
        job = next((j for j in jobs if (j.get("metadata") or {}).get("name") == jname), None)
        pods: list[dict[str, Any]] = []
        if job is not None:  # when Ready too: the finished pod's termination message is the memory estimate
            label = model_cache.JOB_NAME_LABEL
            pods = [
                p
                for p in self.kube.list("Pod", im.namespace, f"{label}={jname}")
                if ((p.get("metadata") or {}).get("labels") or {}).get(label) == jname
            ]
        return CacheObservation(claim, job, pods, jobs)

    # --- 3. apply

    def apply(self, observed: Observed, plan: RenderPlan, applied: Applied, logger: Any) -> None:
        """The cache first (its claim, and its loader Job when missing: a Job is never edited), then
        every child in the plan's order, then deletion of what the plan wants absent."""
        im = observed.im
        assert im is not None
        if observed.cache is not None:
            applied.cache = self._apply_cache(im, observed.cache, logger)
        # the pods' admin key first: a pod whose Secret is missing cannot start
        credentials.ensure_admin_secret(self.kube, im, child_metadata(im), self.defaults)
        for obj in plan.objects:
            if obj["kind"] in CACHE_KINDS:
                continue  # applied above
            is_workload = (obj["kind"], obj["metadata"]["name"]) == (workload_kind(im), workload_name(im))
            if is_workload and im.spec.replicas_delegated and plan.autoscaling_skipped_reason is None:
                self._hand_over_replicas(im, obj, logger)
            live = self.kube.apply(obj)
            if is_workload:
                applied.workload = as_workload(obj["kind"], live)
        for ref in plan.absent:
            if self.kube.delete(ref.kind, im.namespace, ref.name, owner_uid=im.uid):
                logger.info(f"deleted {ref.kind} {im.namespace}/{ref.name}: no longer wanted by the spec")

    def _apply_cache(
        self, im: InferenceModel, seen: CacheObservation, logger: Any
    ) -> model_cache.CacheState | None:
        current = model_cache.job_name(im) if im.spec.cache.shared else None
        for old in seen.loader_jobs:
            jname = (old.get("metadata") or {}).get("name")
            if jname != current and self.kube.delete("Job", im.namespace, str(jname), owner_uid=im.uid):
                logger.info(f"deleted loader Job {im.namespace}/{jname}: the model's load changed")
        if not im.spec.cache.shared:
            return None
        claim = seen.claim if model_cache.adopts_claim(im) else self.kube.apply(model_cache.render_claim(im))
        state = model_cache.judge(im, claim, None)
        if state.phase != "Pending" or state.reason != "LoaderPending":
            return state  # no claim, or one that cannot serve: no loader
        job = seen.job
        if job is None:
            logger.info(f"creating loader Job {im.namespace}/{current} for {im.spec.model.uri}")
            job = self.kube.apply(model_cache.render_job(im, self.defaults))
        return model_cache.judge(im, claim, job, seen.loader_pods)

    def _hand_over_replicas(self, im: InferenceModel, obj: dict[str, Any], logger: Any) -> None:
        """Before an apply without spec.replicas: make sure some manager other than ours holds the count
        (see handover.py), so the apply cannot reset it to 1."""
        # Read with its managedFields (the observed workload is shaped for status).
        live = self.kube.get(obj["kind"], im.namespace, obj["metadata"]["name"])
        if live is None:
            # First apply: create at the autoscaler's floor, then hand that count over below.
            live = self.kube.apply({**obj, "spec": {**obj["spec"], "replicas": handover_count(im, None)}})
        if owns_replicas(live):
            count = handover_count(im, live)
            logger.info(
                f"handing spec.replicas={count} of {obj['kind']} {obj['metadata']['name']} to the autoscaler"
            )
            self.kube.apply(render_handover(im, count), field_manager=HANDOVER_MANAGER)

    # --- 4. status

    def adapters_status(
        self, im: InferenceModel, pods: list[dict[str, Any]] | None, logger: Any
    ) -> dict[str, Any]:
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
        result = adapter_sync.sync_pods(im, pods, token=credentials.admin_token(im, self.defaults))
        for pod in result.pods:
            if pod.loaded or pod.unloaded:
                logger.info(
                    f"pod {pod.pod}: adapters loaded {list(pod.loaded)}, unloaded {list(pod.unloaded)}"
                )
        for error in result.errors:
            logger.warning(f"adapters of {im.namespace}/{im.name}: {error}")
        return {"adapters": result.served, "adapterCount": len(result.served)}

    def _report_invalid(self, observed: Observed, logger: Any) -> None:
        message = str(observed.invalid)
        if observed.im is None:
            meta = observed.body.get("metadata") or {}
            status = failed_status(meta.get("generation"), message, observed.previous, now())
        else:
            outcome = ReconcileOutcome(invalid_spec=message)
            status = compute_status(observed.im, observed.workload, outcome, observed.previous, now())
        new = status.to_dict()
        kept = (observed.previous or {}).get("memoryEstimate")
        if kept:  # a spec fixed again finds it (recorded_estimate checks it still matches)
            new["memoryEstimate"] = kept
        self.write_status(observed, new, logger)
        raise GiveUp(f"invalid spec: {message}")

    def write_status(
        self, observed: Observed, new: dict[str, Any], logger: Any, strict: bool = False
    ) -> None:
        """Write status if it changed, and post a change of phase, Degraded reason or cache phase as an
        Event. `strict` (a finished reconcile): a transient failure is RetryLater, so no stale status
        stays behind; otherwise (the write accompanies an error retried anyway) it is logged."""
        meta = observed.body.get("metadata") or {}
        namespace, name, uid = str(meta.get("namespace")), str(meta.get("name")), meta.get("uid")
        previous = observed.previous
        new = carry_adapters(new, previous)
        if same_status(previous, new):
            return
        # A merge patch keeps every key it does not name: a block the new status no longer has
        # (status.canary after a promotion, status.cache after cache.mode Shared is dropped) is
        # removed with null, else it stays forever and the status is rewritten on every reconcile.
        patch = {**{key: None for key in (previous or {}) if key not in new}, **new}
        try:
            self.kube.patch_status(namespace, name, patch)
        except ApiError as exc:
            if strict and exc.transient:
                raise RetryLater(str(exc)) from exc
            logger.warning(f"status not written: {exc}")
            return
        if uid:
            for type_, reason, message in transitions(previous, new):
                self.post_event(namespace, name, str(uid), type_, reason, message)


# --- 2. desire, and the pure decisions around it


def _gateway_condition_stale(body: dict[str, Any], im: InferenceModel, plan: RenderPlan) -> bool:
    """GatewayAvailable says other than this plan: an extension CRD came or went without any child
    changing (seen on a real API server, issue 48: the InferenceObjective's CRD deleted, the condition
    stayed True), so the reconcile must run to rewrite status."""
    if not im.spec.routing.gateway.enabled:
        return False
    previous = next(
        (
            c
            for c in ((body.get("status") or {}).get("conditions") or [])
            if c.get("type") == "GatewayAvailable"
        ),
        None,
    )
    if previous is None:
        return False  # not reported yet: the first reconcile applies anyway
    skip = plan.gateway_skipped
    if skip is None:
        return previous.get("status") == "False"
    return previous.get("status") != "False" or not str(previous.get("message", "")).startswith(skip.message)


def _previous_cache_ready(body: dict[str, Any], im: InferenceModel) -> bool:
    if not im.spec.cache.shared:
        return True
    return (((body.get("status") or {}).get("cache") or {}).get("phase")) == "Ready"


def cache_ready(observed: Observed) -> bool:
    """A shared cache is filled: judged from the claim, Job and loader pods just read."""
    im = observed.im
    assert im is not None
    if not im.spec.cache.shared:
        return True
    seen = observed.cache
    if seen is None:
        return _previous_cache_ready(observed.body, im)
    return model_cache.judge(im, seen.claim, seen.job, seen.loader_pods).ready


def memory_estimate(observed: Observed) -> model_cache.LoaderEstimate | None:
    """The shared-cache loader's memory estimate for the current load: read from its finished pod, else
    the one status.memoryEstimate kept for this load (the pod was deleted: the pods keep their memory,
    and no rollout follows). None: no loader, not finished, no estimate, or a changed model."""
    im, seen = observed.im, observed.cache
    if im is None or not im.spec.cache.shared:
        return None
    if seen is not None:
        fresh = model_cache.judge(im, seen.claim, seen.job, seen.loader_pods).memory
        if fresh is not None:
            return fresh
    return recorded_estimate(im, observed.previous)


def desire(observed: Observed) -> RenderPlan:
    """Every child the model wants, and the optional ones it wants absent (render.render_all)."""
    assert observed.im is not None
    return render_all(
        observed.im, observed.caps, cache_ready=cache_ready(observed), estimate=memory_estimate(observed)
    )


def should_apply(trigger: Trigger, observed: Observed, plan: RenderPlan, child: ChildRef | None) -> bool:
    if observed.blocked is not None:
        # Nothing applied or deleted: a running Deployment keeps serving the old spec; the CRD watch
        # or the next resync reconciles once the API is served.
        return False
    if trigger is Trigger.SPEC:
        return True
    if trigger is Trigger.PODS:
        return False
    if trigger is Trigger.CHILD:
        assert child is not None
        return child.kind == "Job" or child_drifted(plan, observed, child)
    return drifted(plan, observed)


def drifted(plan: RenderPlan, observed: Observed) -> bool:
    """A wanted child is missing or differs, an unwanted one of this model still exists, or a shared
    cache is not filled yet (re-judged on every resync: an adopted claim created later, a Job finished
    while a watch was down)."""
    im = observed.im
    assert im is not None
    if im.spec.cache.shared and not _previous_cache_ready(observed.body, im):
        return True
    if _gateway_condition_stale(observed.body, im, plan):
        return True
    for obj in plan.objects:
        live = observed.children.get(ChildRef(obj["kind"], obj["metadata"]["name"]))
        if live is None:
            return True
        if obj["kind"] != "Job" and not is_subset(obj, live):  # a Job is never edited
            return True
    return any(_owned_by(observed.children.get(ref), im.uid) for ref in plan.absent)


def child_drifted(plan: RenderPlan, observed: Observed, ref: ChildRef) -> bool:
    """The changed child (as it is now) is missing while wanted, unwanted while it exists, or differs."""
    desired = next(
        (o for o in plan.objects if (o["kind"], o["metadata"]["name"]) == (ref.kind, ref.name)), None
    )
    current = observed.children.get(ref)
    if current is None and desired is None:
        return False  # an unwanted child is gone (e.g. the router after routing was turned off)
    return current is None or desired is None or not is_subset(desired, current)


def _refreshes_status(trigger: Trigger, child: ChildRef | None, im: InferenceModel | None) -> bool:
    """Without an apply, status is refreshed for pod events and for events of the workload itself."""
    if trigger is Trigger.PODS:
        return True
    if trigger is Trigger.CHILD and child is not None and im is not None:
        # The workload, or the Deployment that still serves while the LeaderWorkerSet API is missing.
        workloads = {
            (workload_kind(im), workload_name(im)),
            ("Deployment", im.child_name),
            ("Deployment", canary_view_name(im)),
        }
        return (child.kind, child.name) in workloads
    return trigger is Trigger.SPEC  # the LeaderWorkerSet API is missing: status says so


def outcome_of(
    observed: Observed, plan: RenderPlan, applied: Applied | None, error: str | None = None
) -> ReconcileOutcome:
    """What status reports about this reconcile. Without an apply (a status refresh, or the
    LeaderWorkerSet API missing) it reports what exists, and keeps a pending retry's ApplyFailed."""
    im = observed.im
    assert im is not None
    if applied is not None:
        return ReconcileOutcome(
            apply_error=error,
            monitoring_skipped_reason=plan.monitoring_skipped_reason,
            cache=applied.cache if applied.cache is not None else previous_cache(im, observed.previous),
            autoscaling_skipped_reason=plan.autoscaling_skipped_reason,
            gateway_skipped=plan.gateway_skipped,
            memory=memory_estimate(observed),
        )
    blocked = observed.blocked
    return ReconcileOutcome(
        apply_error=_pending_apply_error(observed.previous),
        monitoring_skipped_reason=_monitoring_seen(im, plan, observed),
        cache=previous_cache(im, observed.previous),
        blocked_reason=blocked[0] if blocked else None,
        blocked_message=blocked[1] if blocked else "",
        autoscaling_skipped_reason=plan.autoscaling_skipped_reason,
        gateway_skipped=plan.gateway_skipped,
        memory=memory_estimate(observed),
    )


def _pending_apply_error(previous: dict[str, Any] | None) -> str | None:
    degraded = next(
        (c for c in (previous or {}).get("conditions") or [] if c.get("type") == "Degraded"), None
    )
    if degraded and degraded.get("status") == "True" and degraded.get("reason") == "ApplyFailed":
        return str(degraded.get("message") or "apply failed")
    return None


def _monitoring_seen(im: InferenceModel, plan: RenderPlan, observed: Observed) -> str | None:
    if plan.monitoring_skipped_reason is not None:
        return plan.monitoring_skipped_reason
    if observed.children.get(ChildRef("ServiceMonitor", im.child_name)) is None:
        return "NotApplied"  # report only what exists; the resync applies it
    return None


def previous_cache(im: InferenceModel, previous: dict[str, Any] | None) -> model_cache.CacheState | None:
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


def carry_adapters(new: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
    """A status write that did not look at the pods keeps the adapters last seen."""
    if "adapters" in new or not old or "adapters" not in old:
        return new
    return {**new, "adapters": old["adapters"], "adapterCount": old.get("adapterCount", len(old["adapters"]))}


def transitions(old: dict[str, Any] | None, new: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events a status change announces: the cache's phase, an explicit
    resources.memory below the estimate (memory.py), and the model's phase or Degraded reason."""
    events = []
    if _cache_key(old) != _cache_key(new) and new.get("cache"):
        cache = new["cache"]
        events.append(
            (
                "Warning" if cache.get("phase") == "Failed" else "Normal",
                str(cache.get("reason") or "Cache" + str(cache.get("phase"))),
                f"cache {cache.get('phase')}: {cache.get('message') or ''}".rstrip(": "),
            )
        )
    memory = _memory_warning(new)
    if memory is not None and memory != _memory_warning(old):
        events.append(("Warning", BELOW_ESTIMATE, memory))
    if _transition_key(old) != _transition_key(new):
        conds = {c.get("type"): c for c in new.get("conditions") or []}
        degraded = conds.get("Degraded") or {}
        warning = degraded.get("status") == "True"
        source = degraded if warning else (conds.get("Ready") or {})
        events.append(
            (
                "Warning" if warning else "Normal",
                str(source.get("reason") or new.get("phase") or "StatusChanged"),
                f"{new.get('phase')}: {source.get('message') or ''}".rstrip(": "),
            )
        )
    return events


def _memory_warning(status: dict[str, Any] | None) -> str | None:
    """The MemorySufficient condition's message while an explicit resources.memory is below the
    estimate (each new pair of numbers is a new Warning Event), else None."""
    for c in (status or {}).get("conditions") or []:
        if c.get("type") == MEMORY_CONDITION and c.get("reason") == BELOW_ESTIMATE:
            return str(c.get("message") or "")
    return None


def _transition_key(status: dict[str, Any] | None) -> tuple[str, str]:
    conds = {c.get("type"): c for c in (status or {}).get("conditions") or []}
    degraded = conds.get("Degraded") or {}
    reason = str(degraded.get("reason") or "") if degraded.get("status") == "True" else ""
    return str((status or {}).get("phase") or ""), reason


def _cache_key(status: dict[str, Any] | None) -> tuple[str, str]:
    cache = (status or {}).get("cache") or {}
    return str(cache.get("phase") or ""), str(cache.get("reason") or "")


# --- event routing helpers (pure)


def owner_of_child(child: dict[str, Any]) -> str | None:
    """The InferenceModel a child belongs to, by its ownerReference."""
    for ref in (child.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "InferenceModel" and ref.get("apiVersion", "").startswith(f"{GROUP}/"):
            return str(ref.get("name"))
    return None


def owner_of_pod(pod: dict[str, Any]) -> str | None:
    """The InferenceModel a pod serves, by the annotation on its template."""
    owner = ((pod.get("metadata") or {}).get("annotations") or {}).get(MODEL_ANNOTATION)
    return str(owner) if owner else None


def _child_ref(child: dict[str, Any]) -> ChildRef:
    return ChildRef(str(child.get("kind")), str((child.get("metadata") or {}).get("name")))


def _child_current(child: dict[str, Any] | None, observed: Observed) -> bool:
    """The event's child, if it still exists, is the same object (replaced meanwhile: its own events
    cover it)."""
    meta = (child or {}).get("metadata") or {}
    current = observed.children.get(_child_ref(child or {}))
    return current is None or (current.get("metadata") or {}).get("uid") == meta.get("uid")


def _pod_of(pod: dict[str, Any] | None, im: InferenceModel | None) -> bool:
    """A pod of this model (not one of another model that copied the annotation)."""
    labels = ((pod or {}).get("metadata") or {}).get("labels") or {}
    return im is not None and labels.get("app.kubernetes.io/instance") in (
        im.child_name,
        canary_view_name(im),
    )


def _owned_by(live: dict[str, Any] | None, uid: str | None) -> bool:
    """Whether a live child is the model's with that uid (only those are ever deleted or repaired)."""
    refs = ((live or {}).get("metadata") or {}).get("ownerReferences") or []
    return uid is not None and any(ref.get("uid") == uid for ref in refs)


def _labels_match(obj: dict[str, Any], wanted: dict[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in wanted.items())


def _labelled(obj: dict[str, Any], selector: str) -> bool:
    """Whether obj carries every k=v label of selector (a lister need not filter)."""
    return _labels_match(obj, dict(part.partition("=")[::2] for part in selector.split(",")))
