"""Where a loaded engine's resident memory goes, by kind; prints JSON.

    python benchmarks/memory_breakdown.py --model ~/.cache/kubeinfer/real-shapes/llama-3.2-1b/llama-3.2-1b-Q4_K_M.gguf

Loads the engine as the server does (no HTTP) and sums, in MiB: the block-quantized weights by format
(q, scales, mins: what BlockQuantWeight.nbytes counts), the packed copies the batched int8 path reads
(BlockQuantWeight.packed, made at load by gemm_dtype.pack_int8_weights), the other parameters and
buffers by dtype (norms, dense or dequantized tensors, rotary tables), the KV cache, and the process's
RSS (VmRSS) with what is left: the runtime (torch, oneDNN, compiled kernels, tokenizer, allocator slack).
The file's own bytes per weight are given beside ours so that the repacking's cost shows.
Run real-shape models under `flock /work/locks/realshape.lock` (one at a time machine-wide).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import server  # noqa: F401  (CPU runtime settings before torch loads)

# isort: split
import torch

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.quant.block_linear import BlockQuantEmbedding, BlockQuantLinear

MIB = 2**20


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def breakdown(engine: LLMEngine) -> dict[str, object]:
    model = engine.loaded.model
    by_fmt: dict[str, int] = defaultdict(int)
    values_per_fmt: dict[str, int] = defaultdict(int)
    copies: dict[int, int] = {}  # data_ptr -> bytes of each packed copy (a tied head has its own)
    seen: set[int] = set()  # data_ptr of tensors already counted (a tied head shares the embedding's)
    for m in model.modules():
        if not isinstance(m, BlockQuantLinear | BlockQuantEmbedding):
            continue
        w = m.weight_q
        if w.packed is not None:
            copies[w.packed.data_ptr()] = w.packed.numel()
        if w.q.data_ptr() in seen:
            continue
        seen.update(t.data_ptr() for t in w.tensors())
        by_fmt[w.fmt] += sum(t.numel() * t.element_size() for t in w.tensors())
        values_per_fmt[w.fmt] += w.out_features * w.in_features
    packed = sum(copies.values())
    dense: dict[str, int] = defaultdict(int)
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen or t.numel() == 0:
            continue
        seen.add(t.data_ptr())
        dense[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
    kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.runner.kv_caches)
    rss = rss_bytes()
    counted = sum(by_fmt.values()) + packed + sum(dense.values()) + kv
    return {
        "quantized_mib_by_format": {f: round(b / MIB, 1) for f, b in sorted(by_fmt.items())},
        "bits_per_weight_held": {f: round(8 * by_fmt[f] / values_per_fmt[f], 2) for f in sorted(by_fmt)},
        "int8_packed_copies_mib": round(packed / MIB, 1),
        "dense_mib_by_dtype": {d: round(b / MIB, 1) for d, b in sorted(dense.items())},
        "kv_cache_mib": round(kv / MIB, 1),
        "rss_mib": round(rss / MIB, 1),
        "runtime_and_rest_mib": round((rss - counted) / MIB, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model path or GGUF file (default: the embedded model)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args()
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=args.model, max_model_len=args.max_model_len), cache=CacheConfig()
        )
    )
    result = {"model": args.model or "embedded", "threads": torch.get_num_threads(), **breakdown(engine)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
