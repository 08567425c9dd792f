"""Us against the servers users compare us with, one after the other on this machine; prints JSON.

    python benchmarks/peers_side_by_side.py                     # ours, llama.cpp, vLLM; 1 and 16 users
    python benchmarks/peers_side_by_side.py --servers ours llama --out build/peers.json

The issue's load (issue 15): the OpenAI chat API, streaming, prompts of 128 tokens after the chat
template, 64 new tokens each (`ignore_eos`, greedy), one user and 16 users. Servers, each started in
turn on a free local port and stopped before the next starts:

- `ours`: `python -m server` with its defaults, i.e. the embedded SmolLM2 GGUF served quantized;
- `llama`: llama.cpp's llama-server on the same GGUF (../shared/peers/start.sh llama);
- `vllm`: vLLM's CPU build on the GGUF's float32 dequantization (../shared/peers/start.sh vllm).

A peer that is not installed under $PEERS_DIR (default ~/.cache/kubeinfer-peers) is skipped with a
message saying so. Per server and concurrency: output tokens/s (completion tokens / wall time of the
run), TTFT and inter-token latency (between streamed content chunks) p50/p99, the prompt and output
lengths the server reported; then our ratios against llama.cpp at 1 user and vLLM at 16 users (the
issue's targets), the CPU model and flags, and the load average when each server started. These
machines are shared: absolute figures move with the load, so read the ratios and the load averages.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_PEERS_DIR = Path(os.environ.get("PEERS_DIR", str(Path.home() / ".cache" / "kubeinfer-peers")))
# ../shared/peers from the main checkout, ../../shared/peers from a worktree under /work/wt/
DEFAULT_START = (
    next(
        (
            p
            for p in (REPO.parent / "shared", REPO.parent.parent / "shared")
            if (p / "peers" / "start.sh").is_file()
        ),
        REPO.parent / "shared",
    )
    / "peers"
    / "start.sh"
)
SERVERS = ("ours", "llama", "vllm")
LABELS = {"ours": "kubeinfer", "llama": "llama.cpp llama-server", "vllm": "vLLM (CPU build)"}
WORDS = (
    "river",
    "stone",
    "window",
    "garden",
    "letter",
    "market",
    "winter",
    "engine",
    "silver",
    "forest",
    "harbor",
    "candle",
    "mirror",
    "planet",
    "bridge",
    "thunder",
    "pocket",
    "ladder",
    "island",
    "shadow",
    "orange",
    "violin",
    "camera",
    "rocket",
    "basket",
    "pillow",
    "meadow",
    "castle",
    "whistle",
    "lantern",
    "compass",
    "feather",
    "blanket",
    "canyon",
    "glacier",
    "tunnel",
    "button",
    "marble",
    "sailor",
    "jungle",
    "breeze",
)


# ------------------------------------------------------------------ prompts


def make_prompts(tokenizer_folder: Path, count: int, prompt_tokens: int, seed: int) -> list[str]:
    """`count` distinct user messages, each `prompt_tokens` long once the model's chat template (with its
    default system prompt) is applied, measured with the model's own tokenizer. Distinct from the first
    word so that no server reuses a cached prefix beyond the template's."""
    from server.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_folder)
    rng = random.Random(seed)

    def length(text: str) -> int:
        return len(tok.apply_chat_template([{"role": "user", "content": text}]))

    prompts = []
    for i in range(count):
        words = [f"Request {i}:"] + [rng.choice(WORDS) for _ in range(prompt_tokens)]
        while len(words) > 1 and length(" ".join(words)) > prompt_tokens:
            words.pop()
        text = " ".join(words)
        if length(text) != prompt_tokens:  # a one-token word fills the last place
            for w in ("a", "b", "c", "x", "y", "z"):
                if length(f"{text} {w}") == prompt_tokens:
                    text = f"{text} {w}"
                    break
        prompts.append(text)
    return prompts


# ------------------------------------------------------------------ load


@dataclass
class Result:
    start: float
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Result:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for attempt in range(3):
        res = Result(start=time.perf_counter())
        got_bytes = False
        try:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return res
                async for line in r.aiter_lines():
                    got_bytes = True
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    for choice in chunk.get("choices") or []:
                        if (choice.get("delta") or {}).get("content"):
                            res.chunk_times.append(time.perf_counter())
                    usage = chunk.get("usage")
                    if usage:
                        res.prompt_tokens = usage.get("prompt_tokens")
                        res.completion_tokens = usage.get("completion_tokens")
            res.end = time.perf_counter()
            return res
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError) as e:
            # llama-server closes kept-alive connections after a few requests: retry one that never started.
            if got_bytes or attempt == 2:
                res.error = f"{type(e).__name__}: {e}"
                res.end = time.perf_counter()
                return res
    raise AssertionError("unreachable")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))], 4)


async def run_load(url: str, model: str, prompts: list[str], users: int, max_tokens: int) -> dict[str, Any]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=users, max_keepalive_connections=users)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def user() -> None:
            while not queue.empty():
                results.append(await _one(client, url, model, queue.get_nowait(), max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(users)))
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.completion_tokens or len(r.chunk_times) for r in ok)
    ttft = [r.chunk_times[0] - r.start for r in ok if r.chunk_times]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    prompt_lens = sorted({r.prompt_tokens for r in ok if r.prompt_tokens is not None})
    out_lens = sorted({r.completion_tokens or len(r.chunk_times) for r in ok})
    return {
        "users": users,
        "requests": len(prompts),
        "completed": len(ok),
        "errors": sorted({r.error or "" for r in results if r.error})[:5],
        "duration_s": round(duration, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / duration, 3),
        "ttft_s": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99)},
        "itl_s": {"p50": _pct(itl, 50), "p99": _pct(itl, 99), "mean": _mean(itl)},
        "prompt_tokens_reported": prompt_lens,
        "completion_tokens_per_request": out_lens,
        "content_chunks_per_request_mean": _mean([float(len(r.chunk_times)) for r in ok]),
    }


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


# ------------------------------------------------------------------ servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing(name: str, peers_dir: Path, start_script: Path) -> str | None:
    """Why server `name` cannot run here, or None."""
    if name == "ours":
        return None
    if not start_script.is_file():
        return f"the peers' start script {start_script} does not exist"
    need = {"llama": peers_dir / "llama-server", "vllm": peers_dir / "venv-vllm" / "bin" / "python"}[name]
    if not os.access(need, os.X_OK):
        return f"{LABELS[name]} is not installed ({need} missing): run ../shared/peers/setup.sh {name}"
    if not (peers_dir / "model").is_dir() or (name == "vllm" and not (peers_dir / "hf").is_dir()):
        return f"the peers' model files are not under {peers_dir}: run ../shared/peers/setup.sh model"
    if name == "vllm":  # the venv exists while setup.sh is still installing into it
        try:
            subprocess.run([str(need), "-c", "import vllm"], capture_output=True, timeout=300, check=True)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            return f"vLLM does not import from {need} (still being installed?): see ../shared/peers/setup.sh"
    return None


@dataclass
class Running:
    name: str
    url: str
    pid: int
    log: Path
    proc: subprocess.Popen[bytes] | None  # ours; the peers are started detached by start.sh


def start(name: str, peers_dir: Path, start_script: Path, threads: int | None) -> Running:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    if name == "ours":
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        log = Path(tempfile.mkstemp(prefix="peers-ours-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--max-concurrent-requests", "1024", "--log-level", "warning"]
        if threads:
            cmd += ["--num-threads", str(threads)]
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        return Running(name, url, proc.pid, log, proc)
    env = dict(os.environ, PEERS_DIR=str(peers_dir))
    out = subprocess.run(
        ["bash", str(start_script), name, str(port)], env=env, capture_output=True, text=True, check=True
    )
    return Running(
        name, url, int(out.stdout.strip().splitlines()[-1]), peers_dir / f"{name}-{port}.log", None
    )


def _alive(srv: Running) -> bool:
    if srv.proc is not None:
        return srv.proc.poll() is None
    try:
        os.kill(srv.pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_ready(srv: Running, timeout_s: float) -> str:
    """Polls /v1/models until the server lists a model; returns the model id to request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(srv):
            raise RuntimeError(f"{srv.name} exited before becoming ready; log {srv.log}:\n{_tail(srv.log)}")
        try:
            r = httpx.get(f"{srv.url}/v1/models", timeout=5)
            if r.status_code == 200 and r.json().get("data"):
                return str(r.json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{srv.name} not ready after {timeout_s} s; log {srv.log}:\n{_tail(srv.log)}")


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-3000:]
    except OSError:
        return ""


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def stop(srv: Running) -> None:
    try:
        os.kill(srv.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _alive(srv):
        if srv.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                srv.proc.wait(1)
        else:
            time.sleep(0.5)
    if _alive(srv):
        os.kill(srv.pid, signal.SIGKILL)
        if srv.proc is not None:
            srv.proc.wait()


# ------------------------------------------------------------------ machine


def cpu_info() -> dict[str, Any]:
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")
    return {
        "model": model,
        "logical_cpus": os.cpu_count(),
        "flags": {f: f in flags for f in wanted},
    }


def _ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    return round(a / b, digits) if a and b else None


def ratios(results: dict[str, dict[str, Any]], low: int, high: int) -> dict[str, Any]:
    def get(server: str, users: int, *keys: str) -> float | None:
        v: Any = results.get(server, {}).get(str(users))
        for k in keys:
            v = None if v is None else v.get(k)
        return v

    tps = "output_tokens_per_s"
    return {
        f"ours_vs_llama_output_tokens_per_s_{low}_user": _ratio(
            get("ours", low, tps), get("llama", low, tps)
        ),
        f"ours_vs_vllm_output_tokens_per_s_{high}_users": _ratio(
            get("ours", high, tps), get("vllm", high, tps)
        ),
        f"ours_vs_vllm_ttft_p50_{high}_users": _ratio(
            get("ours", high, "ttft_s", "p50"), get("vllm", high, "ttft_s", "p50")
        ),
        f"ours_vs_llama_output_tokens_per_s_{high}_users": _ratio(
            get("ours", high, tps), get("llama", high, tps)
        ),
        f"ours_vs_vllm_output_tokens_per_s_{low}_user": _ratio(get("ours", low, tps), get("vllm", low, tps)),
        "targets": {
            f"ours_vs_llama_output_tokens_per_s_{low}_user": ">= 1.0",
            f"ours_vs_vllm_output_tokens_per_s_{high}_users": ">= 1.3",
            f"ours_vs_vllm_ttft_p50_{high}_users": "<= 1.0",
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    ap.add_argument("--users", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-user", type=int, default=2, help="requests each user sends in turn")
    ap.add_argument("--min-requests", type=int, default=4, help="at least this many per run (1 user)")
    ap.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    ap.add_argument("--start-script", type=Path, default=DEFAULT_START)
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="seconds (vLLM compiles at start)")
    ap.add_argument("--num-threads", type=int, default=None, help="our server's --num-threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()

    from server.models.loader import resolve_model

    hf = args.peers_dir / "hf"
    tok_folder = hf if (hf / "tokenizer.json").is_file() else resolve_model(None).folder
    sizes = {u: max(args.min_requests if u == 1 else 0, u * args.requests_per_user) for u in args.users}
    prompts = make_prompts(tok_folder, max(sizes.values()) + 1, args.prompt_tokens, args.seed)
    warmup, prompts = prompts[0], prompts[1:]

    report: dict[str, Any] = {
        "benchmark": "chat API, streaming, greedy, ignore_eos; one server at a time on this machine",
        "config": {
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "users": args.users,
            "requests": {str(u): n for u, n in sizes.items()},
            "model": "SmolLM2-135M-Instruct (embedded GGUF Q4_1; vLLM: its float32 dequantization)",
        },
        "machine": {
            "cpu": cpu_info(),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "note": "shared by several engineers' processes while this ran: compare ratios, not absolutes",
        },
        "servers": {},
        "skipped": {},
        "results": {},
    }
    for name in args.servers:
        why = missing(name, args.peers_dir, args.start_script)
        if why is not None:
            print(f"skipping {name}: {why}", file=sys.stderr, flush=True)
            report["skipped"][name] = why
            continue
        load_at_start = [round(x, 2) for x in os.getloadavg()]
        t0 = time.monotonic()
        srv = start(name, args.peers_dir, args.start_script, args.num_threads)
        try:
            try:
                model = wait_ready(srv, args.ready_timeout)
            except (RuntimeError, TimeoutError) as e:
                print(f"{name} failed to start: {e}", file=sys.stderr, flush=True)
                report["skipped"][name] = f"failed to start: {str(e).splitlines()[0]}"
                continue
            ready_s = time.monotonic() - t0
            asyncio.run(run_load(srv.url, model, [warmup], 1, args.max_tokens))  # compile, caches, pages
            runs: dict[str, Any] = {}
            for users in args.users:
                runs[str(users)] = asyncio.run(
                    run_load(srv.url, model, prompts[: sizes[users]], users, args.max_tokens)
                )
                print(json.dumps({"server": name, **runs[str(users)]}), file=sys.stderr, flush=True)
            report["results"][name] = runs
            report["servers"][name] = {
                "what": LABELS[name],
                "model_id": model,
                "ready_s": round(ready_s, 1),
                "rss_bytes_after_runs": rss_bytes(srv.pid),
                "load_average_at_start": load_at_start,
            }
        finally:
            stop(srv)
    low, high = min(args.users), max(args.users)
    report["ratios"] = ratios(report["results"], low, high)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
