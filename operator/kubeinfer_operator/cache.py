"""The shared model cache (spec.cache.mode Shared), like KubeAI's and NIM's: one PersistentVolumeClaim
per model (created, or adopted through cache.claimName), filled once by a loader Job that runs the
server image's own download code (`python -m server.download`), then mounted read-only by every
replica, which loads the model from it offline.

Pure functions: the claim and Job renderers, the paths the loader writes and the server reads, and
the cache's phase judged from the live claim, Job and loader pods (handlers.py does the I/O).

The loader makes `<cache>/models/<org>--<name>@<revision>` a relative symlink to the hub snapshot it
downloaded (`<cache>/hub/models--org--name/snapshots/<commit>`), so a replica is given a plain local
folder as --model and never consults the hub; adapters likewise under `<cache>/adapters/`.

An s3:// model is always loaded this way (the spec requires cache.mode Shared): the loader downloads
the prefix into `<cache>/s3/<bucket>/<prefix>` (server/download_s3.py, resumable, so a retried pod
continues where the last one stopped) with the credentials of `model.credentialsSecretRef` as the AWS
SDK's variables; the server pods never get them. The loader's failure reason (`download failed:
<Reason>: ...`, e.g. CredentialsRejected) becomes the cache's reason.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from .common import (
    CACHE_DIR,
    TMP_DIR,
    Manifest,
    child_metadata,
    restricted_container_security_context,
    selector_labels,
    service_account_name,
)
from .defaults import ClusterDefaults
from .names import derived_name
from .pods import diagnose
from .spec import S3_OPTIONAL_SECRET_KEYS, S3_SECRET_KEYS, InferenceModel

# Where the replicas mount the shared claim (read-only); the loader mounts it at CACHE_DIR.
SHARED_CACHE_DIR = "/var/cache/kubeinfer-shared"
SHARED_VOLUME = "model-cache"
LOADER_COMPONENT = "cache-loader"
DEFAULT_ACCESS_MODES = ("ReadWriteMany",)
# The Job controller labels its pods with the Job's name (batch.kubernetes.io/job-name since 1.27).
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
# The kubelet's default terminationMessagePath: the loader writes its memory estimate there (JSON).
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
# Requests only: a download is network-bound, but a pod without requests is BestEffort.
LOADER_REQUESTS = {"cpu": "250m", "memory": "512Mi"}


def claim_name(im: InferenceModel) -> str:
    """The cache claim: the adopted one, else `<child>-cache` (a DNS-1123 subdomain)."""
    return im.spec.cache.claim_name or f"{im.child_name}-cache"


def adopts_claim(im: InferenceModel) -> bool:
    return im.spec.cache.claim_name is not None


def _hf_repo(uri: str) -> str | None:
    return uri.removeprefix("hf://") if uri.startswith("hf://") else None


def model_key(im: InferenceModel) -> str:
    """The model's folder under <cache>/models: repo and revision (an S3 bucket and prefix), so a new
    revision never overwrites the folder replicas of the old one are reading."""
    uri = im.spec.model.uri
    if uri.startswith("s3://"):
        # A prefix is one version (a new version: a new prefix), named readably while it fits a file name.
        key = "s3--" + uri.removeprefix("s3://").rstrip("/").replace("/", "--")
        digest = hashlib.sha256(uri.encode()).hexdigest()[:12]
        return key if len(key) <= 200 else f"{key[:180]}-{digest}"
    repo = _hf_repo(uri)
    assert repo is not None  # admission: Shared mode needs an hf:// or s3:// model
    return f"{repo.replace('/', '--')}@{im.spec.model.revision or 'default'}"


def model_path(im: InferenceModel, root: str = SHARED_CACHE_DIR) -> str:
    return f"{root}/models/{model_key(im)}"


def adapter_path(uri: str, root: str = SHARED_CACHE_DIR) -> str | None:
    """An hf:// adapter's folder in the cache (None for pvc:// and image paths: nothing to fetch)."""
    repo = _hf_repo(uri)
    return None if repo is None else f"{root}/adapters/{repo.replace('/', '--')}"


def estimate_args(im: InferenceModel) -> list[str]:
    """The serving flags the loader's memory estimate depends on (server/memory_estimate.py), as the
    server gets them (deployment.server_args), and where the estimate goes: the container's
    termination message, which the operator reads back from the finished pod (loader_estimate)."""
    engine = im.spec.engine
    args = ["--memory-estimate-file", TERMINATION_MESSAGE_PATH, "--dtype", engine.dtype]
    args += ["--device", "cuda" if im.spec.resources.gpu.count > 0 else "cpu"]
    if engine.quantization is not None:
        args += ["--quantize", engine.quantization]
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    if engine.max_num_seqs is not None:
        args += ["--max-num-seqs", str(engine.max_num_seqs)]
    return args + _estimate_extra_args(engine.extra_args)


# The loader's estimate for unchanged flags changed (2: a CPU server counts a GGUF's k-quants at their
# 16-row tiles' bits, not the repacks'): part of the Job's digest, so a model estimated by an older
# loader gets a new, quick Job and its pods the new figure.
ESTIMATE_VERSION = 2


# Flags a user sets through engine.extraArgs that change the estimate (a windowed layer holds one
# step's chunk besides its window; sequences take whole blocks): the loader gets them as the server does.
ESTIMATE_EXTRA_FLAGS = ("--block-size", "--max-num-batched-tokens")


def _estimate_extra_args(extra_args: list[str]) -> list[str]:
    """`--flag=value` or `--flag value` of ESTIMATE_EXTRA_FLAGS in `extra_args`, as `[--flag, value]` pairs."""
    out: list[str] = []
    for i, arg in enumerate(extra_args):
        for flag in ESTIMATE_EXTRA_FLAGS:
            if arg.startswith(flag + "="):
                out += [flag, arg.split("=", 1)[1]]
            elif arg == flag and i + 1 < len(extra_args):
                out += [flag, extra_args[i + 1]]
    return out


def load_digest(im: InferenceModel) -> str:
    """What the loader fetches (model, revision, hub adapters) and the flags its memory estimate reads:
    a new digest means a new Job (a Job's pod template is immutable, so a changed load is a new Job,
    never an edit of the old one; a rerun finds the files in place and only estimates again)."""
    wanted = {
        "model": im.spec.model.uri,
        "revision": im.spec.model.revision,
        "adapters": sorted(a.uri for a in im.spec.adapters if a.uri.startswith("hf://")),
        "estimate": estimate_args(im),
        "estimate_version": ESTIMATE_VERSION,
    }
    return hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:8]


def job_name(im: InferenceModel) -> str:
    """`<child>-load-<digest>`, at most 63 characters (the Job controller puts it in a label)."""
    return derived_name(im.child_name, f"load-{load_digest(im)}")


def loader_labels(im: InferenceModel) -> dict[str, str]:
    return {"app.kubernetes.io/component": LOADER_COMPONENT}


def loader_selector(im: InferenceModel) -> str:
    """Selects this model's loader Jobs (the Job template's labels differ from the server pods')."""
    wanted = {**selector_labels(im), **loader_labels(im)}
    wanted["app.kubernetes.io/name"] = "kubeinfer-cache-loader"
    return ",".join(f"{k}={v}" for k, v in wanted.items())


def _loaderchild_metadata(im: InferenceModel, name: str) -> dict[str, Any]:
    meta = child_metadata(im)
    meta["name"] = name
    meta["labels"] = {
        **meta["labels"],
        "app.kubernetes.io/name": "kubeinfer-cache-loader",
        **loader_labels(im),
    }
    return meta


def render_claim(im: InferenceModel) -> Manifest:
    """The claim the operator creates (never rendered for an adopted claim)."""
    cache = im.spec.cache
    assert cache.size is not None  # admission: Shared without claimName needs a size
    spec: dict[str, Any] = {
        "accessModes": list(cache.access_modes or DEFAULT_ACCESS_MODES),
        "resources": {"requests": {"storage": str(cache.size)}},
        "volumeMode": "Filesystem",
    }
    if cache.storage_class_name is not None:
        spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _loaderchild_metadata(im, claim_name(im)),
        "spec": spec,
    }


def loader_args(im: InferenceModel) -> list[str]:
    """`python -m server.download` arguments: fetch into the cache, link at the paths replicas read."""
    uri = im.spec.model.uri
    repo = uri if uri.startswith("s3://") else _hf_repo(uri)
    assert repo is not None
    args = ["--model", repo, "--cache-dir", CACHE_DIR, "--output", model_path(im, CACHE_DIR)]
    if im.spec.model.revision is not None:
        args += ["--revision", im.spec.model.revision]
    for a in im.spec.adapters:
        path = adapter_path(a.uri, CACHE_DIR)
        repo_a = _hf_repo(a.uri)
        if path is not None and repo_a is not None:
            args += ["--adapter", f"{repo_a}={path}"]
    return args + estimate_args(im)


def render_job(im: InferenceModel, defaults: ClusterDefaults | None = None) -> Manifest:
    """The loader Job: the server image's download entry point with the model's hub token, retried
    `cache.backoffLimit` times; its log (and, on failure, its termination message) shows progress.
    Image and pull secrets default to the installation's (`defaults`), as the model's pods do."""
    spec = im.spec
    defaults = defaults or ClusterDefaults()
    env: list[dict[str, Any]] = [
        {"name": "KUBEINFER_CACHE_DIR", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "HOME", "value": TMP_DIR},
        {"name": "TMPDIR", "value": TMP_DIR},
        # Progress lines as they happen, not when a buffer fills.
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    creds = spec.model.credentials_secret_ref
    if creds is not None and spec.model.uri.startswith("s3://"):
        # The AWS SDK's variables from the Secret's keys of the same names; the endpoint and region
        # optional (a missing required key keeps the pod in CreateContainerConfigError, which
        # judge() reports through pods.diagnose).
        for key in (*S3_SECRET_KEYS, *S3_OPTIONAL_SECRET_KEYS):
            ref: dict[str, Any] = {"name": creds.name, "key": key}
            if key in S3_OPTIONAL_SECRET_KEYS:
                ref["optional"] = True
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    elif creds is not None:
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": creds.name, "key": creds.key}}}
        )
    container: dict[str, Any] = {
        "name": "loader",
        "image": spec.engine.image or defaults.server_image_for(spec.resources.gpu.count),
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-m", "server.download"],
        "args": loader_args(im),
        "env": env,
        "resources": {"requests": dict(LOADER_REQUESTS)},
        "securityContext": restricted_container_security_context(),
        # On success the message is the memory estimate the loader wrote (loader_estimate); on failure,
        # with nothing written, the log's tail, which status.cache.message then quotes.
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": "tmp", "mountPath": TMP_DIR},
            {"name": SHARED_VOLUME, "mountPath": CACHE_DIR},
        ],
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # each failed attempt is a new pod, counted against backoffLimit
        "containers": [container],
        "volumes": [
            {"name": "tmp", "emptyDir": {}},
            {"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": claim_name(im)}},
        ],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "fsGroup": 65532,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
    }
    if spec.scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(spec.scheduling.node_selector)
    if spec.scheduling.tolerations:
        pod_spec["tolerations"] = list(spec.scheduling.tolerations)
    pod_spec["serviceAccountName"] = service_account_name(im)
    pull_secrets = defaults.pull_secrets([r.name for r in spec.pod.image_pull_secrets])
    if pull_secrets:
        pod_spec["imagePullSecrets"] = pull_secrets
    meta = _loaderchild_metadata(im, job_name(im))
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": spec.cache.backoff_limit,
            # No ttlSecondsAfterFinished: the finished Job is the record that the cache is filled.
            "template": {"metadata": {"labels": dict(meta["labels"])}, "spec": pod_spec},
        },
    }


def server_volumes(im: InferenceModel) -> tuple[dict[str, Any], dict[str, Any]]:
    """The replicas' read-only volume and mount of the shared claim."""
    return (
        {
            "name": SHARED_VOLUME,
            "persistentVolumeClaim": {"claimName": claim_name(im), "readOnly": True},
        },
        {"name": SHARED_VOLUME, "mountPath": SHARED_CACHE_DIR, "readOnly": True},
    )


# ---------------------------------------------------------------- the cache's phase


@dataclass(frozen=True)
class LoaderEstimate:
    """The loader's memory estimate for the model under its serving flags (server/memory_estimate.py's
    MemoryEstimate, the fields the operator uses; bytes)."""

    total_bytes: int  # weights + the KV cache allocation + the runtime
    minimum_bytes: int  # weights + one max-model-len sequence's KV + the runtime
    weight_bytes: int  # resident, at the serving dtype or GGUF type
    kv_cache_bytes: int  # the KV cache allocation (--kv-cache-memory)
    file_weight_bytes: int = 0  # the same tensors in the files (0: a loader that did not say)
    format: str = ""  # "safetensors" | "gguf"

    @property
    def runtime_bytes(self) -> int:
        """The process besides weights and KV (the interpreter, torch, the tokenizer, activations)."""
        return max(self.total_bytes - self.weight_bytes - self.kv_cache_bytes, 0)


_ESTIMATE_KEYS = ("total_bytes", "minimum_bytes", "weight_bytes", "kv_cache_bytes")


def parse_estimate(text: str) -> LoaderEstimate | None:
    """The loader's JSON line (MemoryEstimate.to_json), or None when it is not one (an old loader's log
    tail, a negative or non-integer size)."""
    try:
        raw = json.loads(text)
        values = [raw[k] for k in _ESTIMATE_KEYS] + [raw.get("file_weight_bytes", 0)]
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        return None
    fmt = raw.get("source")
    total, minimum, weights, kv, in_files = values
    return LoaderEstimate(
        total, minimum, weights, kv, in_files, fmt if fmt in ("safetensors", "gguf") else ""
    )


def loader_estimate(pods: list[dict[str, Any]]) -> LoaderEstimate | None:
    """The estimate the newest successful loader pod left as its termination message (None: no such pod,
    or a message that is not the estimate's JSON, e.g. a loader image from before the estimate)."""
    best: tuple[str, str] | None = None
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            if term and term.get("exitCode") == 0 and term.get("message"):
                stamp = str(term.get("finishedAt") or "")
                if best is None or stamp >= best[0]:
                    best = (stamp, str(term["message"]))
    return None if best is None else parse_estimate(best[1])


@dataclass(frozen=True)
class CacheState:
    """The cache as observed; `ready` lets the Deployment be created (or updated); `memory`: the loader's
    estimate once Ready (None without one)."""

    phase: str  # Pending | Loading | Ready | Failed
    claim_name: str
    job_name: str | None
    reason: str
    message: str
    memory: LoaderEstimate | None = None

    @property
    def ready(self) -> bool:
        return self.phase == "Ready"


def _condition(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype and cond.get("status") == "True":
            return dict(cond)
    return None


def claim_access_modes(claim: dict[str, Any]) -> list[str]:
    """The modes a bound claim actually has (status), else those it asks for (spec)."""
    return list(
        (claim.get("status") or {}).get("accessModes") or (claim.get("spec") or {}).get("accessModes") or []
    )


def claim_conflict(im: InferenceModel, claim: dict[str, Any]) -> str | None:
    """Why an adopted claim cannot serve this model (None if it can)."""
    modes = claim_access_modes(claim)
    name = claim_name(im)
    if not any(m in ("ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod") for m in modes):
        return f"claim {name} has access modes {modes}: the loader Job cannot write to it"
    if "ReadWriteMany" not in modes and im.spec.max_pods > 1:
        return (
            f"claim {name} has access modes {modes}, which serve one pod, but up to {im.spec.max_pods} "
            "can run at once (replicas or maxReplicas, plus a rollout's maxSurge): replicas on other "
            "nodes would hang on Multi-Attach. Use a ReadWriteMany claim, or one replica with rollout.maxSurge 0"
        )
    return None


# The loader's last line (server/download.py): `download failed: <Reason>: <message>`.
LOADER_REASON = re.compile(r"download failed: ([A-Z][A-Za-z]{2,63}): ")


def loader_reason(words: str) -> str | None:
    """The one-word reason the loader printed last, if it printed one."""
    found = LOADER_REASON.findall(words)
    return found[-1] if found else None


def _last_words(pods: list[dict[str, Any]]) -> str:
    """The newest failed loader pod's termination message (its log tail: FallbackToLogsOnError)."""
    best: tuple[str, str] | None = None
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            if term and term.get("exitCode", 0) != 0:
                stamp = str(term.get("finishedAt") or "")
                text = str(
                    term.get("message")
                    or f"exit code {term.get('exitCode')} ({term.get('reason') or 'Error'})"
                )
                if best is None or stamp >= best[0]:
                    best = (stamp, text)
    if best is None:
        return ""
    text = " ".join(best[1].split())
    return text if len(text) <= 512 else "..." + text[-509:]


def judge(
    im: InferenceModel,
    claim: dict[str, Any] | None,
    job: dict[str, Any] | None,
    pods: list[dict[str, Any]] | None = None,
) -> CacheState:
    """The cache's phase from the live claim (None: missing), the current loader Job (None: not created
    yet) and that Job's pods: Failed with the Job's reason and the last pod's words, Loading with a
    pod problem (an unbound claim, a missing Secret) if there is one."""
    name = claim_name(im)
    jname = job_name(im)
    if claim is None:
        if adopts_claim(im):
            return CacheState("Pending", name, None, "ClaimNotFound", f"claim {name} does not exist")
        return CacheState("Pending", name, None, "ClaimPending", f"claim {name} is being created")
    if adopts_claim(im):
        conflict = claim_conflict(im, claim)
        if conflict is not None:
            return CacheState("Failed", name, None, "AccessModeConflict", conflict)
    if job is None:
        return CacheState("Pending", name, jname, "LoaderPending", f"loader Job {jname} is being created")
    if _condition(job, "Complete") is not None:
        return CacheState(
            "Ready",
            name,
            jname,
            "Loaded",
            f"loader Job {jname} filled claim {name}",
            loader_estimate(pods or []),
        )
    failed = _condition(job, "Failed")
    if failed is not None:
        detail = str(failed.get("message") or "the loader Job failed")
        words = _last_words(pods or [])
        # The loader's own reason (CredentialsRejected, NoObjects, ...) says more than BackoffLimitExceeded.
        reason = loader_reason(words) or str(failed.get("reason") or "JobFailed")
        message = f"loader Job {jname}: {detail}" + (f"; last attempt: {words}" if words else "")
        return CacheState("Failed", name, jname, reason, message)
    problem = diagnose(pods or [])
    status = job.get("status") or {}
    attempts = int(status.get("failed") or 0)
    message = f"loader Job {jname} is downloading {im.spec.model.uri}"
    if attempts:
        message += f" (attempt {attempts + 1} of {im.spec.cache.backoff_limit + 1})"
        # While the Job retries, why the last attempt failed (bad credentials show before the last try).
        words = _last_words(pods or [])
        if words:
            message += f"; last attempt: {words}"
    if problem is not None:
        return CacheState("Loading", name, jname, problem.reason, f"{message}; {problem.message}")
    return CacheState("Loading", name, jname, "Loading", message)
