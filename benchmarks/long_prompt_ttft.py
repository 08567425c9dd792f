"""Long prompts, before vs after a change, alternated in one run (issue 49: 8 users x 3,000-token prompts,
TTFT p50 14.2 s against vLLM's 7.8 s). Prints JSON.

Two servers of ours start side by side on the embedded model: `--baseline REF` (that commit's tree,
extracted with `git archive` into a temporary folder) and the working tree. Each round runs both loads
against one server, then the other (which one goes first alternates), so a shared machine's load falls
on both alike; compare the ratios, not the absolutes.

- burst: `--users` users each send one prompt of `--prompt-len` words (about one token each) at once,
  `--max-new-tokens` greedy tokens each (TGI's /generate_stream): TTFT p50/p90, ITL p50/p99, the last
  request's end.
- stream: one stream decodes (`--stream-tokens`, short prompt); after its 16th token one prompt of
  `--long-len` words arrives: the stream's ITL while that prompt prefills (its arrival to its first
  token) against the stream's own ITL before it arrived ("quiet"), p50/p99/max, and the long prompt's
  TTFT. Issue 49's target: the running stream's ITL p99 <= 2x its quiet ITL.

    python benchmarks/long_prompt_ttft.py --baseline c3b4a1e [--users 8 --prompt-len 3000
        --max-new-tokens 64 --long-len 6000 --rounds 2 --num-threads 2 --server-args '...']
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from serve_load import REPO, _free_port, _pct, _r, _wait_ready, make_prompts, one_request


def _extract(ref: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix="long_prompt_baseline-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def _start(tree: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [
        sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port),
        "--max-concurrent-requests", "1024", "--log-level", "warning",
        "--max-total-tokens", str(args.max_total_tokens),
    ]  # fmt: skip
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    cmd += args.server_args.split()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(str(tree / p) for p in ("", "operator", "kernels"))
    log = tempfile.NamedTemporaryFile(prefix="long_prompt-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait_ready(url, proc)
    return proc, url


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


async def burst(url: str, prompts: list[str], max_new_tokens: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, url, p, max_new_tokens) for p in prompts))
    ok = [r for r in results if r.ok and r.token_times]
    ttft = [r.token_times[0] - r.start for r in ok]
    itl = [g for r in ok for g in _gaps(r.token_times)]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "ttft_s": {"p50": _r(_pct(ttft, 50)), "p90": _r(_pct(ttft, 90))},
        "itl_s": {"p50": _r(_pct(itl, 50)), "p99": _r(_pct(itl, 99))},
        "last_end_s": _r(max(r.end for r in results) - t0),
    }


async def stream_beside_long(url: str, short: str, long: str, stream_tokens: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        body = {"inputs": short, "parameters": {"max_new_tokens": stream_tokens}}
        times: list[float] = []
        arrived = asyncio.Event()

        async def stream() -> None:
            async with client.stream("POST", f"{url}/generate_stream", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and json.loads(line[5:]).get("token") is not None:
                        times.append(time.perf_counter())
                        if len(times) == 16:
                            arrived.set()

        task = asyncio.create_task(stream())
        await arrived.wait()
        long_result = await one_request(client, url, long, 2)
        await task
    if not long_result.ok or not long_result.token_times:
        return {"failed": long_result.error}
    start, first = long_result.start, long_result.token_times[0]
    quiet = _gaps([t for t in times if t <= start])
    # gaps that end after the long prompt arrived and no later than its first token
    during = [b - a for a, b in itertools.pairwise(times) if start < b <= first]
    quiet_p50 = statistics.median(quiet)
    return {
        "long_prompt_ttft_s": _r(first - start),
        "stream_quiet_itl_s": {"p50": _r(quiet_p50), "p99": _r(_pct(quiet, 99))},
        "stream_itl_during_prefill_s": {
            "p50": _r(_pct(during, 50)),
            "p99": _r(_pct(during, 99)),
            "max": _r(max(during, default=None) if during else None),
            "count": len(during),
        },
        "itl_p99_during_over_quiet_p50": _r((_pct(during, 99) or 0.0) / quiet_p50),
    }


def _median_of(rounds: list[dict[str, Any]], *path: str) -> float | None:
    values = []
    for r in rounds:
        v: Any = r
        for key in path:
            v = v.get(key) if isinstance(v, dict) else None
        if isinstance(v, int | float):
            values.append(float(v))
    return round(statistics.median(values), 4) if values else None


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git ref of the 'before' tree")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=3000, help="words (about one token each)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--long-len", type=int, default=6000, help="the stream scenario's long prompt, words")
    ap.add_argument("--stream-tokens", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-total-tokens", type=int, default=8192)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--skip", choices=["burst", "stream"], default=None)
    ap.add_argument(
        "--server-args",
        default="",
        help="more flags for both servers, e.g. '--max-num-batched-tokens 512' to scale the regime of "
        "prompts longer than a step's budget down to a loaded machine",
    )
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # still stops the servers (finally below)

    trees = {"before": _extract(args.baseline), "after": REPO}
    servers = {name: _start(tree, args) for name, tree in trees.items()}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {n: {"burst": [], "stream": []} for n in trees}
    try:
        for rnd in range(args.rounds):
            order = ["before", "after"] if rnd % 2 == 0 else ["after", "before"]
            prompts = make_prompts(args.users, args.prompt_len, 0, seed=100 + rnd)
            short, long = make_prompts(2, args.long_len, 0, seed=200 + rnd)
            for name in order:
                url = servers[name][1]
                if args.skip != "burst":
                    res = asyncio.run(burst(url, prompts, args.max_new_tokens))
                    runs[name]["burst"].append(res)
                    print(json.dumps({"round": rnd, "server": name, "burst": res}), file=sys.stderr)
                if args.skip != "stream":
                    res = asyncio.run(stream_beside_long(url, short[:200], long, args.stream_tokens))
                    runs[name]["stream"].append(res)
                    print(json.dumps({"round": rnd, "server": name, "stream": res}), file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    summary = {
        name: {
            "burst_ttft_p50_s": _median_of(r["burst"], "ttft_s", "p50"),
            "burst_ttft_p90_s": _median_of(r["burst"], "ttft_s", "p90"),
            "burst_itl_p99_s": _median_of(r["burst"], "itl_s", "p99"),
            "burst_last_end_s": _median_of(r["burst"], "last_end_s"),
            "stream_long_ttft_s": _median_of(r["stream"], "long_prompt_ttft_s"),
            "stream_itl_p99_during_s": _median_of(r["stream"], "stream_itl_during_prefill_s", "p99"),
            "stream_itl_quiet_p50_s": _median_of(r["stream"], "stream_quiet_itl_s", "p50"),
        }
        for name, r in runs.items()
    }
    print(
        json.dumps(
            {
                "model": "SmolLM2-135M-Instruct (embedded)",
                "baseline": args.baseline,
                "cpu": _cpu(),
                "load_average_at_start": os.getloadavg(),
                "args": vars(args),
                "summary_medians": summary,
                "runs": runs,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
