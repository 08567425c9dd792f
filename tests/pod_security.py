"""The Kubernetes "restricted" Pod Security Standard as one function per control
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, baseline + restricted).
Each rule returns the violations it finds in a pod spec (with its metadata); shared by the operator's
rendered server pod tests and the chart's operator pod tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

Pod = dict[str, Any]


def containers(pod: Pod) -> Iterator[dict[str, Any]]:
    for key in ("containers", "initContainers", "ephemeralContainers"):
        yield from pod.get(key) or []


def ctx(c: dict[str, Any]) -> dict[str, Any]:
    return c.get("securityContext") or {}


def pod_ctx(pod: Pod) -> dict[str, Any]:
    return pod.get("securityContext") or {}


# ---- baseline controls


def host_process(pod: Pod) -> list[str]:
    found = [pod_ctx(pod)] + [ctx(c) for c in containers(pod)]
    return ["hostProcess"] if any((s.get("windowsOptions") or {}).get("hostProcess") for s in found) else []


def host_namespaces(pod: Pod) -> list[str]:
    return [k for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]


def privileged(pod: Pod) -> list[str]:
    return [c["name"] for c in containers(pod) if ctx(c).get("privileged")]


def host_path_volumes(pod: Pod) -> list[str]:
    return [v["name"] for v in pod.get("volumes") or [] if "hostPath" in v]


def host_ports(pod: Pod) -> list[str]:
    return [c["name"] for c in containers(pod) for p in c.get("ports") or [] if p.get("hostPort")]


def apparmor(pod: Pod) -> list[str]:
    allowed = {"RuntimeDefault", "Localhost"}
    found = [pod_ctx(pod)] + [ctx(c) for c in containers(pod)]
    bad = [s for s in found if "appArmorProfile" in s and s["appArmorProfile"].get("type") not in allowed]
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    bad_ann = [
        k
        for k, v in annotations.items()
        if k.startswith("container.apparmor.security.beta.kubernetes.io/")
        and v != "runtime/default"
        and not v.startswith("localhost/")
    ]
    return [str(b) for b in bad] + bad_ann


def selinux(pod: Pod) -> list[str]:
    allowed_types = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
    out = []
    for s in [pod_ctx(pod)] + [ctx(c) for c in containers(pod)]:
        opts = s.get("seLinuxOptions") or {}
        if opts.get("type", "") not in allowed_types or opts.get("user") or opts.get("role"):
            out.append(str(opts))
    return out


def proc_mount(pod: Pod) -> list[str]:
    return [c["name"] for c in containers(pod) if ctx(c).get("procMount", "Default") != "Default"]


def sysctls(pod: Pod) -> list[str]:
    safe = {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
    return [s["name"] for s in pod_ctx(pod).get("sysctls") or [] if s["name"] not in safe]


# ---- restricted controls


def volume_types(pod: Pod) -> list[str]:
    allowed = {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        # image volumes (KEP-4639) are read-only and noexec: restricted since v1.33 (kubernetes PR #130394)
        "image",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
    return [v["name"] for v in pod.get("volumes") or [] if not (set(v) - {"name"}) <= allowed]


def privilege_escalation(pod: Pod) -> list[str]:
    return [c["name"] for c in containers(pod) if ctx(c).get("allowPrivilegeEscalation") is not False]


def run_as_non_root(pod: Pod) -> list[str]:
    pod_level = pod_ctx(pod).get("runAsNonRoot")
    out = []
    for c in containers(pod):
        value = ctx(c).get("runAsNonRoot", pod_level)
        if value is not True:
            out.append(c["name"])
    return out


def run_as_non_root_user(pod: Pod) -> list[str]:
    users = [pod_ctx(pod).get("runAsUser")] + [ctx(c).get("runAsUser") for c in containers(pod)]
    return ["runAsUser=0"] if 0 in users else []


def seccomp(pod: Pod) -> list[str]:
    allowed = {"RuntimeDefault", "Localhost"}
    pod_type = (pod_ctx(pod).get("seccompProfile") or {}).get("type")
    out = []
    for c in containers(pod):
        ctype = (ctx(c).get("seccompProfile") or {}).get("type", pod_type)
        if ctype not in allowed:
            out.append(c["name"])
    if pod_type is not None and pod_type not in allowed:
        out.append("pod")
    return out


def capabilities(pod: Pod) -> list[str]:
    out = []
    for c in containers(pod):
        caps = ctx(c).get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{c['name']}: does not drop ALL")
        extra = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
        if extra:
            out.append(f"{c['name']}: adds {sorted(extra)}")
    return out


RULES: dict[str, Callable[[Pod], list[str]]] = {
    "HostProcess": host_process,
    "Host Namespaces": host_namespaces,
    "Privileged Containers": privileged,
    "HostPath Volumes": host_path_volumes,
    "Host Ports": host_ports,
    "AppArmor": apparmor,
    "SELinux": selinux,
    "/proc Mount Type": proc_mount,
    "Sysctls": sysctls,
    "Volume Types": volume_types,
    "Privilege Escalation": privilege_escalation,
    "Running as Non-root": run_as_non_root,
    "Running as Non-root user": run_as_non_root_user,
    "Seccomp": seccomp,
    "Capabilities": capabilities,
}
