"""`python -m kubeinfer_operator render -f model.yaml` and `python -m kubeinfer_operator run`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import yaml

from .render import Capabilities, render_all
from .spec import InferenceModel, InvalidSpecError, semantic_errors


def render_documents(manifests: list[dict[str, Any]], caps: Capabilities) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for manifest in manifests:
        im = InferenceModel.from_manifest(manifest)
        problems = semantic_errors(im.spec)
        if problems:
            raise InvalidSpecError(f"{im.namespace}/{im.name}: " + "; ".join(problems))
        out.extend(render_all(im, caps).objects)
    return out


def _render(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    if args.file == "-":
        text = sys.stdin.read()
    else:
        with open(args.file, encoding="utf-8") as fh:
            text = fh.read()
    manifests = [doc for doc in yaml.safe_load_all(text) if doc]
    caps = Capabilities(service_monitor=not args.no_service_monitor, keda=True)
    try:
        objects = render_documents(manifests, caps)
    except InvalidSpecError as exc:
        print(f"error: {exc}", file=stderr)
        return 1
    yaml.safe_dump_all(objects, stdout, sort_keys=False)
    return 0


def _run(args: argparse.Namespace) -> int:
    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)

    if args.all_namespaces and args.namespace:
        print("error: use either --namespace or --all-namespaces", file=sys.stderr)
        return 2
    kopf.configure(
        verbose=args.verbose, log_format=kopf.LogFormat.JSON if args.log_json else kopf.LogFormat.FULL
    )
    kopf.run(
        clusterwide=args.all_namespaces,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness or None,
        peering_name=args.peering,
        standalone=args.standalone or None,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubeinfer-operator")
    sub = parser.add_subparsers(dest="command", required=True)

    render = sub.add_parser("render", help="print every object the operator would apply, as YAML")
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
