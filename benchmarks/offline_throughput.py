"""Offline throughput: our engine vs transformers generate one request at a time (what pipeline()
does) vs transformers static batching, in the same run, all in one dtype: --dtype auto (the server's default) is bf16 where the CPU has
native bf16 and fp32 on AVX2-only CPUs, where bf16 matmuls are emulated and ~5x slower. Prints JSON.

    python benchmarks/offline_throughput.py [--num-requests 64 --prompt-len 128 --new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every run in this process, ours and the baselines, gets server/cpu_env.py's CPU runtime settings:
# importing the server package applies it, and it must happen before torch loads.
import server  # noqa: F401

# isort: split
import torch


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the first ids: they are special tokens in Llama-family vocabularies.
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


def bench_engine(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from server.config import CacheConfig, EngineConfig, ModelConfig
    from server.engine import LLMEngine
    from server.request import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=args.model, dtype=args.dtype),
            cache=CacheConfig(enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    )
    engine.warmup()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    steps = 0
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    dt = time.perf_counter() - t0
    return {
        "output_tokens": generated,
        "seconds": round(dt, 3),
        "output_tokens_per_s": round(generated / dt, 1),
        "steps": steps,
        "folder": str(engine.source.folder),
    }


def load_hf(folder: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.eval()
    return model


def bench_hf_one_at_a_time(model, prompts: list[list[int]], new_tokens: int) -> dict:  # type: ignore[no-untyped-def]
    generated = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )
            generated += out.shape[1] - len(p)
    dt = time.perf_counter() - t0
    return {
        "requests": len(prompts),
        "output_tokens": generated,
        "seconds": round(dt, 3),
        "output_tokens_per_s": round(generated / dt, 1),
    }


def bench_hf_static(model, prompts: list[list[int]], new_tokens: int, batch: int) -> dict:  # type: ignore[no-untyped-def]
    generated = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk = torch.tensor(prompts[i : i + batch])  # equal lengths: no padding needed
            out = model.generate(
                chunk,
                attention_mask=torch.ones_like(chunk),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
            generated += (out.shape[1] - chunk.shape[1]) * chunk.shape[0]
    dt = time.perf_counter() - t0
    return {
        "batch_size": batch,
        "output_tokens": generated,
        "seconds": round(dt, 3),
        "output_tokens_per_s": round(generated / dt, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--static-batch", type=int, default=32)
    ap.add_argument(
        "--one-at-a-time-requests",
        type=int,
        default=6,
        help="the sequential baseline is slow: its tokens/s is measured on this many requests",
    )
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from server.models.loader import resolve_model

    folder = str(resolve_model(args.model).folder)
    args.model = args.model or None
    probe = load_hf(folder, torch.bfloat16)
    vocab = probe.config.vocab_size
    prompts = make_prompts(args.num_requests, args.prompt_len, vocab, seed=0)
    from server.models.loader import resolve_dtype

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    args.dtype = str(dtype).removeprefix("torch.")
    hf = probe if dtype == torch.bfloat16 else load_hf(folder, dtype)

    ours = bench_engine(args, prompts)
    one = bench_hf_one_at_a_time(hf, prompts[: args.one_at_a_time_requests], args.new_tokens)
    static = bench_hf_static(hf, prompts, args.new_tokens, args.static_batch)
    print(
        json.dumps(
            {
                "benchmark": "offline_throughput",
                "dtype": args.dtype,
                "threads": torch.get_num_threads(),
                "num_requests": args.num_requests,
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "kubeinfer_engine": ours,
                "hf_one_at_a_time": one,
                "hf_static_batching": static,
                "speedup_vs_one_at_a_time": round(
                    ours["output_tokens_per_s"] / one["output_tokens_per_s"], 2
                ),
                "speedup_vs_static_batching": round(
                    ours["output_tokens_per_s"] / static["output_tokens_per_s"], 2
                ),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
