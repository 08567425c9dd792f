"""xgrammar vs llguidance on our tokenizer: schema compile time (first use, then cached) and per-step
mask time with 16 constrained rows. Prints one JSON object.

Each backend drives 16 matchers through the same walk: at every step it fills the 16 rows' bitmask,
applies it to a [16, V] fp32 logits tensor, and each row takes the argmax of random logits among the
allowed tokens (so every row follows a valid, different path). Run:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/grammar_backends.py [--model FOLDER] [--steps 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "address", "role"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                    "required": ["sku", "qty"],
                },
                "minItems": 1,
            },
            "total": {"type": "number", "minimum": 0},
            "paid": {"type": "boolean"},
        },
        "required": ["id", "items", "total", "paid"],
    },
}


def _walk(fill: Any, accept: Any, rows: int, vocab: int, steps: int, seed: int) -> list[float]:
    """Per-step seconds for fill+apply over `rows` matchers."""
    from xgrammar import apply_token_bitmask_inplace

    g = torch.Generator().manual_seed(seed)
    bitmask = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int32)
    times: list[float] = []
    alive = list(range(rows))
    for _ in range(steps):
        if not alive:
            break
        logits = torch.randn(rows, vocab, generator=g)
        t0 = time.perf_counter()
        for i in alive:
            fill(i, bitmask)
        apply_token_bitmask_inplace(logits, bitmask)
        times.append(time.perf_counter() - t0)
        still = []
        for i in alive:
            tok = int(logits[i].argmax())
            if accept(i, tok):
                still.append(i)
        alive = still
    return times


def bench_xgrammar(hf_tok: Any, vocab: int, eos: list[int], rows: int, steps: int) -> dict[str, Any]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
    setup = time.perf_counter() - t0
    out: dict[str, Any] = {"tokenizer_setup_s": round(setup, 4), "schemas": {}}
    for name, schema in SCHEMAS.items():
        s = json.dumps(schema)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(s)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.compile_json_schema(s)
        cached = time.perf_counter() - t0
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]

        def fill(i: int, bm: torch.Tensor, m: list[Any] = matchers) -> None:
            m[i].fill_next_token_bitmask(bm, i)

        def accept(i: int, tok: int, m: list[Any] = matchers) -> bool:
            ok = m[i].accept_token(tok)
            return bool(ok) and not m[i].is_terminated()

        times = _walk(fill, accept, rows, vocab, steps, 0)
        out["schemas"][name] = _summary(first, cached, times)
    return out


def bench_llguidance(hf_tok: Any, vocab: int, eos: list[int], rows: int, steps: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab, eos_token=eos[0])
    setup = time.perf_counter() - t0
    out: dict[str, Any] = {"tokenizer_setup_s": round(setup, 4), "schemas": {}}
    for name, schema in SCHEMAS.items():
        s = json.dumps(schema)
        # llguidance compiles lazily: building the grammar and the first matcher is its "compile".
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(s)
        first_m = llguidance.LLMatcher(lltok, grammar)
        bm = llguidance.torch.allocate_token_bitmask(1, vocab)
        llguidance.torch.fill_next_token_bitmask(first_m, bm, 0)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        llguidance.LLMatcher(lltok, grammar)
        cached = time.perf_counter() - t0
        matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(rows)]

        def fill(i: int, bm: torch.Tensor, m: list[Any] = matchers) -> None:
            llguidance.torch.fill_next_token_bitmask(m[i], bm, i)

        def accept(i: int, tok: int, m: list[Any] = matchers) -> bool:
            ok = m[i].consume_token(tok)
            return bool(ok) and not m[i].is_stopped()

        times = _walk(fill, accept, rows, vocab, steps, 0)
        out["schemas"][name] = _summary(first, cached, times)
    return out


def _summary(first: float, cached: float, times: list[float]) -> dict[str, Any]:
    return {
        "compile_first_ms": round(first * 1e3, 2),
        "compile_cached_ms": round(cached * 1e3, 3),
        "steps": len(times),
        "mask_step_ms_median": round(statistics.median(times) * 1e3, 3) if times else None,
        "mask_step_ms_p90": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e3, 3) if times else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from server.models.loader import read_hf_config, resolve_model

    folder = resolve_model(args.model, None).folder
    hf_tok = AutoTokenizer.from_pretrained(str(folder))
    vocab = int(read_hf_config(folder)["vocab_size"])
    eos = [int(hf_tok.eos_token_id)]
    torch.set_num_threads(1)
    result = {
        "model": str(folder.name),
        "vocab": vocab,
        "rows": args.rows,
        "xgrammar": bench_xgrammar(hf_tok, vocab, eos, args.rows, args.steps),
        "llguidance": bench_llguidance(hf_tok, vocab, eos, args.rows, args.steps),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
