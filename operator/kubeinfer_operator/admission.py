"""What an InferenceModel's author may put into the pods the operator creates for them.

Two layers:

- Unconditional (the CRD's CEL rules refuse the same with the same message, crds/; spec.py's
  validators call the functions here): every rendered pod stays inside the "restricted" Pod Security
  Standard (volume types, AppArmor annotations), no environment variable changes what the dynamic
  loader or the Python interpreter runs, an `envFrom` source gets a prefix no such name starts with
  (a ConfigMap's keys are unknown at admission), and no server flag the server refuses.
- The cluster administrator's (chart values `admission.*` -> the operator's environment, checked at
  reconcile time since CEL cannot read them; a refusal is the model's InvalidSpec condition): which
  images other than the installation's, which ServiceAccounts and which Secrets (anywhere in the
  spec) a model may use. Default: none.

Every Secret the spec names goes through the Secret policy, the ones it designates itself
(`model.credentialsSecretRef`, `engine.apiKeySecretRef`, `pod.imagePullSecrets`) too: whoever may
create an InferenceModel must not get any Secret of the namespace into pods that send it to a host
(policy.SECRET_REF_FIELDS lists the places).
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .server_args import SERVER_FLAG_TABLE, argument_errors

# The restricted standard's volume types (https://kubernetes.io/docs/concepts/security/pod-security-standards/).
RESTRICTED_VOLUME_TYPES = (
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
)
# Every other core/v1 VolumeSource (the CRD's CEL rule names them: CEL sees declared fields only).
OTHER_VOLUME_TYPES = (
    "hostPath",
    "gcePersistentDisk",
    "awsElasticBlockStore",
    "gitRepo",
    "nfs",
    "iscsi",
    "glusterfs",
    "rbd",
    "flexVolume",
    "cinder",
    "cephfs",
    "flocker",
    "fc",
    "azureFile",
    "vsphereVolume",
    "quobyte",
    "azureDisk",
    "photonPersistentDisk",
    "portworxVolume",
    "scaleIO",
    "storageos",
    "image",
)
VOLUME_TYPES_MESSAGE = (
    "pod.volumes may only use the volume types of the restricted Pod Security Standard "
    "(configMap, csi, downwardAPI, emptyDir, ephemeral, persistentVolumeClaim, projected, secret)"
)

# Variables refused in pod.env (and, through the envFrom prefix rule, from ConfigMaps and Secrets),
# with why. Three kinds: what the loader or the interpreter runs (LD_PRELOAD's kind), where the
# server connects and which certificates it trusts (a hub token sent to another host: issue 45), and
# the server's own flags' variables (a flag set there would bypass the engine.extraArgs checks; they
# are set through engine.extraArgs or the spec's fields).
# Families: every name starting with one of these.
REFUSED_ENV_PREFIXES: dict[str, str] = {
    "LD_": "the dynamic loader's own namespace (LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT, ...)",
    "PYTHON": "the interpreter's settings: import path, startup files, caches, hooks (SAFE_PYTHON_ENV aside)",
    "HF_HUB_": "the hub client's settings (endpoint, TLS, offline mode, ...)",
    "HUGGINGFACE_": "the hub client's older names (cache folders, endpoint)",
    "SSL_CERT_": "which certificate authorities OpenSSL trusts",
    "TRITON_": "Triton's compiler and kernel cache (code the server runs on GPUs)",
    "TORCHINDUCTOR_": "torch.compile's code cache",
}
# PYTHON* names that change no code the interpreter loads nor where it writes any.
SAFE_PYTHON_ENV = (
    "PYTHONUNBUFFERED",
    "PYTHONFAULTHANDLER",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONIOENCODING",
    "PYTHONUTF8",
)
# Single names.
REFUSED_ENV_NAMES: dict[str, str] = {
    "GCONV_PATH": "makes glibc load iconv modules from another folder",
    "GLIBC_TUNABLES": "changes the C library's behaviour (and has had loader exploits)",
    "LOCPATH": "makes glibc load locale data from another folder",
    "BASH_ENV": "runs a file when a shell starts",
    "ENV": "runs a file when a POSIX shell starts",
    "HF_ENDPOINT": "the hub's address: the hub token would go to that host",
    "REQUESTS_CA_BUNDLE": "the certificate authorities requests trusts",
    "CURL_CA_BUNDLE": "the certificate authorities curl and requests trust",
}
# `<scheme>_proxy` in any case (curl, requests and urllib read any case): all of them redirect.
PROXY_SUFFIX = "_proxy"
# The proxy variables that connections of the server use (an envFrom prefix must not start them).
PROXY_NAMES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
# Every variable server/cli.py's parser reads (its `[env: NAME]`s);
# tests/operator/test_op_server_flags.py keeps this list equal to the parser's (the operator's image
# has no server package).
SERVER_ENV: tuple[str, ...] = (
    "API_KEY",
    "DTYPE",
    "ENABLE_LORA",
    "ENABLE_PREFIX_CACHING",
    "KUBEINFER_ADMIN_API_KEY",
    "KUBEINFER_ALLOWED_HEADERS",
    "KUBEINFER_ALLOWED_METHODS",
    "KUBEINFER_ALLOWED_ORIGINS",
    "KUBEINFER_ALLOW_CREDENTIALS",
    "KUBEINFER_ALLOW_SPECIAL_TOKENS_IN_CONTENT",
    "KUBEINFER_ATTENTION_BACKEND",
    "KUBEINFER_BATCH_WAIT_MS",
    "KUBEINFER_BLOCK_SIZE",
    "KUBEINFER_BURST_ITL_FACTOR",
    "KUBEINFER_BURST_ITL_SECONDS",
    "KUBEINFER_CACHE_DIR",
    "KUBEINFER_CHAT_TEMPLATE",
    "KUBEINFER_DEVICE",
    "KUBEINFER_DISTRIBUTED_TIMEOUT",
    "KUBEINFER_DRAIN_TIMEOUT",
    "KUBEINFER_ENABLE_AUTO_TOOL_CHOICE",
    "KUBEINFER_ENABLE_RESPONSES_STORE",
    "KUBEINFER_HOST",
    "KUBEINFER_KV_CACHE_DTYPE",
    "KUBEINFER_KV_CACHE_MEMORY",
    "KUBEINFER_KV_EVENTS_CONFIG",
    "KUBEINFER_LIMIT_CONCURRENCY",
    "KUBEINFER_LIMIT_CONCURRENCY_PER_CLIENT",
    "KUBEINFER_LOGPROBS_MODE",
    "KUBEINFER_LONG_PREFILL_TOKEN_THRESHOLD",
    "KUBEINFER_MAX_NUM_BATCHED_TOKENS",
    "KUBEINFER_MAX_NUM_SEQS",
    "KUBEINFER_NUM_KV_BLOCKS",
    "KUBEINFER_NUM_THREADS",
    "KUBEINFER_OBJECTIVE_PRIORITY",
    "KUBEINFER_POOLING_STEP_TOKENS",
    "KUBEINFER_PREFILL_ITL_FACTOR",
    "KUBEINFER_PREFILL_ITL_MIN_TOKENS",
    "KUBEINFER_REASONING_PARSER",
    "KUBEINFER_RESPONSES_STORE_MAX_BYTES",
    "KUBEINFER_RESPONSES_STORE_MAX_ENTRIES",
    "KUBEINFER_RESPONSES_STORE_TTL",
    "KUBEINFER_SCHEDULING_POLICY",
    "KUBEINFER_SPECULATIVE_CONFIG",
    "KUBEINFER_TASK",
    "KUBEINFER_THREAD_POLICY",
    "KUBEINFER_TIMEOUT_REQUEST_BODY",
    "KUBEINFER_TIMEOUT_REQUEST_HEAD",
    "KUBEINFER_TOOL_CALL_PARSER",
    "KUBEINFER_UI",
    "LOG_FORMAT",
    "LOG_LEVEL",
    "LORA_ALLOWED_PATHS",
    "LWS_GROUP_SIZE",
    "LWS_LEADER_ADDRESS",
    "LWS_WORKER_INDEX",
    "MASTER_PORT",
    "MAX_BEST_OF",
    "MAX_CONCURRENT_REQUESTS",
    "MAX_CPU_LORAS",
    "MAX_INPUT_TOKENS",
    "MAX_LORAS",
    "MAX_LORA_RANK",
    "MAX_STOP_SEQUENCES",
    "MAX_TOP_N_TOKENS",
    "MAX_TOTAL_TOKENS",
    "MODEL_ID",
    "PAYLOAD_LIMIT",
    "PORT",
    "QUANTIZE",
    "SERVED_MODEL_NAME",
    "TENSOR_PARALLEL_SIZE",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
)
LOADER_ENV_MESSAGE = (
    "pod.env must not set a variable that changes what the loader or interpreter runs, where the server "
    "connects or which certificates it trusts, or a server flag's variable (LD_*, PYTHON*, HF_ENDPOINT, "
    "HF_HUB_*, *_PROXY, SSL_CERT_*, REQUESTS_CA_BUNDLE, GLIBC_TUNABLES, KUBEINFER_ADMIN_API_KEY, ...; "
    "server flags go in engine.extraArgs)"
)
ENV_FROM_MESSAGE = (
    "pod.envFrom entries need a prefix that no refused variable name starts with "
    "(not LD_, PYTHON..., HF_, HTTP..., not empty): the keys of a ConfigMap or Secret are not known at admission"
)


def _any_prefix_of(name: str) -> str:
    """A regex matching every non-empty prefix of `name`: `a(b(c)?)?` for "abc"."""
    return name[0] + "".join(f"({c}" for c in name[1:]) + ")?" * (len(name) - 1)


# RE2 (the CRD's CEL `matches`) and Python's re read these the same way.
REFUSED_ENV_FAMILY_RE = "^(" + "|".join(REFUSED_ENV_PREFIXES) + ")"
PROXY_RE = "(?i:_proxy)$"
# an envFrom prefix that any case of a proxy variable starts with
PROXY_PREFIX_RE = "^(?i:" + "|".join(_any_prefix_of(n) for n in PROXY_NAMES) + ")$"
# The CRD's bound of an envFrom prefix (its CEL rule's cost grows with it); spec.py says the same.
ENV_FROM_PREFIX_MAX = 64


def _refused_exact() -> tuple[str, ...]:
    return tuple(dict.fromkeys((*REFUSED_ENV_NAMES, *SERVER_ENV)))


# Where pod.volumeMounts may mount: folders of the image that hold no code (the interpreter, the
# server, its kernels), no certificate store and no model cache (issue 45 item 2: a ConfigMap over
# sitecustomize.py, a claim over the kernel cache). A path is taken as the kubelet resolves it:
# normalised, so `/models/` and `/data/../usr` count as what they name; `..` is refused outright.
ALLOWED_MOUNT_ROOTS = ("/data", "/mnt")
MOUNT_PATH_RE = "^/(data|mnt)(/|$)"
MOUNT_PATH_MESSAGE = (
    "pod.volumeMounts paths must be absolute, without '..', under /data or /mnt "
    "(other folders hold the server's code, kernels, certificates or model cache)"
)


def mount_path_ok(path: Any) -> bool:
    """Whether a pod.volumeMounts mountPath lies under ALLOWED_MOUNT_ROOTS once normalised."""
    if not isinstance(path, str) or not path.startswith("/") or ".." in path.split("/"):
        return False
    normal = posixpath.normpath(path)
    return any(normal == root or normal.startswith(root + "/") for root in ALLOWED_MOUNT_ROOTS)


APPARMOR_PREFIX = "container.apparmor.security.beta.kubernetes.io/"
APPARMOR_MESSAGE = (
    "pod.annotations may set AppArmor profiles to runtime/default or localhost/<profile> only "
    "(the restricted Pod Security Standard)"
)

# Annotations the API server refuses on the pod template, or that would weaken the pod: the legacy
# seccomp annotations (removed in Kubernetes 1.27; the API server refuses one that disagrees with the
# pod's seccompProfile field, RuntimeDefault here, so the Deployment is refused), AppArmor for a container
# the pod does not have ("container not found"), and the kubelet's own `kubernetes.io/config.*` (a
# mirror-pod marker). Keys must be qualified names, and the total size at most 256 KiB.
LEGACY_SECCOMP_PREFIXES = (
    "seccomp.security.alpha.kubernetes.io/",
    "container.seccomp.security.alpha.kubernetes.io/",
)
KUBELET_ANNOTATION_PREFIX = "kubernetes.io/config."
ANNOTATIONS_MESSAGE = (
    "pod.annotations must not set the legacy seccomp annotations (the pod's seccompProfile is "
    "RuntimeDefault), kubernetes.io/config.*, or AppArmor for a container other than the server's"
)
APPARMOR_SERVER_KEY = APPARMOR_PREFIX + "server"  # common.CONTAINER_NAME (a lower layer cannot import it)
MAX_ANNOTATIONS_BYTES = 256 * 1024  # ValidateAnnotationsSize (TotalAnnotationSizeLimitB)

# Server flags the server does not have (it refuses to start), with why.
REFUSED_FLAGS: dict[str, str] = {
    "--trust-remote-code": "the server never runs model code from the hub",
}
REFUSED_FLAGS_MESSAGE = (
    "engine.extraArgs must not contain --trust-remote-code: the server never runs model code from the hub"
)


def refused_env_name(name: str) -> bool:
    """Whether pod.env may not set `name` (REFUSED_ENV_PREFIXES, REFUSED_ENV_NAMES, *_PROXY, SERVER_ENV)."""
    if re.match(REFUSED_ENV_FAMILY_RE, name) and name not in SAFE_PYTHON_ENV:
        return True
    return name in _refused_exact() or re.search(PROXY_RE, name) is not None


def env_from_prefix_ok(prefix: Any) -> bool:
    """Whether every name `prefix + key` is allowed, whatever the key: the prefix starts with no
    refused family, no refused name or family starts with the prefix, and no proxy variable (any
    case) does. `APP_` + `HTTPS_PROXY` is `APP_HTTPS_PROXY`: a proxy for the scheme `app_https`,
    which no connection of the server uses."""
    if not isinstance(prefix, str) or not prefix:
        return False
    if re.match(REFUSED_ENV_FAMILY_RE, prefix) or re.match(PROXY_PREFIX_RE, prefix):
        return False
    return not any(n.startswith(prefix) for n in (*REFUSED_ENV_PREFIXES, *_refused_exact()))


def pod_errors(
    env: Iterable[Mapping[str, Any]],
    env_from: Iterable[Mapping[str, Any]],
    volumes: Iterable[Mapping[str, Any]],
    annotations: Mapping[str, str],
    volume_mounts: Iterable[Mapping[str, Any]] = (),
) -> list[str]:
    """The unconditional refusals of spec.pod (the CRD's CEL rules say the same)."""
    errors: list[str] = []
    if any(not mount_path_ok(m.get("mountPath")) for m in volume_mounts):
        errors.append(MOUNT_PATH_MESSAGE)
    if any(set(v) - {"name"} - set(RESTRICTED_VOLUME_TYPES) for v in volumes):
        errors.append(VOLUME_TYPES_MESSAGE)
    if any(refused_env_name(str(e.get("name", ""))) for e in env):
        errors.append(LOADER_ENV_MESSAGE)
    if any(not env_from_prefix_ok(e.get("prefix")) for e in env_from):
        errors.append(ENV_FROM_MESSAGE)
    if any(
        k.startswith(APPARMOR_PREFIX) and v != "runtime/default" and not v.startswith("localhost/")
        for k, v in annotations.items()
    ):
        errors.append(APPARMOR_MESSAGE)
    errors += annotation_errors(annotations)
    return errors


def annotation_errors(annotations: Mapping[str, str]) -> list[str]:
    """Pod template annotations the API server refuses, or that weaken the pod (see ANNOTATIONS_MESSAGE)."""
    errors: list[str] = []
    if any(
        k.startswith((*LEGACY_SECCOMP_PREFIXES, KUBELET_ANNOTATION_PREFIX))
        or (k.startswith(APPARMOR_PREFIX) and k != APPARMOR_SERVER_KEY)
        for k in annotations
    ):
        errors.append(ANNOTATIONS_MESSAGE)
    if sum(len(k) + len(v) for k, v in annotations.items()) > MAX_ANNOTATIONS_BYTES:
        errors.append("pod.annotations must not exceed 256 KiB in all (keys and values)")
    return errors


# The flags of server/cli.py's parser that the operator does not manage (spec.MANAGED_FLAGS), --help
# left out (it prints and exits, so the pod crash-loops): server_args.SERVER_FLAG_TABLE's keys. argparse
# refuses any other `--` argument (an unknown flag, a vLLM-only flag, an abbreviation such as --mod for
# --model) and the server does not start; tests/operator/test_op_server_flags.py keeps this list equal
# to the parser's, and test_op_server_args.py the table's arities, kinds and choices.
SERVER_FLAGS: tuple[str, ...] = tuple(SERVER_FLAG_TABLE)
EXTRA_ARGS_MESSAGE = "engine.extraArgs would stop the server at start (its argument parser refuses them)"
UNKNOWN_FLAG_MESSAGE = (
    "engine.extraArgs may contain only flags of the server that the operator does not manage "
    "(see docs/operator.md); the server refuses any other and does not start"
)


def unknown_flags(extra_args: Iterable[str]) -> list[str]:
    """The extraArgs entries that are flags (start with `--`) the server does not accept: only an
    entry starting with `--` is a flag; others are values (`["--block-size", "32"]`)."""
    return [a for a in extra_args if a.startswith("--") and a.split("=", 1)[0] not in SERVER_FLAGS]


def extra_args_errors(extra_args: Iterable[str]) -> list[str]:
    """The refusals of spec.engine.extraArgs beyond the managed flags (the CRD's CEL rules say the
    same; the unknown-flag message names the flags here, the CEL one cannot)."""
    args = list(extra_args)
    errors: list[str] = []
    if any(a.split("=", 1)[0] in REFUSED_FLAGS for a in args):
        errors.append(REFUSED_FLAGS_MESSAGE)
    # names only (a value may be long or secret), each at most 64 characters
    unknown = dict.fromkeys(a.split("=", 1)[0][:64] for a in unknown_flags(args))
    if unknown:
        errors.append(f"{UNKNOWN_FLAG_MESSAGE}: {', '.join(unknown)}")
    # The list as a whole, as the server's parser reads it: stray arguments, short options (-h),
    # missing values, values a switch cannot take, bad values and choices.
    problems = argument_errors(args)
    if problems:
        errors.append(f"{EXTRA_ARGS_MESSAGE}: {'; '.join(problems)}")
    return errors


# ---------------------------------------------------------------- the cluster administrator's policy

ALLOWED_IMAGES_ENV = "KUBEINFER_ALLOWED_IMAGES"  # image prefixes, comma-separated
ALLOWED_SERVICE_ACCOUNTS_ENV = "KUBEINFER_ALLOWED_SERVICE_ACCOUNTS"  # names, comma-separated; * = any
ALLOWED_SECRETS_ENV = "KUBEINFER_ALLOWED_SECRETS"  # names, comma-separated; * = any
ALLOWED_PRIORITY_CLASSES_ENV = "KUBEINFER_ALLOWED_PRIORITY_CLASSES"  # system-* names, comma-separated
ALLOWED_CSI_DRIVERS_ENV = "KUBEINFER_ALLOWED_CSI_DRIVERS"  # inline csi volume drivers, comma-separated
ALLOWED_TOKEN_AUDIENCES_ENV = "KUBEINFER_ALLOWED_TOKEN_AUDIENCES"  # projected token audiences
CONTROL_PLANE_ENV = "KUBEINFER_ALLOW_CONTROL_PLANE_SCHEDULING"  # true: tolerate-all, control-plane nodes

# Kubernetes' own priority classes (scheduling/v1): pods in them preempt everything else.
SYSTEM_PRIORITY_PREFIX = "system-"
# Node labels and taint keys of control-plane nodes (kubeadm's; `master` before Kubernetes 1.24).
CONTROL_PLANE_KEYS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")


def _csv(value: str | None) -> tuple[str, ...]:
    return tuple(dict.fromkeys(s.strip() for s in (value or "").split(",") if s.strip()))


@dataclass(frozen=True)
class AdmissionPolicy:
    """What the cluster administrator allows beyond the defaults (chart values `admission.*`).

    allowed_images: prefixes (`registry.example.com/team/`, or a full reference) an engine.image or
    routing.image may start with; the installation's own images are always allowed.
    allowed_service_accounts / allowed_secrets: names, or "*" for any."""

    allowed_images: tuple[str, ...] = ()
    allowed_service_accounts: tuple[str, ...] = ()
    allowed_secrets: tuple[str, ...] = ()
    # system-node-critical / system-cluster-critical (names) a model may use
    allowed_priority_classes: tuple[str, ...] = ()
    # tolerate-all tolerations and control-plane node selectors, tolerations and affinity
    allow_control_plane_scheduling: bool = False
    # inline `csi` volumes (e.g. secrets-store.csi.k8s.io) by driver name
    allowed_csi_drivers: tuple[str, ...] = ()
    # `projected` serviceAccountToken sources by audience ("" = the API server's own audience)
    allowed_token_audiences: tuple[str, ...] = ()

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> AdmissionPolicy:
        env = os.environ if env is None else env
        return cls(
            allowed_images=_csv(env.get(ALLOWED_IMAGES_ENV)),
            allowed_service_accounts=_csv(env.get(ALLOWED_SERVICE_ACCOUNTS_ENV)),
            allowed_secrets=_csv(env.get(ALLOWED_SECRETS_ENV)),
            allowed_priority_classes=_csv(env.get(ALLOWED_PRIORITY_CLASSES_ENV)),
            allow_control_plane_scheduling=(env.get(CONTROL_PLANE_ENV) or "").strip().lower() == "true",
            allowed_csi_drivers=_csv(env.get(ALLOWED_CSI_DRIVERS_ENV)),
            allowed_token_audiences=_csv(env.get(ALLOWED_TOKEN_AUDIENCES_ENV)),
        )

    def image_allowed(self, image: str, defaults: Iterable[str]) -> bool:
        return image in defaults or any(image.startswith(p) for p in self.allowed_images)

    def service_account_allowed(self, name: str) -> bool:
        return "*" in self.allowed_service_accounts or name in self.allowed_service_accounts

    def secret_allowed(self, name: str) -> bool:
        return "*" in self.allowed_secrets or name in self.allowed_secrets


def pod_secret_names(
    env: Iterable[Mapping[str, Any]],
    env_from: Iterable[Mapping[str, Any]],
    volumes: Iterable[Mapping[str, Any]],
) -> list[str]:
    """Secrets that spec.pod's env, envFrom and volumes reference, in order, each once."""
    names: list[Any] = []
    for e in env:
        ref = ((e.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
        names.append(ref)
    for e in env_from:
        names.append((e.get("secretRef") or {}).get("name"))
    for v in volumes:
        names.append((v.get("secret") or {}).get("secretName"))
        for source in (v.get("projected") or {}).get("sources") or []:
            names.append((source.get("secret") or {}).get("name"))
    return list(dict.fromkeys(str(n) for n in names if n))


def credential_volume_errors(policy: AdmissionPolicy, volumes: Iterable[Mapping[str, Any]]) -> list[str]:
    """The administrator's refusals of volumes that bring credentials past the Secret policy: inline
    `csi` volumes (the secrets-store driver mounts a cloud secret store's entries) and `projected`
    service-account tokens (a token of the pod's ServiceAccount for any audience, although the pod
    sets automountServiceAccountToken: false)."""
    errors: list[str] = []
    for v in volumes:
        name = str(v.get("name", ""))[:63]
        driver = (v.get("csi") or {}).get("driver")
        if "csi" in v and driver not in policy.allowed_csi_drivers:
            errors.append(
                f"pod.volumes {name!r}: the csi driver {str(driver)[:253]!r} is not allowed in this cluster "
                "(the administrator allows inline csi volumes through the chart value admission.allowedCSIDrivers)"
            )
        for source in (v.get("projected") or {}).get("sources") or []:
            token = source.get("serviceAccountToken")
            if token is None:
                continue
            audience = str(token.get("audience") or "")
            if audience not in policy.allowed_token_audiences:
                errors.append(
                    f"pod.volumes {name!r}: a service-account token for the audience {audience[:253]!r} is not "
                    "allowed in this cluster (the pods get no API credentials; the administrator allows "
                    "audiences through the chart value admission.allowedTokenAudiences)"
                )
    return errors


def _mentions_control_plane(value: Any) -> bool:
    """Whether a node selector, toleration or affinity names a control-plane label or taint key."""
    if isinstance(value, str):
        return value in CONTROL_PLANE_KEYS
    if isinstance(value, Mapping):
        if value.get("key") in CONTROL_PLANE_KEYS and value.get("operator") in ("DoesNotExist", "NotIn"):
            return False  # keeps the pods off those nodes
        return any(_mentions_control_plane(k) or _mentions_control_plane(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_mentions_control_plane(v) for v in value)
    return False


def scheduling_errors(
    policy: AdmissionPolicy,
    *,
    priority_class: str | None,
    tolerations: Iterable[Mapping[str, Any]],
    node_selector: Mapping[str, str],
    affinity: Mapping[str, Any] | None,
) -> list[str]:
    """The administrator's refusals of spec.scheduling: Kubernetes' system priority classes (they
    preempt the cluster's own components), a toleration of every taint (`operator: Exists` without a
    key) and any use of the control-plane nodes."""
    errors: list[str] = []
    if (
        priority_class is not None
        and priority_class.startswith(SYSTEM_PRIORITY_PREFIX)
        and priority_class not in policy.allowed_priority_classes
    ):
        errors.append(
            f"scheduling.priorityClassName {priority_class!r} is not allowed in this cluster (the administrator "
            "allows system priority classes through the chart value admission.allowedPriorityClasses)"
        )
    tolerations = list(tolerations)
    tolerate_all = any(t.get("operator") == "Exists" and not t.get("key") for t in tolerations)
    control_plane = _mentions_control_plane(
        [dict(node_selector), dict(affinity or {}), [t.get("key") for t in tolerations]]
    )
    if (tolerate_all or control_plane) and not policy.allow_control_plane_scheduling:
        errors.append(
            "scheduling must not tolerate every taint (operator Exists without a key) nor select, tolerate or "
            "prefer control-plane nodes (node-role.kubernetes.io/control-plane) in this cluster (the "
            "administrator allows it through the chart value admission.allowControlPlaneScheduling)"
        )
    return errors


def policy_errors(
    policy: AdmissionPolicy,
    *,
    images: Iterable[str],
    default_images: Iterable[str],
    service_account: str | None,
    secrets: Iterable[str],
) -> list[str]:
    """The administrator's refusals of a model, each naming the chart value that would allow it."""
    defaults = tuple(default_images)
    errors = [
        f"image {image!r} is not allowed in this cluster (the administrator allows other images "
        f"through the chart value admission.allowedImages)"
        for image in images
        if not policy.image_allowed(image, defaults)
    ]
    if service_account is not None and not policy.service_account_allowed(service_account):
        errors.append(
            f"pod.serviceAccountName {service_account!r} is not allowed in this cluster (the administrator "
            "allows ServiceAccounts through the chart value admission.allowedServiceAccounts)"
        )
    refused = [s for s in secrets if not policy.secret_allowed(s)]
    if refused:
        errors.append(
            f"the spec references Secret(s) {', '.join(refused)}, which this cluster does not allow "
            "(the administrator allows Secrets by name through the chart value admission.allowedSecrets; "
            "every reference counts: credentialsSecretRef, apiKeySecretRef, imagePullSecrets, pod.env, "
            "pod.envFrom, pod.volumes)"
        )
    return errors
