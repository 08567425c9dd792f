"""Us against the servers users compare us with, all on this machine in one interleaved run; prints JSON.

    python benchmarks/peers_side_by_side.py                  # ours, llama.cpp, vLLM fp32 (+ bf16), 2 rounds
    python benchmarks/peers_side_by_side.py --servers ours llama --rounds 1 --out build/peers.json
    python benchmarks/peers_side_by_side.py --servers ours \\
        --ours-variant 'cap0=--long-prefill-token-threshold 0' --ours-variant 'bf16@/work/wt/peers-bf16='

The load (issues 15 and 31): the OpenAI chat API, streaming, greedy, `ignore_eos`, 64 new tokens,
prompts of 128 tokens after the chat template: 1 user (4 requests in turn), 16 users (2 requests each),
and 32 users whose prompts share a 512-token prefix (512 shared tokens, then 128 of their own; 2
requests each). Servers:

- `ours`: `python -m server` with its defaults, i.e. the embedded SmolLM2 GGUF served quantized;
  `--ours-variant LABEL[@REPO]=ARGS` adds `ours-LABEL`: the same with ARGS appended (leading `NAME=VALUE`
  words of ARGS set environment variables, as in a shell), run from another checkout REPO (its
  `.venv/bin/python` when it has one) if given;
- `llama`: llama.cpp's llama-server on the same GGUF (../shared/peers/start.sh llama);
- `vllm` / `vllm-bf16`: vLLM's CPU build on the GGUF's float32 dequantization, in float32 / bfloat16
  (bf16 is in the default set only where the CPU's AVX512-BF16 or AMX-BF16 is usable: elsewhere vLLM
  emulates it).

All servers start together and stay up (vLLM compiles for 4-5 minutes at every start); then every load
runs `--rounds` times, each round against every server in turn, the order reversed in odd rounds, so a
shared machine's noise falls on all alike. Each round uses fresh prompts (and a fresh shared prefix), so
no server answers from a cache the previous round filled. `--one-at-a-time` starts each server only for
its own runs (less memory, no interleaving). Per run: output tokens/s (completion tokens / wall time),
TTFT and inter-token latency (between streamed content chunks) p50/p99, the lengths the server
reported, the load average before and after, and the CPU seconds the server and the idle others used
(an idle server that spins would show there), and the output tokens per CPU second of the server's
processes (on a loaded machine the least disturbed figure of work done). Then medians over rounds, our ratios against each peer
(per round, and their median), and the issue's targets. A peer not installed under $PEERS_DIR (default
~/.cache/kubeinfer-peers) is skipped with the reason; a server that fails or dies is reported and the
run goes on without it. llama-server closes kept-alive connections after a few requests: a request
whose connection closed before any byte came back is retried (counted in `retries`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
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
PEERS = ("llama", "vllm", "vllm-bf16")
SERVERS = ("ours", *PEERS)
LABELS = {
    "ours": "kubeinfer",
    "llama": "llama.cpp llama-server",
    "vllm": "vLLM (CPU build), float32",
    "vllm-bf16": "vLLM (CPU build), bfloat16",
}
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


class PromptMaker:
    """User messages of an exact token length once the model's chat template (with its default system
    prompt) is applied, measured with the model's own tokenizer."""

    def __init__(self, tokenizer_folder: Path) -> None:
        from server.tokenizer import Tokenizer

        self.tok = Tokenizer(tokenizer_folder)

    def length(self, text: str) -> int:
        return len(self.tok.apply_chat_template([{"role": "user", "content": text}]))

    def _fill(self, head: str, words: list[str], target: int) -> str:
        """`head` followed by as many of `words` as fit in `target` tokens, topped up by a one-token word."""
        sep = " " if head else ""
        while words and self.length(head + sep + " ".join(words)) > target:
            words.pop()
        text = head + sep + " ".join(words)
        if self.length(text) != target:
            for w in ("a", "b", "c", "x", "y", "z"):
                if self.length(f"{text} {w}") == target:
                    return f"{text} {w}"
        return text

    def prompts(self, count: int, prompt_tokens: int, seed: int, prefix_tokens: int = 0) -> list[str]:
        """`count` distinct messages of `prefix_tokens + prompt_tokens` tokens. With `prefix_tokens`, all
        start with the same text of that length (template included); the rest differs from its first word,
        so no server reuses a cached prefix beyond the shared one (or the template's)."""
        rng = random.Random(seed)
        prefix = ""
        if prefix_tokens:
            words = [f"Shared context {seed}:"] + [rng.choice(WORDS) for _ in range(prefix_tokens)]
            prefix = self._fill("", words, prefix_tokens) + "\n\n"
        out = []
        for i in range(count):
            words = [f"Request {seed}-{i}:"] + [rng.choice(WORDS) for _ in range(prompt_tokens)]
            out.append(
                self._fill(
                    prefix.rstrip("\n") + "\n\n" if prefix else "", words, prefix_tokens + prompt_tokens
                )
            )
        return out


# ------------------------------------------------------------------ load


@dataclass
class Result:
    """One request as the client saw it: perf_counter seconds. `cached_tokens` / `computed_tokens`: the
    prompt tokens the server said it reused / computed (llama-server's `timings.cache_n` / `prompt_n`)."""

    start: float
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    computed_tokens: int | None = None
    retries: int = 0
    error: str | None = None


# A connection the server closed before answering: llama-server drops kept-alive connections after a few
# requests. Retried while no byte of the response came back.
_RETRYABLE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError)


GREEDY: dict[str, float] = {"temperature": 0.0}


async def one_stream(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    sampling: Mapping[str, float] = GREEDY,
) -> Result:
    """`sampling`: the request's OpenAI sampling fields (temperature, top_p; top_k, min_p as vLLM's extras)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        **sampling,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = Result(start=time.perf_counter())  # TTFT counts from the first attempt: the user waited
    for attempt in range(4):
        got_bytes = False
        res.chunk_times.clear()
        try:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    res.end = time.perf_counter()
                    return res
                async for line in r.aiter_lines():
                    got_bytes = True
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        res.error = f"stream error: {str(chunk['error'])[:200]}"
                    for choice in chunk.get("choices") or []:
                        if (choice.get("delta") or {}).get("content"):
                            res.chunk_times.append(time.perf_counter())
                    usage = chunk.get("usage")
                    if usage:
                        res.prompt_tokens = usage.get("prompt_tokens")
                        res.completion_tokens = usage.get("completion_tokens")
                    timings = chunk.get("timings")
                    if isinstance(timings, dict) and "cache_n" in timings:
                        res.cached_tokens, res.computed_tokens = (
                            timings.get("cache_n"),
                            timings.get("prompt_n"),
                        )
            res.end = time.perf_counter()
            return res
        except _RETRYABLE as e:
            if got_bytes or attempt == 3:
                res.error = f"{type(e).__name__}: {e}"
                res.end = time.perf_counter()
                return res
            res.retries += 1
            await asyncio.sleep(0.05 * (attempt + 1))
        except httpx.TimeoutException as e:
            res.error = f"{type(e).__name__}: {e}"
            res.end = time.perf_counter()
            return res
    raise AssertionError("unreachable")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))], 4)


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


async def run_load(url: str, model: str, prompts: list[str], users: int, max_tokens: int) -> dict[str, Any]:
    """`users` concurrent users sending `prompts` in turn (each takes the next one when its last ended)."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=users, max_keepalive_connections=users)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:

        async def user() -> None:
            while not queue.empty():
                results.append(await one_stream(client, url, model, queue.get_nowait(), max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(users)))
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.completion_tokens or len(r.chunk_times) for r in ok)
    ttft = [r.chunk_times[0] - r.start for r in ok if r.chunk_times]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    return {
        "users": users,
        "requests": len(prompts),
        "completed": len(ok),
        "errors": sorted({r.error or "" for r in results if r.error})[:5],
        "retries": sum(r.retries for r in results),
        "duration_s": round(duration, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / duration, 3),
        "ttft_s": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99)},
        "itl_s": {"p50": _pct(itl, 50), "p99": _pct(itl, 99), "mean": _mean(itl)},
        "prompt_tokens_reported": sorted({r.prompt_tokens for r in ok if r.prompt_tokens is not None}),
        "completion_tokens_per_request": sorted({r.completion_tokens or len(r.chunk_times) for r in ok}),
        "content_chunks_per_request_mean": _mean([float(len(r.chunk_times)) for r in ok]),
    }


@dataclass(frozen=True)
class Load:
    """One load of the benchmark: `users` concurrent users, `requests` in all, prompts of
    `prefix_tokens` shared plus `prompt_tokens` own tokens."""

    name: str
    users: int
    requests: int
    prompt_tokens: int
    prefix_tokens: int = 0


# ------------------------------------------------------------------ servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Spec:
    """A server to run: `kind` is `ours` or a peer of start.sh; `repo`, `args` and `env` only for ours."""

    name: str
    kind: str
    repo: Path = REPO
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def parse_variant(text: str) -> Spec:
    """`LABEL[@REPO]=ARGS` -> Spec `ours-LABEL`. Raises ValueError on a malformed text or a missing REPO."""
    head, sep, args = text.partition("=")
    if not sep or not head:
        raise ValueError(f"--ours-variant wants LABEL[@REPO]=ARGS, got {text!r}")
    label, _, repo = head.partition("@")
    root = Path(repo).resolve() if repo else REPO
    if not (root / "server" / "__main__.py").is_file():
        raise ValueError(f"--ours-variant {text!r}: {root} holds no server/ package")
    words = shlex.split(args)
    env = []
    while words and "=" in words[0] and not words[0].startswith("-"):
        name, _, value = words.pop(0).partition("=")
        env.append((name, value))
    return Spec(f"ours-{label}", "ours", root, tuple(words), tuple(env))


def missing(spec: Spec, peers_dir: Path, start_script: Path) -> str | None:
    """Why server `spec` cannot run here, or None."""
    if spec.kind == "ours":
        return None
    if not start_script.is_file():
        return f"the peers' start script {start_script} does not exist"
    vllm_py = peers_dir / "venv-vllm" / "bin" / "python"
    need = peers_dir / "llama-server" if spec.kind == "llama" else vllm_py
    if not os.access(need, os.X_OK):
        return f"{LABELS[spec.kind]} is not installed ({need} missing): run ../shared/peers/setup.sh"
    if not (peers_dir / "model").is_dir() or (need == vllm_py and not (peers_dir / "hf").is_dir()):
        return f"the peers' model files are not under {peers_dir}: run ../shared/peers/setup.sh model"
    if need == vllm_py:  # the venv exists while setup.sh is still installing into it
        try:
            subprocess.run([str(need), "-c", "import vllm"], capture_output=True, timeout=300, check=True)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            return f"vLLM does not import from {need} (still being installed?): see ../shared/peers/setup.sh"
    return None


@dataclass
class Running:
    spec: Spec
    url: str
    pid: int
    log: Path
    command: str
    proc: subprocess.Popen[bytes] | None  # ours; the peers are started detached by start.sh
    started: float = field(default_factory=time.monotonic)
    model: str | None = None
    ready_s: float | None = None
    dead: str | None = None


def start(spec: Spec, peers_dir: Path, start_script: Path, threads: int | None) -> Running:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    if spec.kind == "ours":
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **dict(spec.env))
        env["PYTHONPATH"] = os.pathsep.join([str(spec.repo), env.get("PYTHONPATH", "")])
        log = Path(tempfile.mkstemp(prefix=f"peers-{spec.name}-", suffix=".log")[1])
        venv_py = spec.repo / ".venv" / "bin" / "python"
        python = str(venv_py) if spec.repo != REPO and venv_py.is_file() else sys.executable
        cmd = [python, "-m", "server", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--max-concurrent-requests", "1024", "--log-level", "warning"]
        if threads:
            cmd += ["--num-threads", str(threads)]
        cmd += list(spec.args)
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, cwd=spec.repo, env=env, stdout=f, stderr=subprocess.STDOUT)
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.env)
        return Running(spec, url, proc.pid, log, (shown + " " if shown else "") + shlex.join(cmd), proc)
    env = dict(os.environ, PEERS_DIR=str(peers_dir))
    cmd = ["bash", str(start_script), spec.kind, str(port)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    pid = int(out.stdout.strip().splitlines()[-1])
    return Running(spec, url, pid, peers_dir / f"{spec.kind}-{port}.log", shlex.join(cmd), None)


def _alive(srv: Running) -> bool:
    if srv.proc is not None:
        return srv.proc.poll() is None
    try:
        os.kill(srv.pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie of a detached peer counts as dead
        if Path(f"/proc/{srv.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def poll_ready(srv: Running) -> bool:
    """One look at /v1/models; sets `srv.model` once the server lists one. Raises RuntimeError when the
    server has exited."""
    if not _alive(srv):
        raise RuntimeError(f"{srv.spec.name} exited before becoming ready; log {srv.log}:\n{_tail(srv.log)}")
    try:
        r = httpx.get(f"{srv.url}/v1/models", timeout=5)
        if r.status_code == 200 and r.json().get("data"):
            srv.model = str(r.json()["data"][0]["id"])
            srv.ready_s = round(time.monotonic() - srv.started, 1)
            return True
    except (httpx.HTTPError, ValueError):
        pass
    return False


def wait_ready(servers: list[Running], timeout_s: float) -> list[tuple[Running, str]]:
    """Waits for all `servers` together; returns the ones that failed, with why (and stops them)."""
    failed: list[tuple[Running, str]] = []
    pending = list(servers)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for srv in list(pending):
            try:
                if poll_ready(srv):
                    pending.remove(srv)
                    print(f"{srv.spec.name} ready after {srv.ready_s} s", file=sys.stderr, flush=True)
            except RuntimeError as e:
                pending.remove(srv)
                failed.append((srv, str(e)))
        time.sleep(1.0)
    failed += [(srv, f"not ready after {timeout_s} s; log {srv.log}:\n{_tail(srv.log)}") for srv in pending]
    for srv, why in failed:
        print(f"{srv.spec.name} failed to start: {why}", file=sys.stderr, flush=True)
        stop(srv)
    return failed


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-3000:]
    except OSError:
        return ""


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d.name))
    return kids


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants (vLLM runs its engine in a child process)."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the live processes of `pid`'s tree have used."""
    total = 0
    for p in process_tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int | None:
    """Resident memory of `pid`'s process tree."""
    total, seen = 0, False
    for p in process_tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    seen = True
    return total if seen else None


def stop(srv: Running) -> None:
    """SIGTERM, 60 s to exit, then SIGKILL to whatever is left of its process tree."""
    tree = process_tree(srv.pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(srv.pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _alive(srv):
        if srv.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                srv.proc.wait(1)
        else:
            time.sleep(0.5)
    for p in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    if srv.proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            srv.proc.wait(10)


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


def usable_features() -> tuple[str, ...] | None:
    """What the OS lets this process use (server/cpu_features.py), None when the probe cannot build."""
    try:
        from server.native import usable_cpu_features

        return usable_cpu_features().names()
    except Exception:  # a machine without a compiler still runs the peers
        return None


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ------------------------------------------------------------------ summary


def _metric(run: dict[str, Any], metric: str) -> float | None:
    if run.get("completed", 0) < run.get("requests", 1):
        return None  # a run with failed requests measured something else
    v = {
        "output_tokens_per_s": run.get("output_tokens_per_s"),
        "ttft_p50_s": (run.get("ttft_s") or {}).get("p50"),
        "itl_p50_s": (run.get("itl_s") or {}).get("p50"),
        "itl_p99_s": (run.get("itl_s") or {}).get("p99"),
        "output_tokens_per_cpu_s": (
            run["output_tokens"] / run["server_cpu_s"] if run.get("server_cpu_s") else None
        ),
    }[metric]
    return float(v) if v is not None else None


# output tokens per CPU second of the server's processes: what a loaded machine disturbs least (a server
# waiting for a core uses none), though a spinning thread counts as work.
METRICS = ("output_tokens_per_s", "ttft_p50_s", "itl_p50_s", "itl_p99_s", "output_tokens_per_cpu_s")


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return round(statistics.median(got), 4) if got else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """server -> load -> metric -> median over rounds."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for r in runs:
        out.setdefault(r["server"], {}).setdefault(r["load"], {})
    for server, loads in out.items():
        for load in loads:
            mine = [r for r in runs if r["server"] == server and r["load"] == load]
            loads[load] = {m: _median([_metric(r, m) for r in mine]) for m in METRICS}
    return out


def ratios(runs: list[dict[str, Any]], ours: list[str], others: list[str]) -> dict[str, Any]:
    """`A_vs_B` -> load -> metric -> {median, rounds}: A's figure over B's, per round (the two ran minutes
    apart in that round) and the median of those."""
    by = {(r["server"], r["load"], r["round"]): r for r in runs}
    loads = sorted({r["load"] for r in runs}, key=[r["load"] for r in runs].index)
    rounds = sorted({r["round"] for r in runs})
    out: dict[str, Any] = {}
    for a in ours:
        for b in others:
            if a == b:
                continue
            pair: dict[str, Any] = {}
            for load in loads:
                per_metric: dict[str, Any] = {}
                for m in METRICS:
                    per_round = []
                    for rnd in rounds:
                        ra, rb = by.get((a, load, rnd)), by.get((b, load, rnd))
                        va = _metric(ra, m) if ra else None
                        vb = _metric(rb, m) if rb else None
                        per_round.append(round(va / vb, 3) if va and vb else None)
                    per_metric[m] = {"median": _median(per_round), "rounds": per_round}
                pair[load] = per_metric
            out[f"{a}_vs_{b}"] = pair
    return out


def targets(rat: dict[str, Any], ours: list[str], loads: list[Load], bf16_cpu: bool) -> list[dict[str, Any]]:
    """Issue 31's targets, each as measured for every server of ours that ran."""
    one = next((ld.name for ld in loads if ld.users == 1 and not ld.prefix_tokens), None)
    plain = [ld for ld in loads if ld.users > 1 and not ld.prefix_tokens]
    many = max(plain, key=lambda ld: ld.users).name if plain else None
    vllm = "vllm-bf16" if bf16_cpu else "vllm"
    wanted: list[tuple[str, str, str, str, float, bool]] = []  # peer, load, metric, text, bound, higher
    if one:
        wanted.append(("llama", one, "output_tokens_per_s", "one user: >= 1.2x llama.cpp", 1.2, True))
    if many:
        wanted.append((vllm, many, "output_tokens_per_s", f"{many}: >= 1.3x {vllm}", 1.3, True))
        wanted.append((vllm, many, "ttft_p50_s", f"{many}: TTFT p50 <= {vllm}'s", 1.0, False))
    for ld in loads:
        if ld.users >= 16:
            wanted.append((vllm, ld.name, "itl_p99_s", f"{ld.name}: ITL p99 <= {vllm}'s", 1.0, False))
    out = []
    for a in ours:
        for peer, load, metric, text, bound, higher in wanted:
            value = rat.get(f"{a}_vs_{peer}", {}).get(load, {}).get(metric, {}).get("median")
            met = None if value is None else (value >= bound if higher else value <= bound)
            out.append({"server": a, "target": text, "ratio": value, "met": met})
    return out


# ------------------------------------------------------------------ main


def conclude(report: dict[str, Any], loads: list[Load], bf16_cpu: bool) -> None:
    """Adds the medians, the ratios and the targets of the runs so far to `report`."""
    ran = list(dict.fromkeys(r["server"] for r in report["runs"]))
    ours = [s for s in ran if s == "ours" or s.startswith("ours-")]
    report["summary"] = summarize(report["runs"])
    report["ratios"] = ratios(report["runs"], ours, ran)
    report["targets"] = targets(report["ratios"], ours, loads, bf16_cpu)


def _write(report: dict[str, Any], out: Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(f"signal {signum}")  # so that `finally` stops the servers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", nargs="+", default=None, choices=SERVERS, help="default: all usable")
    ap.add_argument("--ours-variant", action="append", default=[], metavar="LABEL[@REPO]=ARGS")
    ap.add_argument("--users", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--shared-prefix-users", nargs="*", type=int, default=[32])
    ap.add_argument("--shared-prefix-tokens", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-user", type=int, default=2, help="requests each user sends in turn")
    ap.add_argument("--min-requests", type=int, default=4, help="at least this many per run (1 user)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--one-at-a-time", action="store_true", help="start each server only for its runs")
    ap.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    ap.add_argument("--start-script", type=Path, default=DEFAULT_START)
    ap.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds (vLLM compiles at start)")
    ap.add_argument("--num-threads", type=int, default=None, help="our servers' --num-threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here (after every run)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _on_sigterm)

    from server.models.loader import resolve_model

    features = usable_features()
    bf16_cpu = bool(features and ({"avx512_bf16", "amx_bf16"} & set(features)))
    names = args.servers or [s for s in SERVERS if s != "vllm-bf16" or bf16_cpu]
    specs = [Spec(n, n) for n in names]
    specs[1:1] = [parse_variant(v) for v in args.ours_variant]  # right after ours: its neighbours
    loads = [
        Load(
            f"{u}_user{'s' if u > 1 else ''}",
            u,
            max(args.min_requests if u == 1 else 0, u * args.requests_per_user),
            args.prompt_tokens,
        )
        for u in args.users
    ] + [
        Load(
            f"{u}_users_shared_prefix_{args.shared_prefix_tokens}",
            u,
            u * args.requests_per_user,
            args.prompt_tokens,
            args.shared_prefix_tokens,
        )
        for u in args.shared_prefix_users
    ]

    hf = args.peers_dir / "hf"
    maker = PromptMaker(hf if (hf / "tokenizer.json").is_file() else resolve_model(None).folder)
    prompts = {
        (ld.name, rnd): maker.prompts(
            ld.requests, ld.prompt_tokens, 1000 * (rnd + 1) + ld.users, ld.prefix_tokens
        )
        for ld in loads
        for rnd in range(args.rounds)
    }
    warm_plain = maker.prompts(8, args.prompt_tokens, 7)
    warm_prefix = maker.prompts(4, args.prompt_tokens, 8, args.shared_prefix_tokens)

    report: dict[str, Any] = {
        "benchmark": "chat API, streaming, greedy, ignore_eos; all servers on this machine, interleaved",
        "config": {
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "loads": [vars(ld) for ld in loads],
            "rounds": args.rounds,
            "mode": "one at a time" if args.one_at_a_time else "all up together, runs interleaved",
            "model": "SmolLM2-135M-Instruct (embedded GGUF Q4_1; vLLM: its float32 dequantization)",
        },
        "machine": {
            "cpu": cpu_info(),
            "usable_features": features,
            "uptime_at_start": _uptime(),
            "note": "shared by several engineers' processes while this ran: compare ratios, not absolutes",
        },
        "servers": {},
        "skipped": {},
        "runs": [],
    }
    runnable = []
    for spec in specs:
        why = missing(spec, args.peers_dir, args.start_script)
        if why is None:
            runnable.append(spec)
        else:
            print(f"skipping {spec.name}: {why}", file=sys.stderr, flush=True)
            report["skipped"][spec.name] = why

    running: dict[str, Running] = {}

    def bring_up(batch: list[Spec]) -> list[Running]:
        started = [start(s, args.peers_dir, args.start_script, args.num_threads) for s in batch]
        running.update({r.spec.name: r for r in started})
        for srv, why in wait_ready(started, args.ready_timeout):
            report["skipped"][srv.spec.name] = f"failed to start: {why.splitlines()[0]}"
            del running[srv.spec.name]
        up = [r for r in started if r.spec.name in running]
        for srv in up:  # compile, caches, pages: one alone, then a batch, then shared-prefix prompts
            asyncio.run(run_load(srv.url, srv.model or "", warm_plain[:1], 1, args.max_tokens))
            asyncio.run(run_load(srv.url, srv.model or "", warm_plain, 8, args.max_tokens))
            if any(ld.prefix_tokens for ld in loads):
                asyncio.run(run_load(srv.url, srv.model or "", warm_prefix, 4, args.max_tokens))
            report["servers"][srv.spec.name] = {
                "what": LABELS[srv.spec.kind]
                + (f" ({srv.spec.name})" if srv.spec.name != srv.spec.kind else ""),
                "command": srv.command,
                "repo": str(srv.spec.repo) if srv.spec.kind == "ours" else None,
                "model_id": srv.model,
                "ready_s": srv.ready_s,
                "load_average_at_ready": _loadavg(),
            }
        return up

    def one_run(srv: Running, ld: Load, rnd: int) -> None:
        if srv.dead:
            return
        others = [r for r in running.values() if r is not srv]
        cpu0 = {r.spec.name: tree_cpu_s(r.pid) for r in running.values()}
        load0 = _loadavg()
        res = asyncio.run(
            run_load(srv.url, srv.model or "", prompts[(ld.name, rnd)], ld.users, args.max_tokens)
        )
        row = {
            "server": srv.spec.name,
            "load": ld.name,
            "round": rnd,
            "load_average_before": load0,
            "load_average_after": _loadavg(),
            "server_cpu_s": round(tree_cpu_s(srv.pid) - cpu0[srv.spec.name], 2),
            "idle_servers_cpu_s": round(sum(tree_cpu_s(r.pid) - cpu0[r.spec.name] for r in others), 2),
            **res,
        }
        if not _alive(srv):
            srv.dead = f"exited during {ld.name} round {rnd}; log {srv.log}"
            row["errors"] = [*row["errors"], srv.dead]
            report["skipped"][srv.spec.name] = srv.dead
        report["runs"].append(row)
        report["servers"].setdefault(srv.spec.name, {})["rss_bytes_after_runs"] = rss_bytes(srv.pid)
        print(json.dumps(row), file=sys.stderr, flush=True)
        conclude(report, loads, bf16_cpu)  # a run stopped early still leaves its figures compared
        _write(report, args.out)

    try:
        if args.one_at_a_time:
            for spec in runnable:
                for srv in bring_up([spec]):
                    for ld in loads:
                        for rnd in range(args.rounds):
                            one_run(srv, ld, rnd)
                    stop(running.pop(spec.name))
        else:
            up = bring_up(runnable)
            for ld in loads:
                for rnd in range(args.rounds):
                    for srv in up if rnd % 2 == 0 else list(reversed(up)):
                        one_run(srv, ld, rnd)
    finally:
        for srv in list(running.values()):
            stop(srv)
    conclude(report, loads, bf16_cpu)
    report["machine"]["uptime_at_end"] = _uptime()
    _write(report, args.out)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
