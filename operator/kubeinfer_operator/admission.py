"""What an InferenceModel's author may put into the pods the operator creates for them.

Two layers:

- Unconditional (the CRD's CEL rules refuse the same with the same message, crds/; spec.py's
  validators call the functions here): every rendered pod stays inside the "restricted" Pod Security
  Standard (volume types, AppArmor annotations), no environment variable changes what the dynamic
  loader or the Python interpreter runs, an `envFrom` source gets a prefix no such name starts with
  (a ConfigMap's keys are unknown at admission), and no server flag the server refuses.
- The cluster administrator's (chart values `admission.*` -> the operator's environment, checked at
  reconcile time since CEL cannot read them; a refusal is the model's InvalidSpec condition): which
  images other than the installation's, which ServiceAccounts and which Secrets (in env, envFrom and
  volumes) a model may use. Default: none.

The Secrets the spec designates itself (`model.credentialsSecretRef`, `engine.apiKeySecretRef`,
`pod.imagePullSecrets`) are not pod-level references and stay allowed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

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

# Variables that make the loader or the interpreter run other code than the image's, with the reason.
# Every LD_* name is refused too (the dynamic loader's own namespace).
LOADER_ENV_PREFIX = "LD_"
LOADER_ENV: dict[str, str] = {
    "PYTHONPATH": "puts modules first on the import path",
    "PYTHONSTARTUP": "runs a file when the interpreter starts interactively",
    "PYTHONHOME": "replaces the standard library",
    "PYTHONINSPECT": "enters an interactive prompt after the script",
    "PYTHONUSERBASE": "adds a user site-packages folder (and its .pth files) to the imports",
    "PYTHONEXECUTABLE": "changes sys.executable (what child processes run)",
    "PYTHONPLATLIBDIR": "changes where the standard library's extension modules come from",
    "PYTHONBREAKPOINT": "imports and calls any callable on breakpoint()",
    "PYTHONWARNINGS": "imports the warning category classes it names",
    "GCONV_PATH": "makes glibc load iconv modules from another folder",
    "BASH_ENV": "runs a file when a shell starts",
    "ENV": "runs a file when a POSIX shell starts",
}
# The operator's management credential (credentials.py): set by the operator only.
RESERVED_ENV = ("KUBEINFER_ADMIN_API_KEY",)
LOADER_ENV_MESSAGE = (
    "pod.env must not set a variable that changes what the loader or interpreter runs "
    "(LD_*, PYTHONPATH, PYTHONSTARTUP, PYTHONHOME, ...) or the operator's KUBEINFER_ADMIN_API_KEY"
)
ENV_FROM_MESSAGE = (
    "pod.envFrom entries need a prefix that no refused variable name starts with "
    "(not LD_, PYTHON..., not empty): the keys of a ConfigMap or Secret are not known at admission"
)

APPARMOR_PREFIX = "container.apparmor.security.beta.kubernetes.io/"
APPARMOR_MESSAGE = (
    "pod.annotations may set AppArmor profiles to runtime/default or localhost/<profile> only "
    "(the restricted Pod Security Standard)"
)

# Server flags the server does not have (it refuses to start), with why.
REFUSED_FLAGS: dict[str, str] = {
    "--trust-remote-code": "the server never runs model code from the hub",
}
REFUSED_FLAGS_MESSAGE = (
    "engine.extraArgs must not contain --trust-remote-code: the server never runs model code from the hub"
)


def _refused_env_name(name: str) -> bool:
    return name.startswith(LOADER_ENV_PREFIX) or name in LOADER_ENV or name in RESERVED_ENV


def _refused_names() -> tuple[str, ...]:
    return (LOADER_ENV_PREFIX, *LOADER_ENV, *RESERVED_ENV)


def env_from_prefix_ok(prefix: Any) -> bool:
    """Whether every name `prefix + key` is allowed, whatever the key: no refused name starts with
    the prefix, and the prefix starts with no refused prefix."""
    if not isinstance(prefix, str) or not prefix:
        return False
    if prefix.startswith(LOADER_ENV_PREFIX):
        return False
    return not any(name.startswith(prefix) for name in _refused_names())


def pod_errors(
    env: Iterable[Mapping[str, Any]],
    env_from: Iterable[Mapping[str, Any]],
    volumes: Iterable[Mapping[str, Any]],
    annotations: Mapping[str, str],
) -> list[str]:
    """The unconditional refusals of spec.pod (the CRD's CEL rules say the same)."""
    errors: list[str] = []
    if any(set(v) - {"name"} - set(RESTRICTED_VOLUME_TYPES) for v in volumes):
        errors.append(VOLUME_TYPES_MESSAGE)
    if any(_refused_env_name(str(e.get("name", ""))) for e in env):
        errors.append(LOADER_ENV_MESSAGE)
    if any(not env_from_prefix_ok(e.get("prefix")) for e in env_from):
        errors.append(ENV_FROM_MESSAGE)
    if any(
        k.startswith(APPARMOR_PREFIX) and v != "runtime/default" and not v.startswith("localhost/")
        for k, v in annotations.items()
    ):
        errors.append(APPARMOR_MESSAGE)
    return errors


# The flags of server/cli.py's parser that the operator does not manage (spec.MANAGED_FLAGS), --help
# left out (it prints and exits, so the pod crash-loops). argparse refuses any other `--` argument
# (an unknown flag, a vLLM-only flag, an abbreviation such as --mod for --model) and the server does
# not start; tests/operator/test_op_server_flags.py keeps this list equal to the parser's.
SERVER_FLAGS: tuple[str, ...] = (
    "--allow-credentials",
    "--allow-special-tokens-in-content",
    "--allowed-headers",
    "--allowed-methods",
    "--allowed-origins",
    "--attention-backend",
    "--batch-wait-ms",
    "--block-size",
    "--chat-template",
    "--device",
    "--distributed-timeout",
    "--enable-auto-tool-choice",
    "--enable-responses-store",
    "--kv-cache-dtype",
    "--kv-cache-memory",
    "--log-level",
    "--logprobs-mode",
    "--long-prefill-token-threshold",
    "--lora-allowed-paths",
    "--max-best-of",
    "--max-input-tokens",
    "--max-lora-rank",
    "--max-num-batched-tokens",
    "--max-payload-bytes",
    "--max-stop-sequences",
    "--max-top-n-tokens",
    "--no-allow-credentials",
    "--no-allow-special-tokens-in-content",
    "--no-enable-auto-tool-choice",
    "--no-enable-responses-store",
    "--no-ui",
    "--num-kv-blocks",
    "--num-threads",
    "--reasoning-parser",
    "--responses-store-max-bytes",
    "--responses-store-max-entries",
    "--responses-store-ttl",
    "--thread-policy",
    "--timeout-request-head",
    "--tool-call-parser",
    "--ui",
)
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
    return errors


# ---------------------------------------------------------------- the cluster administrator's policy

ALLOWED_IMAGES_ENV = "KUBEINFER_ALLOWED_IMAGES"  # image prefixes, comma-separated
ALLOWED_SERVICE_ACCOUNTS_ENV = "KUBEINFER_ALLOWED_SERVICE_ACCOUNTS"  # names, comma-separated; * = any
ALLOWED_SECRETS_ENV = "KUBEINFER_ALLOWED_SECRETS"  # names, comma-separated; * = any


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

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> AdmissionPolicy:
        env = os.environ if env is None else env
        return cls(
            allowed_images=_csv(env.get(ALLOWED_IMAGES_ENV)),
            allowed_service_accounts=_csv(env.get(ALLOWED_SERVICE_ACCOUNTS_ENV)),
            allowed_secrets=_csv(env.get(ALLOWED_SECRETS_ENV)),
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
            f"spec.pod references Secret(s) {', '.join(refused)} in env, envFrom or volumes, which this cluster "
            "does not allow (use model.credentialsSecretRef / engine.apiKeySecretRef, or the administrator "
            "allows them through the chart value admission.allowedSecrets)"
        )
    return errors
