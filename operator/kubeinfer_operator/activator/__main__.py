"""`python -m kubeinfer_operator.activator`: one model's activator (flags as render_activator sets them)."""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

from ..k8s import KubeClient
from .controller import Controller, ControllerConfig
from .gate import Gate, GateConfig
from .metrics import ActivatorMetrics
from .proxy import DEFAULT_MAX_PAYLOAD_BYTES, Activator, ProxyConfig
from .scaler import Scaler


def build(args: argparse.Namespace, client: KubeClient) -> Activator:
    metrics = ActivatorMetrics(args.name)
    gate = Gate(
        GateConfig(max_held=args.max_held_requests, max_wait_seconds=args.max_wait_seconds), args.name
    )
    controller = Controller(
        ControllerConfig(
            per_replica=args.max_concurrent_requests,
            wake_replicas=args.wake_replicas,
            scale_down_delay=args.scale_down_delay_seconds,
            idle_scale_down=args.idle_scale_down,
            poll_seconds=args.poll_seconds,
            wake=args.wake,
        ),
        gate,
        Scaler(client, args.kind, args.namespace, args.name),
        metrics,
    )
    proxy = ProxyConfig(upstream=args.upstream.rstrip("/"), max_payload_bytes=args.max_payload_bytes)
    return Activator(proxy, gate, controller, metrics)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubeinfer-activator", description=__doc__)
    p.add_argument("--namespace", required=True)
    p.add_argument("--name", required=True, help="the model's workload (Deployment or LeaderWorkerSet)")
    p.add_argument("--kind", choices=("Deployment", "LeaderWorkerSet"), default="Deployment")
    p.add_argument("--upstream", required=True, help="the model's Service URL, e.g. http://m.ns:8080")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-held-requests", type=int, default=100)
    p.add_argument("--max-wait-seconds", type=float, default=1800.0)
    p.add_argument("--max-concurrent-requests", type=int, default=128, help="what one replica admits")
    p.add_argument(
        "--max-payload-bytes",
        type=int,
        default=DEFAULT_MAX_PAYLOAD_BYTES,
        help="request bodies over this get 413 at once (the model server's flag and default)",
    )
    p.add_argument("--wake-replicas", type=int, default=1)
    p.add_argument("--scale-down-delay-seconds", type=float, default=300.0)
    p.add_argument(
        "--idle-scale-down",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="scale to zero when idle (off under KEDA, which does it itself)",
    )
    p.add_argument(
        "--wake",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="scale the model up when requests are held (off under KEDA, whose activation trigger does it)",
    )
    p.add_argument("--poll-seconds", type=float, default=1.0)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    activator = build(args, KubeClient.from_environment(request_timeout=10.0))
    # handler_cancellation: a client that hangs up while held gives up its place (and its slot).
    web.run_app(activator.app(), host="0.0.0.0", port=args.port, access_log=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
