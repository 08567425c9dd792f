"""Inter-token latency with and without the prefill share cap (server/core/scheduler.py,
--long-prefill-token-threshold), interleaved in one run: two servers of ours start side by side (the cap
off: 0, and on: the default or --threshold), then the same load (serve_load.py's) runs against each in
turn, `--rounds` times per concurrency, so a shared machine's noise falls on both alike. Prints JSON.

    python benchmarks/prefill_share.py [--concurrency 16 32 --shared-prefix-len 512 --prompt-len 640
        --max-new-tokens 32 --requests-per-user 2 --rounds 2 --threshold 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from serve_load import REPO, _free_port, _wait_ready, make_prompts, run_load


def _start(threshold: int, num_threads: int | None) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [
        sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port),
        "--max-concurrent-requests", "1024", "--log-level", "warning",
        "--long-prefill-token-threshold", str(threshold),
    ]  # fmt: skip
    if num_threads:
        cmd += ["--num-threads", str(num_threads)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    log = tempfile.NamedTemporaryFile(prefix="prefill_share-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait_ready(url, proc)
    return proc, url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[16, 32])
    ap.add_argument("--prompt-len", type=int, default=640, help="words (about one token each)")
    ap.add_argument("--shared-prefix-len", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--requests-per-user", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threshold", type=int, default=256, help="the capped server's threshold")
    ap.add_argument("--num-threads", type=int, default=None)
    args = ap.parse_args()
    servers = {
        "cap_off": _start(0, args.num_threads),
        f"cap_{args.threshold}": _start(args.threshold, args.num_threads),
    }
    results: dict[str, Any] = {"args": vars(args), "runs": []}
    try:
        warm = make_prompts(4, args.prompt_len, args.shared_prefix_len, 99)
        for _, url in servers.values():
            asyncio.run(run_load(url, warm, 4, 4))
        for users in args.concurrency:
            for rnd in range(args.rounds):
                prompts = make_prompts(
                    users * args.requests_per_user, args.prompt_len, args.shared_prefix_len, rnd
                )
                order = list(servers.items()) if rnd % 2 == 0 else list(reversed(servers.items()))
                for name, (_, url) in order:
                    r = asyncio.run(run_load(url, prompts, users, args.max_new_tokens))
                    results["runs"].append({"server": name, "users": users, "round": rnd, **r})
                    print(json.dumps(results["runs"][-1]), file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
