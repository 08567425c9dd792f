"""A worker pod in multi-node mode (LWS_WORKER_INDEX > 0): this node's ranks, no HTTP API.

The process is the node's first rank (global rank node_rank * N/nnodes) and spawns the node's other
ranks. It answers `GET /health` on the server's port (stdlib HTTP server on a thread: 503 while the
shard loads and the group forms, 200 while the step loop runs) for the pod's probes. It returns 0
when the leader stops the group gracefully and 1 when the group breaks (the leader or another rank
died or hung past the timeout): the pod restarts and LWS recreates the group.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from server.config import EngineConfig
from server.distributed.parallel_state import STARTUP_TIMEOUT_FLOOR_S, ParallelState, backend_for, rank_device
from server.distributed.worker import spawn_local_workers, worker_main

log = logging.getLogger(__name__)


class _Health:
    def __init__(self) -> None:
        self.ready = threading.Event()


def _health_server(host: str, port: int, health: _Health) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/health":
                self.send_error(
                    404, "a tensor-parallel worker serves /health only; the leader serves the API"
                )
                return
            ok = health.ready.is_set()
            body = b"{}" if ok else b'{"error": "worker rank not ready"}'
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return  # probes every few seconds would flood the log

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="worker-health", daemon=True).start()
    return server


def run_worker_node(config: EngineConfig, host: str, port: int) -> int:
    """Runs this pod's ranks until the group stops. Returns the process exit code (0 or 1)."""
    par = config.parallel
    assert par.node_rank > 0, "the leader serves HTTP (server.api.server.serve)"
    first_rank = par.node_rank * par.ranks_per_node
    state = ParallelState(
        rank=first_rank,
        world_size=par.tensor_parallel_size,
        local_rank=0,
        master_addr=par.master_addr,
        master_port=par.rendezvous_port,
        backend=backend_for(rank_device(config.device, 0)),
        timeout_s=par.distributed_timeout_s,
        startup_timeout_s=max(par.distributed_timeout_s, STARTUP_TIMEOUT_FLOOR_S),
    )
    health = _Health()
    server = _health_server(host, port, health)
    log.info(
        "tensor-parallel worker node %d of %d: ranks %d..%d, joining %s:%d; /health on %s:%d",
        par.node_rank,
        par.nnodes,
        first_rank,
        first_rank + par.ranks_per_node - 1,
        state.master_addr,
        state.master_port,
        host,
        port,
    )
    procs = spawn_local_workers(state, config)
    try:
        worker_main(state, config, on_ready=health.ready.set)
        log.info("the leader stopped the group; exiting")
        code = 0
    except BaseException as e:  # the group broke: the leader or a rank died, hung, or failed to start
        log.error("exiting: tensor-parallel group failed: %s: %s", type(e).__name__, e)
        code = 1
    finally:
        health.ready.clear()
        server.shutdown()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return code
