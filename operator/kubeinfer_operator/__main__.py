"""`python -m kubeinfer_operator render -f model.yaml` and `python -m kubeinfer_operator run`."""

from __future__ import annotations

import argparse
import contextlib
import http.server
import logging
import os
import signal
import socket
import sys
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import yaml

from . import credentials
from .defaults import ClusterDefaults
from .leader import LeaderElectionConfig, LeaderElector, parse_duration
from .render import Capabilities, child_metadata, render_all
from .spec import InferenceModel, InvalidSpecError, semantic_errors


def render_documents(manifests: list[dict[str, Any]], caps: Capabilities) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for manifest in manifests:
        im = InferenceModel.from_manifest(manifest)
        problems = semantic_errors(im.spec)
        if problems:
            raise InvalidSpecError(f"{im.namespace}/{im.name}: " + "; ".join(problems))
        if credentials.wants_admin_key(im):  # the Secret its pods read their admin key from
            out.append(credentials.render_admin_secret(im, child_metadata(im), caps.defaults))
        out.extend(render_all(im, caps).objects)
    return out


def _render(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    if args.file == "-":
        text = sys.stdin.read()
    else:
        with open(args.file, encoding="utf-8") as fh:
            text = fh.read()
    manifests = [doc for doc in yaml.safe_load_all(text) if doc]
    try:
        # The operator's installation defaults (default images, pull secrets) apply here too.
        defaults = ClusterDefaults.from_environment(os.environ)
        caps = Capabilities(service_monitor=not args.no_service_monitor, keda=True, defaults=defaults)
        objects = render_documents(manifests, caps)
    except (InvalidSpecError, ValueError) as exc:
        print(f"error: {exc}", file=stderr)
        return 1
    yaml.safe_dump_all(objects, stdout, sort_keys=False)
    return 0


# Exit status when leadership is lost (controller-runtime exits too): the pod restarts as a candidate.
LEASE_LOST_EXIT_CODE = 1
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
log = logging.getLogger("kubeinfer_operator")


def _exit_on_lost() -> None:
    """Stop at once: a graceful kopf shutdown would let running handlers write after another replica
    may already lead."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(LEASE_LOST_EXIT_CODE)


def _lease_namespace(args: argparse.Namespace) -> str:
    if args.leader_elect_resource_namespace:
        return str(args.leader_elect_resource_namespace)
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        raise ValueError(
            "--leader-elect-resource-namespace is needed outside a cluster (or set POD_NAMESPACE)"
        ) from None


def leader_election_config(args: argparse.Namespace) -> LeaderElectionConfig:
    """From the `run` flags; raises ValueError for a bad duration, name or timing."""
    identity = args.leader_elect_identity or (
        f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4()}"
    )
    return LeaderElectionConfig(
        lease_name=args.leader_elect_resource_name,
        namespace=_lease_namespace(args),
        identity=identity,
        lease_duration=parse_duration(args.leader_elect_lease_duration),
        renew_deadline=parse_duration(args.leader_elect_renew_deadline),
        retry_period=parse_duration(args.leader_elect_retry_period),
        release_on_cancel=args.leader_elect_release_on_cancel,
    )


class _Healthz(http.server.BaseHTTPRequestHandler):
    path_ok = "/healthz"

    def do_GET(self) -> None:
        ok = urllib.parse.urlsplit(self.path).path == self.path_ok
        body = b"{}" if ok else b"not found"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _standby_liveness(url: str | None) -> Iterator[None]:
    """Answer the liveness endpoint while waiting for the Lease (kopf serves it only once it runs),
    so the kubelet does not restart a healthy standby replica."""
    if not url:
        yield
        return
    parts = urllib.parse.urlsplit(url)
    handler = type("Healthz", (_Healthz,), {"path_ok": parts.path or "/"})
    server = http.server.ThreadingHTTPServer((parts.hostname or "0.0.0.0", parts.port or 80), handler)
    thread = threading.Thread(target=server.serve_forever, name="kubeinfer-standby-healthz", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM/SIGINT while waiting for the Lease end the wait (kopf handles them once it runs)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(
    args: argparse.Namespace,
    stop_flag: threading.Event | None = None,
    on_lost: Callable[[], None] | None = None,
) -> int:
    """Run kopf until it stops (SIGTERM/SIGINT, or `stop_flag` set). With --leader-elect, first wait
    for the Lease; keep renewing it while kopf runs; `on_lost` (default: exit the process at once)
    runs if it is lost; release it after kopf has stopped."""
    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)
    from .k8s import KubeClient

    if args.all_namespaces and args.namespace:
        print("error: use either --namespace or --all-namespaces", file=sys.stderr)
        return 2
    if args.leader_elect and args.peering:
        print("error: use either --leader-elect or --peering", file=sys.stderr)
        return 2
    config: LeaderElectionConfig | None = None
    if args.leader_elect:
        try:
            config = leader_election_config(args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    kopf.configure(
        verbose=args.verbose, log_format=kopf.LogFormat.JSON if args.log_json else kopf.LogFormat.FULL
    )
    # kopf waits for a threading.Event in an executor thread, which must end: pass only the caller's
    # (who sets it); kopf handles SIGTERM/SIGINT itself.
    run_kwargs: dict[str, Any] = {
        "clusterwide": args.all_namespaces,
        "namespaces": args.namespace or (),
        "liveness_endpoint": args.liveness or None,
        "stop_flag": stop_flag,
    }
    if config is None:
        kopf.run(peering_name=args.peering, standalone=args.standalone or None, **run_kwargs)
        return 0

    # Leader election has its own client: renewals never queue behind slow reconcile calls.
    store = KubeClient.from_environment(request_timeout=max(1.0, config.renew_deadline / 2), retries=False)
    elector = LeaderElector(store, config)
    try:
        stop = stop_flag if stop_flag is not None else threading.Event()
        with _standby_liveness(args.liveness or None), _stop_on_signals(stop):
            if not elector.acquire(stop):
                return 0
        log.info("leading as %s: starting to reconcile", config.identity)
        elector.start_renewing(on_lost or _exit_on_lost)
        try:
            # Only the Lease holder runs kopf: kopf's own peering is not needed.
            kopf.run(standalone=True, **run_kwargs)
        finally:
            elector.stop()  # and release the Lease (after kopf has stopped reconciling)
    finally:
        store.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubeinfer-operator")
    sub = parser.add_subparsers(dest="command", required=True)

    render = sub.add_parser(
        "render",
        help="print every object the operator would apply, as YAML",
        description="Print every object the operator would apply, as YAML. The operator's "
        "KUBEINFER_DEFAULT_SERVER_IMAGE, KUBEINFER_DEFAULT_SERVER_CPU_IMAGE, KUBEINFER_DEFAULT_ROUTER_IMAGE and "
        "KUBEINFER_DEFAULT_IMAGE_PULL_SECRETS apply as they do in the operator.",
    )
    render.add_argument("-f", "--file", required=True, help="InferenceModel YAML ('-' for stdin)")
    render.add_argument(
        "--no-service-monitor",
        action="store_true",
        help="render as for a cluster without the monitoring.coreos.com CRDs",
    )

    run = sub.add_parser(
        "run", help="run the operator (kopf) against the cluster of KUBECONFIG or in-cluster"
    )
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    run.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)"
    )
    run.add_argument(
        "--liveness", default="http://0.0.0.0:8081/healthz", help="liveness endpoint URL ('' to disable)"
    )
    peering = run.add_mutually_exclusive_group()
    peering.add_argument(
        "--peering",
        default=None,
        help="kopf peering object name, for several replicas in HA (needs kopf CRDs)",
    )
    peering.add_argument("--standalone", action="store_true", help="no peering: a single replica")
    elect = run.add_argument_group(
        "leader election",
        "several replicas, one reconciling: a coordination.k8s.io/v1 Lease (controller-runtime's flags "
        "and defaults); durations like 15s, 1m or 500ms",
    )
    elect.add_argument(
        "--leader-elect", action="store_true", help="wait for the Lease before reconciling (for HA)"
    )
    elect.add_argument("--leader-elect-lease-duration", default="15s", metavar="DURATION")
    elect.add_argument("--leader-elect-renew-deadline", default="10s", metavar="DURATION")
    elect.add_argument("--leader-elect-retry-period", default="2s", metavar="DURATION")
    elect.add_argument("--leader-elect-resource-name", default="kubeinfer-operator", metavar="NAME")
    elect.add_argument(
        "--leader-elect-resource-namespace",
        default="",
        metavar="NAMESPACE",
        help="namespace of the Lease (default: $POD_NAMESPACE, or the service account's)",
    )
    elect.add_argument(
        "--leader-elect-identity", default="", metavar="ID", help="default: $POD_NAME (or host name)_<uuid>"
    )
    elect.add_argument(
        "--leader-elect-release-on-cancel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give the Lease up on a clean shutdown, so the next replica leads at once",
    )
    run.add_argument("-v", "--verbose", action="store_true")
    run.add_argument("--log-json", action="store_true", help="JSON log lines")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "render":
        return _render(args, sys.stdout, sys.stderr)
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
