"""Gemma 2's soft-capped attention in prefill: the backends' own paths against the per-sequence torch loop
that served soft-capped layers before (server/models/softcap_attention.py until 2026-12-05, kept here as
`_PerSequenceLoop`), alternated in one process on one engine. Prints JSON.

    python benchmarks/softcap_prefill.py                          # 4 layers, hidden 1024, head_dim 256
    python benchmarks/softcap_prefill.py --kv-cache-dtype bfloat16 --head-dim 128   # the bf16 prefill kernel
    python benchmarks/softcap_prefill.py --users 16 --prompt 128 --max-tokens 32 --dtype bfloat16  # serving
    python benchmarks/softcap_prefill.py --smoke                  # tiny: checks the script

A random-weight Gemma 2 (transformers' config and init, fp32, windowed and global layers alternating,
attn_logit_softcapping 50 as Gemma 2 ships) is written to a temporary folder; each round sends `--users`
fresh prompts (no prefix-cache hit) of `--prompt` tokens with `--max-tokens` (default 1: prefill only),
chunked at `--chunk` tokens per step, through the engine twice: once with the engine's backend (new), once with the backend wrapped so that soft-capped
calls run the old loop (old). Reported: each variant's per-round wall and process CPU ms (all threads), the
wall ms inside the attention calls, and the median old/new ratios of CPU ms and of attention ms. Compare ratios only on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from server.attention import AttentionMetadata
from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _per_sequence_loop(
    q: Tensor,  # [T, Hq, D]
    k: Tensor,  # [T, Hkv, D]
    v: Tensor,  # [T, Hkv, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    softcap: float,
    sliding_window: int | None,
) -> Tensor:  # [T, Hq, D]
    """The code soft-capped layers ran before: store, then each sequence in plain fp32 torch."""
    hkv, d = k.shape[1], k.shape[2]
    block_size = k_cache.shape[1]
    k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    out = torch.empty_like(q)
    group = q.shape[1] // hkv
    start = 0
    for i, n in enumerate(meta.query_lens_cpu):
        ctx = meta.context_lens_cpu[i]
        nb = -(-ctx // block_size)
        blocks = meta.block_tables[i, :nb].to(torch.int64)
        keys = k_cache[blocks].reshape(-1, hkv, d)[:ctx].float().repeat_interleave(group, 1).transpose(0, 1)
        vals = v_cache[blocks].reshape(-1, hkv, d)[:ctx].float().repeat_interleave(group, 1).transpose(0, 1)
        qs = q[start : start + n].float().transpose(0, 1)
        scores = torch.matmul(qs, keys.transpose(1, 2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - n, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        masked = k_pos > q_pos
        if sliding_window is not None:
            masked |= q_pos - k_pos >= sliding_window
        probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
        out[start : start + n] = torch.matmul(probs, vals).transpose(0, 1).to(q.dtype)
        start += n
    return out


class _Timed:
    """A backend whose `forward` calls are timed (wall ms, summed; torch's CPU ops are synchronous)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.decode_kernel = getattr(inner, "decode_kernel", None)
        self.ms = 0.0

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        t = time.perf_counter()
        out = self.inner.forward(*args, **kwargs)
        self.ms += (time.perf_counter() - t) * 1000
        return out  # type: ignore[no-any-return]


class _PerSequenceLoop:
    """The engine's backend, except that soft-capped calls take the old loop."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.decode_kernel = getattr(inner, "decode_kernel", None)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                scale: float, out_dtype: torch.dtype | None = None, sliding_window: int | None = None,
                sinks: Tensor | None = None, softcap: float = 0.0) -> Tensor:  # fmt: skip
        if softcap:
            return _per_sequence_loop(q, k, v, k_cache, v_cache, meta, scale, softcap, sliding_window)
        return self.inner.forward(q, k, v, k_cache, v_cache, meta, scale, out_dtype, sliding_window, sinks)


def build_gemma2(out: Path, args: argparse.Namespace) -> Path:
    from transformers import AutoModelForCausalLM, Gemma2Config

    from server.models.loader import resolve_model

    heads = args.hidden // args.head_dim * 2  # Gemma-2-2B's ratio: 8 heads of 256 over hidden 2304
    cfg = Gemma2Config(
        vocab_size=49152,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=args.head_dim,
        query_pre_attn_scalar=args.head_dim,
        max_position_embeddings=8192,
        sliding_window=4096,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(out))
    tok = resolve_model(None).folder  # the embedded SmolLM2's tokenizer (vocab 49152)
    for name in TOKENIZER_FILES:
        if (tok / name).exists():
            shutil.copy(tok / name, out / name)
    return out


def _run(engine: LLMEngine, prompts: list[list[int]], rid: str, max_tokens: int) -> tuple[float, float]:
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"{rid}-{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        )
    wall, cpu = time.perf_counter(), time.process_time()
    while engine.scheduler.has_unfinished():
        engine.step()
    return (time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--users", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--dtype", default="float32", help="the model's (float32: the fused CPU ops serve)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds of old and new, after a warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.head_dim, args.prompt, args.chunk, args.rounds = 2, 128, 64, 64, 32, 1
    with tempfile.TemporaryDirectory(prefix="softcap-bench-") as tmp:
        folder = build_gemma2(Path(tmp), args)
        engine = LLMEngine(
            EngineConfig(
                model=ModelConfig(model=str(folder), dtype=args.dtype),
                cache=CacheConfig(
                    block_size=16,
                    num_kv_blocks=2 * args.users * (-(-(args.prompt + args.max_tokens) // 16)) + 8,
                    enable_prefix_caching=False,
                    cache_dtype=args.kv_cache_dtype,
                ),
                max_num_batched_tokens=args.chunk,
                long_prefill_token_threshold=args.chunk,
                max_num_seqs=max(args.users, 1),
                num_threads=args.threads,
                thread_policy="fixed",
            )
        )
        new = _Timed(engine.runner.backend)
        old = _Timed(_PerSequenceLoop(engine.runner.backend))
        gen = torch.Generator().manual_seed(1)
        times: dict[str, list[tuple[float, float, float]]] = {"old": [], "new": []}
        for r in range(args.rounds + 1):
            for name, backend in (("old", old), ("new", new)) if r % 2 else (("new", new), ("old", old)):
                engine.runner.backend = backend  # type: ignore[assignment]
                backend.ms = 0.0
                prompts = [
                    torch.randint(100, 49000, (args.prompt,), generator=gen).tolist()
                    for _ in range(args.users)
                ]
                t = _run(engine, prompts, f"{name}-{r}", args.max_tokens)
                if r:  # round 0 warms both
                    times[name].append((*t, backend.ms))
        pairs = list(zip(times["old"], times["new"], strict=True))
        print(
            json.dumps(
                {
                    "layers": args.layers,
                    "hidden": args.hidden,
                    "head_dim": args.head_dim,
                    "prompt": args.prompt,
                    "chunk": args.chunk,
                    "users": args.users,
                    "max_tokens": args.max_tokens,
                    "dtype": args.dtype,
                    "backend": engine.backend_name,
                    "kv_cache_dtype": str(engine.kv_cache_dtype),
                    "threads": args.threads,
                    "old_wall_cpu_attention_ms": [[round(x) for x in t] for t in times["old"]],
                    "new_wall_cpu_attention_ms": [[round(x) for x in t] for t in times["new"]],
                    "old_over_new_cpu_median": round(statistics.median(o[1] / n[1] for o, n in pairs), 2),
                    "old_over_new_attention_median": round(
                        statistics.median(o[2] / n[2] for o, n in pairs), 2
                    ),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
