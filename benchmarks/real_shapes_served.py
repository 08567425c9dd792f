"""Real-shape models served side by side with llama.cpp and vLLM on this machine (issues 44 item 6, 47
item 6, 49 items 1-4); prints JSON.

    python benchmarks/real_shape_models.py                 # first: the folders and GGUFs (cache dir)
    python benchmarks/real_shapes_served.py                # every model, 3 alternated rounds
    python benchmarks/real_shapes_served.py --quick --models gemma-3-1b --out build/real.json
    python benchmarks/real_shapes_served.py --check-load   # only: does each server load each model?
    python benchmarks/real_shapes_served.py --markdown build/real.json   # docs/benchmarks.md's table

Models: the random-weight folders of `benchmarks/real_shape_models.py` (Gemma-3-1B, Phi-4-mini,
Llama-3.2-1B, the 2.1B Qwen3-MoE) and the GGUFs made from them with llama.cpp's converter and
llama-quantize. Servers, per model:

- `ours-gguf`: `python -m server` on the GGUF (`--gguf-type`, default Q4_K_M), our defaults but a KV
  cache of 8,192 tokens (llama-server's context: resident memory compares like with like);
- `ours-gguf-loop`: ours-gguf with `KUBEINFER_MOE_FUSED=0` (MoE experts one kernel call each from Python,
  the path before the fused experts call): `--phases ours-gguf,ours-gguf-loop` is a before/after run;
- `ours-hf`: the same on the bf16 folder;
- `llama`: llama.cpp's llama-server on the same GGUF (2 threads, 16 slots sharing one 8,192-token KV
  region `-kvu`, so one slot can take the long prompt);
- `vllm-bf16`: vLLM's CPU build on the folder in bfloat16 (`VLLM_CPU_KVCACHE_SPACE=2` GiB).

Memory is shared, so at most two servers are up at once: each `--phases` entry is a group started
together whose loads then run in alternated rounds (the order reversed in odd rounds); the default pairs
the two that serve the same weights (ours-gguf with llama, ours-hf with vllm-bf16). Ratios within a
phase come from the same rounds; ratios across phases (e.g. ours-gguf against vllm-bf16) are marked
`"same_phase": false` and compare runs minutes apart. A model whose bf16 folder does not fit next to
another server (`--max-bf16-gib`) skips vllm-bf16 and ours-hf with the reason.

Loads (the chat API, streaming, greedy unless `--sampling` (e.g. `temperature=0.7,top_p=0.9`: every
request's sampling fields), `ignore_eos`, `--max-tokens` new tokens): 1 user and 16 users
at `--prompt-tokens` (128) after the chat template, and one request with a `--long-prompt-tokens`
(4,096) prompt (its TTFT; Gemma-3's 512-token windows matter there). Per run: output tokens/s, TTFT p50,
ITL p99 (peers_side_by_side.py's client). Per server: the resident memory of its process tree once loaded
and warmed (before any load: weights, KV cache and runtime) and after the runs, from /proc, each read at
rest (`REST_S` idle first; `rss_bytes_warm`: right after the warm-up requests). The CPU
(model and flags), the usable features and the load average before and after each run are recorded.
`--quick`: 1 round, 2 requests at 1 user, 16 at 16 users, 16 new tokens: proves every path on a busy
machine (figures "under load").

`--loads` adds issue 49's named loads (`real_shape_loads.py`: 64 users, 128 users queued behind ours'
`--max-num-seqs` 64 and llama-server's 16 slots, 8 users of 2,048- or 8,192-token prompts with the ITL
of decoding streams split by other streams' prefill windows, 32 users over a 2,048-token shared prefix
with the prefix-cache hit rate); `--users` with no value runs only those. Every server's KV cache is
sized to the heaviest load (`context_tokens`), so resident memory compares like with like only within
one run. After each run ours' /metrics must read no running or waiting request and no KV block held
(`engine_after_run`), and a run lists its failed requests by error. `--ours-variant LABEL=ARGS` adds
`ours-gguf-LABEL` / `ours-hf-LABEL` for `--phases` (e.g. `itl2=--prefill-itl-factor 2`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from peers_side_by_side import (  # noqa: E402
    DEFAULT_PEERS_DIR,
    GREEDY,
    PromptMaker,
    Running,
    _alive,
    _free_port,
    _loadavg,
    _median,
    _uptime,
    cpu_info,
    poll_ready,
    rss_bytes,
    stop,
    tree_cpu_s,
    usable_features,
)
from peers_side_by_side import Spec as _PeerSpec  # noqa: E402
from real_shape_loads import (  # noqa: E402
    NAMED,
    Load,
    engine_state,
    named_load,
    prefix_cache_delta,
    read_metrics,
    run_streams,
    summarize_streams,
)
from real_shape_models import DEFAULT_MODELS, DEFAULT_OUT, SHAPES, gguf_path  # noqa: E402

# seconds every server is left idle before its resident memory is read (loaded, after the runs): memory
# at rest, once ours has handed its steps' freed heap back (server/engine.py: IDLE_TRIM_S = 2 s after the
# last step, checked every 0.5 s), with time to spare on a loaded CPU
REST_S = 4.0
SERVERS = ("ours-gguf", "ours-gguf-loop", "ours-hf", "llama", "vllm-bf16")
LABELS = {
    "ours-gguf": "kubeinfer on the GGUF",
    "ours-gguf-loop": "kubeinfer on the GGUF, MoE experts one torch call each (KUBEINFER_MOE_FUSED=0)",
    "ours-hf": "kubeinfer on the bf16 folder",
    "llama": "llama.cpp llama-server on the GGUF",
    "vllm-bf16": "vLLM (CPU build) on the folder, bfloat16",
}
DEFAULT_PHASES = ("ours-gguf,llama", "ours-hf,vllm-bf16")
METRICS = (
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "itl_p99_during_other_prefill_s",
    "itl_p99_quiet_s",
    "prefix_cache_hit_rate",
)
KV_GIB = 2  # vLLM's KV budget (VLLM_CPU_KVCACHE_SPACE, whole GiB)
CONTEXT_TOKENS = 8192  # llama-server's -c and ours' KV capacity: resident memory compares like with like
OURS_MAX_NUM_SEQS = 64  # ours' default --max-num-seqs (server/cli.py): 128_users_queued queues half
LLAMA_SLOTS = 16  # llama-server's -np


def metric(run: dict[str, Any], name: str) -> float | None:
    """One figure of a run row; None for a run with failed requests (it measured something else)."""
    if run.get("completed", 0) < run.get("requests", 1):
        return None
    split = run.get("itl_split_s") or {}
    hit = (run.get("prefix_cache") or run.get("prefix_cache_from_responses") or {}).get("hit_rate")
    v = {
        "output_tokens_per_s": run.get("output_tokens_per_s"),
        "ttft_p50_s": (run.get("ttft_s") or {}).get("p50"),
        "ttft_p99_s": (run.get("ttft_s") or {}).get("p99"),
        "itl_p50_s": (run.get("itl_s") or {}).get("p50"),
        "itl_p99_s": (run.get("itl_s") or {}).get("p99"),
        "itl_p99_during_other_prefill_s": (split.get("during_other_prefill") or {}).get("p99"),
        "itl_p99_quiet_s": (split.get("quiet") or {}).get("p99"),
        "prefix_cache_hit_rate": hit,
    }[name]
    return float(v) if v is not None else None


def context_tokens(loads: list[Load], max_tokens: int) -> int:
    """KV tokens every server is given: 8,192 (llama-server's default-sized context, so resident memory
    compares like with like) or what the heaviest load holds at once, rounded up to 1,024. llama-server's
    slots each hold their own copy of a shared prefix, so a shared-prefix load counts it per user."""
    need = max(
        (min(ld.users, ld.requests) * (ld.longest_prompt + max_tokens) for ld in loads),
        default=0,
    )
    return max(CONTEXT_TOKENS, -(-need // 1024) * 1024)


def _sampling_fields(text: str) -> dict[str, float]:
    """ "temperature=0.7,top_p=0.9" -> {"temperature": 0.7, "top_p": 0.9} (top_k an int)."""
    fields: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or name not in ("temperature", "top_p", "top_k", "min_p", "seed"):
            raise argparse.ArgumentTypeError(
                f"{item!r}: want name=value, name one of temperature, top_p, top_k, min_p, seed"
            )
        fields[name] = int(value) if name in ("top_k", "seed") else float(value)
    return fields


def base_server(name: str) -> str:
    """`ours-gguf-LABEL` -> `ours-gguf` (a variant of --ours-variant); others unchanged."""
    for base in ("ours-gguf", "ours-hf"):
        if name.startswith(base + "-"):
            return base
    return name


def kv_bytes(folder: Path, tokens: int = CONTEXT_TOKENS) -> int:
    """Bytes of a bf16 KV cache holding `tokens` tokens in every layer of the model in `folder`
    (config.json): what ours is given with --kv-cache-memory, so that its resident memory and
    llama-server's (an f16 cache of -c tokens, less on sliding-window layers) hold the same context."""
    cfg = json.loads((folder / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * 2  # K and V, bf16
    return per_token * tokens


@dataclass(frozen=True)
class Target:
    """One server on one model: `model_path` is the folder or the GGUF file it serves."""

    server: str
    model: str
    model_path: Path


def command(
    t: Target,
    port: int,
    peers_dir: Path,
    threads: int,
    context: int = CONTEXT_TOKENS,
    max_len: int = CONTEXT_TOKENS,
    variants: dict[str, list[str]] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start `t` on 127.0.0.1:`port` with a KV cache of `context`
    tokens and requests of up to `max_len` tokens; `variants`: extra arguments of ours' variants (label ->
    argv)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if t.server.startswith("ours"):
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        if t.server == "ours-gguf-loop":  # the MoE experts' former path, for before/after phases
            env["KUBEINFER_MOE_FUSED"] = "0"
        cmd = [sys.executable, "-m", "server", "--model", str(t.model_path), "--served-model-name", t.model]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-concurrent-requests", "1024"]
        folder = t.model_path.parent if t.model_path.suffix == ".gguf" else t.model_path
        kv = str(kv_bytes(folder, context)) if (folder / "config.json").is_file() else f"{KV_GIB}GiB"
        cmd += ["--log-level", "info", "--kv-cache-memory", kv, "--max-total-tokens", str(max_len)]
        template = t.model_path.parent / "chat_template.jinja"
        if t.model_path.suffix == ".gguf" and template.is_file():
            # the GGUF holds the template, but our GGUF tokenizer reader (transformers') loses it for
            # llama.cpp-converted files: the folder's same template, as a user would pass it
            cmd += ["--chat-template", str(template)]
        base = base_server(t.server)
        if base != t.server:
            cmd += (variants or {})[t.server[len(base) + 1 :]]
        return cmd, env
    if t.server == "llama":
        cmd = [str(peers_dir / "llama-server"), "-m", str(t.model_path), "-a", t.model, "--host", "127.0.0.1"]
        cmd += [
            "--port",
            str(port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-c",
            str(context),
            "-np",
            str(LLAMA_SLOTS),
        ]
        cmd += ["-cb", "-kvu", "--no-webui", "--metrics"]
        return cmd, env
    if t.server == "vllm-bf16":
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(KV_GIB),
            VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        cmd = [str(peers_dir / "venv-vllm" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", str(t.model_path), "--served-model-name", t.model, "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(max_len)]
        return cmd, env
    raise ValueError(f"unknown server {t.server!r}; expected one of {SERVERS}")


def launch(t: Target, peers_dir: Path, threads: int, **kw: Any) -> Running:
    """Starts `t` in the background (its own process group, log in a temp file); `kw` as `command`'s."""
    port = _free_port()
    cmd, env = command(t, port, peers_dir, threads, **kw)
    log = Path(tempfile.mkstemp(prefix=f"real-{t.model}-{t.server}-", suffix=".log")[1])
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    spec = _PeerSpec(t.server, "ours" if t.server.startswith("ours") else t.server)
    return Running(spec, f"http://127.0.0.1:{port}", proc.pid, log, shlex.join(cmd), proc)


def wait_all(servers: list[Running], timeout_s: float) -> dict[int, str]:
    """Polls `servers` together until each lists its model (its `ready_s` the time it took); returns
    pid -> why for those that exited or timed out (stopped)."""
    failed: dict[int, str] = {}
    pending = list(servers)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for srv in list(pending):
            try:
                if poll_ready(srv):
                    pending.remove(srv)
            except RuntimeError as e:
                pending.remove(srv)
                failed[srv.pid] = str(e)[-1500:]
        time.sleep(1.0)
    failed.update({srv.pid: f"not ready after {timeout_s} s; log {srv.log}" for srv in pending})
    for srv in servers:
        if srv.pid in failed:
            stop(srv)
    return failed


def why_missing(t: Target, peers_dir: Path) -> str | None:
    if not t.model_path.exists():
        return f"{t.model_path} does not exist: run benchmarks/real_shape_models.py"
    need = {"llama": peers_dir / "llama-server", "vllm-bf16": peers_dir / "venv-vllm" / "bin" / "python"}
    exe = need.get(base_server(t.server))
    if exe is not None and not os.access(exe, os.X_OK):
        return f"{exe} is missing: run ../shared/peers/setup.sh"
    return None


def folder_gib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**30


def _hwm_bytes(pid: int) -> int | None:
    """Peak resident memory (VmHWM) summed over `pid`'s process tree."""
    from peers_side_by_side import process_tree

    total, seen = 0, False
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
                    seen = True
        except OSError:
            pass
    return total if seen else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """model -> server -> load -> metric -> median over rounds."""
    out: dict[str, Any] = {}
    for r in runs:
        out.setdefault(r["model"], {}).setdefault(r["server"], {}).setdefault(r["load"], []).append(r)
    return {
        m: {
            s: {ld: {k: _median([metric(r, k) for r in rs]) for k in METRICS} for ld, rs in loads.items()}
            for s, loads in servers.items()
        }
        for m, servers in out.items()
    }


def ratios(runs: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
    """model -> `ours_vs_peer` -> load -> metric -> {median, same_phase}: within a phase the median of the
    per-round ratios; across phases the ratio of the medians."""
    out: dict[str, Any] = {}
    for model, servers in summary.items():
        for a in (s for s in servers if s.startswith("ours")):
            for b in (s for s in servers if not s.startswith("ours")):
                mine = [r for r in runs if r["model"] == model]
                pa = {r["phase"] for r in mine if r["server"] == a}
                same = bool(pa & {r["phase"] for r in mine if r["server"] == b})
                pair: dict[str, Any] = {}
                for load in servers[a]:
                    if load not in servers[b]:
                        continue
                    per: dict[str, Any] = {}
                    for k in METRICS:
                        if same:
                            by = {(r["server"], r["round"]): metric(r, k) for r in mine if r["load"] == load}
                            rounds = sorted({rd for _, rd in by})
                            vals = [
                                round(va / vb, 3)
                                if (va := by.get((a, rd))) and (vb := by.get((b, rd)))
                                else None
                                for rd in rounds
                            ]
                            per[k] = {"median": _median(vals), "rounds": vals, "same_phase": True}
                        else:
                            va, vb = servers[a][load][k], servers[b][load][k]
                            per[k] = {"median": round(va / vb, 3) if va and vb else None, "same_phase": False}
                    pair[load] = per
                out.setdefault(model, {})[f"{a}_vs_{b}"] = pair
    return out


def memory_ratios(servers: dict[str, Any]) -> dict[str, Any]:
    """model -> ours-gguf's resident memory once loaded over llama-server's (issue 49 item 4: <= 1.2)."""
    out: dict[str, Any] = {}
    for model, per in servers.items():
        a, b = per.get("ours-gguf", {}), per.get("llama", {})
        if a.get("rss_bytes_loaded") and b.get("rss_bytes_loaded"):
            out[model] = {
                "loaded": round(a["rss_bytes_loaded"] / b["rss_bytes_loaded"], 3),
                "after_runs": round(a["rss_bytes_after_runs"] / b["rss_bytes_after_runs"], 3)
                if a.get("rss_bytes_after_runs") and b.get("rss_bytes_after_runs")
                else None,
            }
    return out


def markdown(report: dict[str, Any]) -> str:
    """docs/benchmarks.md's table of a report: model x load x metric, each server's median, ours-gguf
    against llama (same GGUF) and ours-hf against vllm-bf16 (same folder), and resident memory."""
    head = "| model | load | metric | ours GGUF | llama.cpp | ratio | ours bf16 | vLLM bf16 | ratio |"
    rows = [head, "|" + "---|" * 9]
    summary, rat = report.get("summary", {}), report.get("ratios", {})

    def fmt(v: float | None, unit: str = "") -> str:
        return "" if v is None else f"{v:.3g}{unit}"

    for model, servers in summary.items():
        loads = list(dict.fromkeys(ld for per in servers.values() for ld in per))
        for ld in loads:
            for k, unit in (("output_tokens_per_s", ""), ("ttft_p50_s", " s"), ("itl_p99_s", " s")):
                cells = []
                for a, b in (("ours-gguf", "llama"), ("ours-hf", "vllm-bf16")):
                    va = servers.get(a, {}).get(ld, {}).get(k)
                    vb = servers.get(b, {}).get(ld, {}).get(k)
                    r = rat.get(model, {}).get(f"{a}_vs_{b}", {}).get(ld, {}).get(k, {}).get("median")
                    cells += [fmt(va, unit), fmt(vb, unit), "" if r is None else f"{r:.2f}x"]
                rows.append(f"| {model} | {ld} | {k} | " + " | ".join(cells) + " |")
        mem = report.get("servers", {}).get(model, {})
        gib = {s: (v.get("rss_bytes_loaded") or 0) / 2**30 for s, v in mem.items()}
        if gib:
            r = report.get("memory_ours_gguf_vs_llama", {}).get(model, {}).get("loaded")
            cells = [
                fmt(gib.get("ours-gguf"), " GiB"),
                fmt(gib.get("llama"), " GiB"),
                "" if r is None else f"{r:.2f}x",
                fmt(gib.get("ours-hf"), " GiB"),
                fmt(gib.get("vllm-bf16"), " GiB"),
                "",
            ]
            rows.append(f"| {model} | loaded, at rest | resident memory | " + " | ".join(cells) + " |")
    return "\n".join(rows)


async def settled_metrics(url: str, timeout_s: float = 15.0) -> dict[str, float] | None:
    """/metrics once the server says no request runs or waits (streams end on the client a moment
    before the engine frees them), or the last read after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = await read_metrics(url)
        if values is None or time.monotonic() > deadline:
            return values
        state = engine_state(values)
        if not state["num_requests_running"] and not state["num_requests_waiting"]:
            return values
        await asyncio.sleep(0.5)


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(f"signal {signum}")  # so that `finally` stops the servers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list(SHAPES))
    ap.add_argument("--models-dir", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--gguf-type", default="Q4_K_M", help="the GGUF ours-gguf and llama serve (Q4_K_M, Q8_0)")
    ap.add_argument("--phases", nargs="+", default=list(DEFAULT_PHASES), help="comma-separated servers")
    ap.add_argument("--users", nargs="*", type=int, default=[1, 16], help="none: only --loads")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--long-prompt-tokens", type=int, default=4096, help="0: no long-prompt load")
    ap.add_argument(
        "--loads",
        nargs="*",
        default=[],
        choices=NAMED,
        help="named loads after the --users ones (real_shape_loads.py; issue 49 item 2)",
    )
    ap.add_argument("--long-users", type=int, default=8, help="users of the N_users_*_prompt loads")
    ap.add_argument(
        "--ours-variant",
        action="append",
        default=[],
        metavar="LABEL=ARGS",
        help="adds servers ours-gguf-LABEL / ours-hf-LABEL (for --phases): ours with ARGS appended",
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-user", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=4, help="at least this many at 1 user")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 round, fewer requests, 16 new tokens")
    ap.add_argument("--check-load", action="store_true", help="start each, one request, memory, stop")
    ap.add_argument(
        "--max-bf16-gib", type=float, default=9.0, help="largest bf16 folder served next to another"
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's and vLLM's threads")
    ap.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    ap.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds (vLLM compiles at start)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--sampling",
        type=_sampling_fields,
        default=GREEDY,
        help="comma-separated name=value sampling fields of every request (default temperature=0: greedy)",
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here (after every run)")
    ap.add_argument("--markdown", type=Path, default=None, help="only print this JSON report's table")
    args = ap.parse_args()
    if args.markdown is not None:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    if args.quick:
        args.rounds, args.max_tokens, args.min_requests, args.requests_per_user = 1, 16, 2, 1
    variants: dict[str, list[str]] = {}
    for v in args.ours_variant:
        label, sep, rest = v.partition("=")
        if not sep or not label:
            ap.error(f"--ours-variant wants LABEL=ARGS, got {v!r}")
        variants[label] = shlex.split(rest)
    known = [*SERVERS, *(f"{b}-{lb}" for b in ("ours-gguf", "ours-hf") for lb in variants)]
    phases = [p.split(",") for p in args.phases]
    for p in phases:
        for s in p:
            if s not in known:
                ap.error(f"--phases: unknown server {s!r}; expected {known}")
    signal.signal(signal.SIGTERM, _on_sigterm)

    loads = [
        Load(
            f"{u}_user{'s' if u > 1 else ''}",
            u,
            max(args.min_requests if u == 1 else 0, u * args.requests_per_user),
            args.prompt_tokens,
        )
        for u in args.users
    ]
    if args.long_prompt_tokens:
        loads.append(Load(f"1_user_{args.long_prompt_tokens}_prompt", 1, 1, args.long_prompt_tokens))
    loads += [named_load(n, args.requests_per_user, args.long_users, args.prompt_tokens) for n in args.loads]
    if args.check_load:
        loads = [Load("check", 1, 1, 32)]
        args.rounds, args.max_tokens = 1, 8
    context = context_tokens(loads, args.max_tokens)
    # the chat template's tokens are in the prompt counts; a margin for a tokenizer's rounding
    max_len = max(CONTEXT_TOKENS, max(ld.longest_prompt for ld in loads) + args.max_tokens + 64)

    report: dict[str, Any] = {
        "benchmark": "real-shape models, chat API, streaming, greedy, ignore_eos; two servers up at a time",
        "config": {
            "models": args.models,
            "gguf_type": args.gguf_type,
            "phases": phases,
            "loads": [vars(ld) for ld in loads],
            "max_tokens": args.max_tokens,
            "sampling": args.sampling,
            "rounds": args.rounds,
            "quick": args.quick,
            "check_load": args.check_load,
            "kv_cache_gib": KV_GIB,
            "context_tokens": context,
            "max_len_tokens": max_len,
            "ours_max_num_seqs": OURS_MAX_NUM_SEQS,
            "llama_slots": LLAMA_SLOTS,
            "ours_variants": variants,
        },
        "machine": {
            "cpu": cpu_info(),
            "lscpu_model": subprocess.run(
                ["bash", "-c", "lscpu | grep -i 'model name'"], capture_output=True, text=True, check=False
            ).stdout.strip(),
            "usable_features": usable_features(),
            "uptime_at_start": _uptime(),
            "note": "shared by several engineers' processes while this ran: compare ratios, not absolutes",
        },
        "servers": {},
        "skipped": {},
        "runs": [],
    }

    def write() -> None:
        report["summary"] = summarize(report["runs"])
        report["ratios"] = ratios(report["runs"], report["summary"])
        report["memory_ours_gguf_vs_llama"] = memory_ratios(report["servers"])
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")

    running: list[Running] = []
    try:
        for model in args.models:
            folder = args.models_dir / model
            by_base = {
                "ours-gguf": gguf_path(folder, args.gguf_type),
                "ours-gguf-loop": gguf_path(folder, args.gguf_type),
                "llama": gguf_path(folder, args.gguf_type),
                "ours-hf": folder,
                "vllm-bf16": folder,
            }
            path = {s: by_base[base_server(s)] for s in known}
            maker = PromptMaker(folder) if folder.is_dir() else None
            prompts = (
                {
                    (ld.name, rnd): maker.prompts(
                        ld.requests,
                        ld.prompt_tokens,
                        1000 * (rnd + 1) + ld.users + ld.prompt_tokens,
                        ld.prefix_tokens,
                    )
                    for ld in loads
                    for rnd in range(args.rounds)
                }
                if maker
                else {}
            )
            warm = maker.prompts(4, args.prompt_tokens, 7) if maker else []
            for phase_no, phase in enumerate(phases):
                targets = []
                for s in phase:
                    t = Target(s, model, path[s])
                    why = why_missing(t, args.peers_dir)
                    if (
                        why is None
                        and base_server(s) in ("ours-hf", "vllm-bf16")
                        and folder_gib(folder) > args.max_bf16_gib
                    ):
                        why = f"bf16 folder {folder_gib(folder):.1f} GiB > --max-bf16-gib {args.max_bf16_gib}"
                    if why is None:
                        targets.append(t)
                    else:
                        report["skipped"][f"{model}/{s}"] = why
                        print(f"skipping {model}/{s}: {why}", file=sys.stderr, flush=True)
                up: list[Running] = []
                started = [  # loaded together
                    (
                        t,
                        launch(
                            t,
                            args.peers_dir,
                            args.threads,
                            context=context,
                            max_len=max_len,
                            variants=variants,
                        ),
                    )
                    for t in targets
                ]
                running += [srv for _, srv in started]
                failed = wait_all([srv for _, srv in started], args.ready_timeout)
                for t, srv in started:
                    why = failed.get(srv.pid)
                    if why:
                        running.remove(srv)
                        report["skipped"][f"{model}/{t.server}"] = f"failed to start: {why}"
                        print(f"{model}/{t.server} failed: {why}", file=sys.stderr, flush=True)
                        continue
                    # compile, caches, pages: one alone, then a small batch
                    asyncio.run(run_streams(srv.url, srv.model or "", warm[:1], 1, args.max_tokens))
                    asyncio.run(run_streams(srv.url, srv.model or "", warm, 4, args.max_tokens))
                    report["servers"].setdefault(model, {})[t.server] = {
                        "what": LABELS[base_server(t.server)]
                        + (f" ({t.server})" if t.server != base_server(t.server) else ""),
                        "command": srv.command,
                        "model_path": str(t.model_path),
                        "ready_s": srv.ready_s,
                        "rss_bytes_warm": rss_bytes(srv.pid),  # right after the warm-up requests
                        "load_average_at_ready": _loadavg(),
                    }
                    up.append(srv)
                    print(f"{model}/{t.server} up after {srv.ready_s} s", file=sys.stderr, flush=True)
                time.sleep(REST_S)
                for srv in up:
                    report["servers"][model][srv.spec.name]["rss_bytes_loaded"] = rss_bytes(srv.pid)
                for ld in loads:
                    for rnd in range(args.rounds):
                        for srv in up if rnd % 2 == 0 else list(reversed(up)):
                            if not _alive(srv):
                                continue
                            cpu0, load0 = tree_cpu_s(srv.pid), _loadavg()
                            m0 = asyncio.run(read_metrics(srv.url))
                            streams, wall = asyncio.run(
                                run_streams(
                                    srv.url,
                                    srv.model or "",
                                    prompts[(ld.name, rnd)],
                                    ld.users,
                                    args.max_tokens,
                                    sampling=args.sampling,
                                )
                            )
                            res = summarize_streams(streams, wall, ld.split_itl)
                            res["users"] = ld.users
                            m1 = asyncio.run(settled_metrics(srv.url))
                            if m0 is not None and m1 is not None:
                                res["prefix_cache"] = prefix_cache_delta(m0, m1)
                                res["engine_after_run"] = engine_state(m1)
                            row = {
                                "model": model,
                                "server": srv.spec.name,
                                "phase": phase_no,
                                "load": ld.name,
                                "round": rnd,
                                "load_average_before": load0,
                                "load_average_after": _loadavg(),
                                "server_cpu_s": round(tree_cpu_s(srv.pid) - cpu0, 2),
                                **res,
                            }
                            if not _alive(srv):
                                row["errors"] = [*row["errors"], f"exited; log {srv.log}"]
                            report["runs"].append(row)
                            print(json.dumps(row), file=sys.stderr, flush=True)
                            write()
                time.sleep(REST_S)
                for srv in up:
                    info = report["servers"][model][srv.spec.name]
                    info["rss_bytes_after_runs"] = rss_bytes(srv.pid)
                    info["peak_rss_bytes"] = _hwm_bytes(srv.pid)
                for srv in list(running):
                    stop(srv)
                    running.remove(srv)
                write()
    finally:
        for srv in running:
            stop(srv)
    report["machine"]["uptime_at_end"] = _uptime()
    write()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
