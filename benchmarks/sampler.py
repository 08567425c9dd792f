"""The Sampler's cost per decode step for sampled rows: the torch path row by row against the compiled one.

    python benchmarks/sampler.py                                    # JSON, 16 and 64 rows, Llama-3's vocabulary
    python benchmarks/sampler.py --rows 1 16 64 --vocab 49152 128256 262144 --repeats 9

Random fp32 logits (N(0, std^2) for each `--logit-std`: 3 peaked as a trained model's, 0.05 nearly flat
as a random-weight model's, where top-p keeps most of the vocabulary), every row with the same settings; per vocabulary, row count
and setting the two paths run alternated `--repeats` times in this process (server/worker/sampler.py's
Sampler with and without `cpu_sampling`); reported: the median milliseconds a call and the ratio torch /
compiled (> 1: the compiled path faster). Greedy rows are listed as the reference point of a step that
samples nothing (the compiled argmax of the fused ops where the build has AVX-512).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time

import torch

from server.models.cpu_fused import try_load_fused_ops
from server.request import Request, SamplingParams
from server.worker.cpu_sampling import load_cpu_sampling
from server.worker.sampler import Sampler, SamplingRow

# what users send: the OpenAI clients' default (temperature 1), nucleus and top-k settings, min-p
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature=1": dict(temperature=1.0),
    "temperature=0.7,top_p=0.9": dict(temperature=0.7, top_p=0.9),
    "temperature=0.7,top_k=50": dict(temperature=0.7, top_k=50),
    "temperature=0.6,top_k=20,top_p=0.95": dict(temperature=0.6, top_k=20, top_p=0.95),
    "temperature=0.8,min_p=0.05": dict(temperature=0.8, min_p=0.05),
    "temperature=0.7,top_p=0.9,seed": dict(temperature=0.7, top_p=0.9, seed=7),
    # what the OpenAI API's logprobs / top_logprobs cost on top (lm-eval, agents' confidence checks)
    "greedy,logprobs=5": dict(temperature=0.0, logprobs=5),
    "temperature=0.7,top_p=0.9,logprobs=5": dict(temperature=0.7, top_p=0.9, logprobs=5),
}


def _ms(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]) -> float:
    t0 = time.perf_counter()
    sampler(logits, rows)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--vocab", nargs="+", type=int, default=[128_256])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--logit-std",
        nargs="+",
        type=float,
        default=[3.0, 0.05],
        help="the logits' spread: 3 a peaked distribution, 0.05 a nearly flat one (a random-weight model's)",
    )
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = try_load_fused_ops()
    argmax = ops.argmax_rows if ops is not None and ops.argmax_vectorized else None
    paths = {
        "torch": Sampler(argmax=argmax),
        "compiled": Sampler(argmax=argmax, cpu_sampling=load_cpu_sampling()),
    }
    g = torch.Generator().manual_seed(0)
    results = []
    for vocab in args.vocab:
        for n, std in itertools.product(args.rows, args.logit_std):
            logits = torch.randn(n, vocab, generator=g) * std
            for name in args.settings:
                params = SamplingParams(max_tokens=16, **SETTINGS[name])  # type: ignore[arg-type]
                rows = [SamplingRow(Request(f"r{i}", [1, 2, 3], params)) for i in range(n)]
                times: dict[str, list[float]] = {p: [] for p in paths}
                for _ in range(2):  # warm-up: the library's threads, the allocator
                    for sampler in paths.values():
                        sampler(logits, rows)
                for _ in range(args.repeats):
                    for p, sampler in paths.items():
                        times[p].append(_ms(sampler, logits, rows))
                med = {p: statistics.median(v) for p, v in times.items()}
                results.append(
                    {
                        "vocab": vocab,
                        "rows": n,
                        "logit_std": std,
                        "setting": name,
                        "torch_ms": round(med["torch"], 3),
                        "compiled_ms": round(med["compiled"], 3),
                        "ratio": round(med["torch"] / med["compiled"], 2),
                    }
                )
                print(json.dumps(results[-1]), flush=True)
    print(
        json.dumps(
            {
                "cpu": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
                "repeats": args.repeats,
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
