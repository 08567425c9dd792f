"""Runs a built image as a kubelet runs a pod's container, without a container runtime: buildah's storage
for the root filesystem, util-linux for the rest.

What it applies, from a Kubernetes container spec and the image's own config (`buildah inspect`):
- command/args: the container's `command` replaces the image's ENTRYPOINT and its `args` the CMD,
  as Kubernetes does (kubernetes.io "Define a command and arguments for a container", the table of
  the four cases);
- the image's Env, then the container's `env` (plain values only);
- securityContext: runAsUser/runAsGroup (a numeric uid, supplementary groups dropped),
  readOnlyRootFilesystem (the root bind-mounted read-only), allowPrivilegeEscalation false
  (no_new_privs) and a uid other than 0 (so no capabilities, as with capabilities.drop ALL);
- volumes: an emptyDir becomes a fresh folder (mode 0777, as the kubelet makes it), a memory-backed
  one a tmpfs of its sizeLimit; a host folder can be bound (the tests' kubeconfig). Anything else
  raises, so a pod the runner cannot honour is never run differently from how it would be.
- network: a new network namespace with only loopback (the pod's own), or another run's (a second
  container of the same pod), or the host's.
The container's files live in a buildah working container (`buildah from`), removed by `stop()`.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STORAGE = ["--storage-driver", os.environ.get("KUBEINFER_BUILDAH_STORAGE", "vfs")]


def buildah(*args: str, timeout: float = 600) -> str:
    done = subprocess.run(
        ["buildah", *STORAGE, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"buildah {' '.join(args)} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout.strip()


def missing_prerequisite() -> str | None:
    """Why images cannot run here, or None."""
    for tool in ("buildah", "unshare", "nsenter", "setpriv", "chroot", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (CI: .ci/run installs buildah from Debian)"
    if os.geteuid() != 0:
        return "running images needs root (mount and network namespaces)"
    return None


def image_exists(ref: str) -> bool:
    try:
        buildah("inspect", "--type", "image", ref, timeout=60)
    except RuntimeError:
        return False
    return True


def image_config(ref: str) -> dict[str, Any]:
    """The image's OCI config (Env, Entrypoint, Cmd, WorkingDir, User)."""
    return dict(json.loads(buildah("inspect", "--type", "image", ref, timeout=60))["OCIv1"]["config"])


@dataclass(frozen=True)
class Mount:
    """One volumeMount with its volume: kind "emptyDir", "memory" (emptyDir medium Memory) or "bind"."""

    target: str
    kind: str
    source: Path | None = None  # bind only
    size: str | None = None  # memory only, a tmpfs size like 1Gi
    read_only: bool = False


def pod_mounts(pod_spec: dict[str, Any], container: dict[str, Any]) -> list[Mount]:
    """The container's volumeMounts resolved against the pod's volumes; raises ValueError for a volume
    kind this runner does not provide (a PVC, a Secret...)."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    mounts = []
    for m in container.get("volumeMounts", []):
        vol = volumes[m["name"]]
        if set(vol) != {"name", "emptyDir"}:
            raise ValueError(f"volume {vol} is not an emptyDir: the image runner cannot provide it")
        empty = vol["emptyDir"] or {}
        if empty.get("medium") == "Memory":
            mounts.append(Mount(m["mountPath"], "memory", size=empty.get("sizeLimit"), read_only=False))
        else:
            mounts.append(Mount(m["mountPath"], "emptyDir", read_only=bool(m.get("readOnly"))))
    return mounts


def _tmpfs_size(size: str | None) -> str:
    if size is None:
        return ""
    units = {"Ki": "k", "Mi": "m", "Gi": "g"}
    for suffix, unit in units.items():
        if size.endswith(suffix):
            return f",size={size.removesuffix(suffix)}{unit}"
    return f",size={size}"


def _refuse_symlinks(root: Path, target: str) -> None:
    # The mounts are made from the host's view: a symlink in the image (/var/run -> /run) would be
    # followed on the host, outside the container's root.
    path = root
    for part in Path(target).parts[1:]:
        path = path / part
        if path.is_symlink():
            raise ValueError(f"mount target {target}: {path.relative_to(root)} is a symlink in the image")


@dataclass
class Container:
    """A running container; `stop()` ends it and removes its working container."""

    name: str
    proc: subprocess.Popen[bytes]
    working_container: str
    log_path: Path
    scratch: Path
    exit_code: int | None = field(default=None)

    @property
    def netns(self) -> str:
        return f"/proc/{self.proc.pid}/ns/net"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.exit_code = self.proc.returncode
        try:
            buildah("umount", self.working_container, timeout=120)
        finally:
            buildah("rm", self.working_container, timeout=300)
            shutil.rmtree(self.scratch, ignore_errors=True)
        return self.exit_code


def run_container(
    image: str,
    container: dict[str, Any],
    mounts: list[Mount],
    log_path: Path,
    network: str = "new",
    run_as: tuple[int, int] | None = None,
) -> Container:
    """Starts `container` (a Kubernetes container spec: command, args, env, securityContext) from
    `image`. `network`: "new", "host", or another Container's netns path. `run_as` (uid, gid) applies
    when the spec's securityContext sets no user (the pod-level one the caller resolved)."""
    config = image_config(image)
    sc = container.get("securityContext", {})
    uid = sc.get("runAsUser", run_as[0] if run_as else None)
    gid = sc.get("runAsGroup", run_as[1] if run_as else uid)
    if uid is None:  # the image's USER, numeric as our Dockerfiles set it
        uid_s, _, gid_s = (config.get("User") or "0").partition(":")
        uid, gid = int(uid_s), int(gid_s or uid_s)
    command: list[str]
    args: list[str]
    if "command" in container:  # the image's CMD is dropped too
        command, args = list(container["command"]), list(container.get("args", []))
    else:
        command = list(config.get("Entrypoint") or [])
        args = list(container["args"] if "args" in container else config.get("Cmd") or [])
    argv = [*command, *args]
    env = dict(e.split("=", 1) for e in config.get("Env") or [])
    for item in container.get("env", []):
        if "value" not in item:
            raise ValueError(f"env {item['name']}: only plain values are supported by the image runner")
        env[item["name"]] = item["value"]
    workdir = config.get("WorkingDir") or "/"

    name = f"kubeinfer-test-{os.getpid()}-{time.monotonic_ns()}"
    buildah("from", "--pull=never", "--name", name, image, timeout=900)
    root = buildah("mount", name, timeout=300)
    scratch = Path(tempfile.mkdtemp(prefix="oci-run-"))
    lines = ["set -eu", f"R={shlex.quote(root)}", 'mount --bind "$R" "$R"']
    for sub in ("dev", "proc", "sys"):
        os.makedirs(Path(root) / sub, exist_ok=True)
    lines += [
        'mount --rbind /dev "$R/dev"',
        'mount -t proc proc "$R/proc"',
        'mount --rbind -o ro /sys "$R/sys"',
    ]
    for i, m in enumerate(mounts):
        _refuse_symlinks(Path(root), m.target)
        os.makedirs(Path(root) / m.target.lstrip("/"), exist_ok=True)  # as the runtime makes mount points
        target = f'"$R"{shlex.quote(m.target)}'
        if m.kind == "memory":
            lines.append(f"mount -t tmpfs -o mode=1777{_tmpfs_size(m.size)} tmpfs {target}")
            continue
        if m.kind == "emptyDir":
            source = scratch / f"volume-{i}"
            source.mkdir()
            source.chmod(0o777)
        else:
            assert m.source is not None
            source = m.source
        lines.append(f"mount --bind {shlex.quote(str(source))} {target}")
        if m.read_only:
            lines.append(f"mount -o remount,bind,ro {target}")
    if sc.get("readOnlyRootFilesystem"):
        lines.append('mount -o remount,bind,ro "$R"')
    if network == "new":
        lines.append("ip link set lo up")
    nnp = ["--no-new-privs"] if sc.get("allowPrivilegeEscalation") is False else []
    exec_argv = [
        "env",
        "-i",
        *[f"{k}={v}" for k, v in env.items()],
        "setpriv",
        *nnp,
        "chroot",
        f"--userspec={uid}:{gid}",
        f"--groups={gid}",
        root,
        "/bin/sh",
        "-c",
        'cd "$0" && exec "$@"',
        workdir,
        *argv,
    ]
    lines.append("exec " + shlex.join(exec_argv))
    unshare = ["unshare", "--mount", "--propagation", "private", "--fork"]
    if network == "new":
        unshare.insert(1, "--net")
    elif network != "host":
        unshare = ["nsenter", f"--net={network}", "--", *unshare]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*unshare, "sh", "-c", "\n".join(lines)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    run = Container(name, proc, name, log_path, scratch)
    _wait_for_netns(run, network)
    return run


def _wait_for_netns(run: Container, network: str) -> None:
    """Until the process is in its network namespace: a client started earlier would join the host's."""
    host = os.readlink("/proc/self/ns/net")
    want = None if network in ("new", "host") else os.readlink(network)
    deadline = time.monotonic() + 120  # generous: the runtime can be slow to start on a loaded machine
    while time.monotonic() < deadline:
        try:
            now = os.readlink(run.netns)
        except OSError:
            now = None
        if now is not None and (now == want if want else (now == host) == (network == "host")):
            return
        if run.proc.poll() is not None:
            raise RuntimeError(f"container exited at start: {run.log()[-2000:]}")
        time.sleep(0.05)
    run.stop()
    raise RuntimeError("the container's process did not enter its network namespace")


def in_netns(container: Container, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Runs `argv` (a host program) in `container`'s network namespace: a client of the pod's ports."""
    return subprocess.run(
        ["nsenter", f"--net={container.netns}", "--", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
