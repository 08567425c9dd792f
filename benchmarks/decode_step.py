"""Decode step time of the embedded GGUF model by how the layer loop runs; prints JSON.

    python benchmarks/decode_step.py [--users 1 16 --prompt-len 128 --steps 40]
    python benchmarks/decode_step.py --gemm-dtypes float32 bfloat16 --users 16 32   # graph, fp32 vs bf16
    python benchmarks/decode_step.py --model ~/.cache/kubeinfer/real-shapes/gemma-3-1b/gemma-3-1b-Q4_K_M.gguf --users 1

Three ways through the same engine, same weights, same batch, taking single steps in rotation so that
the machine's load hits all three alike:
- `graph`: the decode graph, the whole layer loop in one compiled call (server/models/decode_graph.py);
- `fused`: the Python-driven loop over the compiled fused ops (server/models/cpu_fused.py);
- `torch`: the Python loop over plain torch ops between the projection kernels.
Per mode: decode step ms p50 and min, and the speedups of graph and fused over torch (p50 ratio).
With `--gemm-dtypes`, the modes are the decode graph under each projection gemm_dtype instead
(server/quant/gemm_dtype.py: bf16 runs the kernel's bf16 batched path), rotated the same way, and the
speedup is over the first dtype. With `--int8-pack`, the modes are the decode graph reading the packed
copies the batched int8 path gets at load (`packed`, cpu_qgemv_q8.Q8GemvKernel.pack) and the same
weights without them (`unpacked`: that path transposes 16 rows per 16 columns on every call), rotated the
same way, with the copies' MiB: whether the second copy of each weight pays for its memory. With
`--q8-tiles`, the modes are the decode graph over the Q8_0 / Q5_0 / IQ4_NL / Q5_1 16-row tiles the loader holds
(`tiles`, cpu_qlinear.interleave_q8_x16) and over the same weights row-major with their packed copies
(`rowmajor`: the layout before the tiles), rotated the same way. With `--qk-amx`, the modes are the
decode graph with the k-quant tiles' amx path on (`amx`: bf16 layers' batches of AMX_MIN_ROWS rows and more
over Q4_K / Q6_K x16 tiles on AMX-BF16 tiles, cpu_qk_native.py) and off (`int8`: the VNNI int8 kernels),
rotated the same way.
Per run, for a dense model, the weight bytes a decode step reads (`step_weight_bytes`) over each mode's
step p50 (`weight_gb_per_s_p50`), next to this machine's memory read bandwidth measured in the same go
(`memory_read_gb_per_s`, a 1 GiB `sum()`, before the engine loads and after the steps and a rest):
issue 49's single-stream fraction.
The engine is driven directly (no HTTP); benchmarks/peers_side_by_side.py measures the served whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import server  # noqa: F401  (CPU runtime settings before torch loads)

# isort: split
import torch
from cpu_ceilings import read_gb_per_s
from peers_side_by_side import cpu_info

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.quant.block_linear import BlockQuantLinear
from server.quant.cpu_qlinear import BlockQuantWeight
from server.quant.gemm_dtype import apply_gemm_dtype
from server.request import SamplingParams

MODES = ("graph", "fused", "torch")
PACK_MODES = ("packed", "unpacked")
TILE_MODES = ("tiles", "rowmajor")
AMX_MODES = ("amx", "int8")


def pack_variants(
    model: torch.nn.Module,
) -> list[tuple[BlockQuantLinear, BlockQuantWeight, BlockQuantWeight]]:
    """(module, packed weight, the same weight without its copy) for every layer packed at load."""
    out = []
    for m in model.modules():
        if isinstance(m, BlockQuantLinear) and m.weight_q.packed is not None:
            w = m.weight_q
            out.append((m, w, dataclasses.replace(w, packed=None)))
    return out


def tile_variants(
    model: torch.nn.Module,
) -> list[tuple[BlockQuantLinear, BlockQuantWeight, BlockQuantWeight]]:
    """(module, its 16-row tiles, the same weight row-major with its packed copy) for every layer held as
    Q8_0 / Q5_0 / IQ4_NL / Q5_1 tiles."""
    from server.quant import cpu_qgemv_q8, cpu_qlinear

    q8 = cpu_qgemv_q8.load_q8_gemv_kernel(cpu_qlinear.load_qlinear_kernel())
    out = []
    for m in model.modules():
        if isinstance(m, BlockQuantLinear) and m.weight_q.fmt in cpu_qlinear.Q8_TILED.values():
            w = m.weight_q
            out.append((m, w, q8.pack(cpu_qlinear.deinterleave_q8_x16(w))))
    return out


def copies_mib(variants: list[tuple[BlockQuantLinear, BlockQuantWeight, BlockQuantWeight]]) -> float:
    copies = {p.packed.data_ptr(): p.packed.numel() for _, p, _ in variants if p.packed is not None}
    return round(sum(copies.values()) / 2**20, 1)


def set_packed(
    model: torch.nn.Module,
    variants: list[tuple[BlockQuantLinear, BlockQuantWeight, BlockQuantWeight]],
    packed: bool,
) -> None:
    for m, with_copy, without in variants:
        w = with_copy if packed else without
        m._w, m.q, m.scales, m.mins = w, w.q, w.scales, w.mins  # the buffers too (tiles: another layout)
    model._decode_graph = None  # type: ignore[assignment]  # descriptors hold the copies: rebuilt next step


def read_after_rest(rest_s: float = 2.0) -> float:
    """read_gb_per_s once the kernels' OpenMP threads have stopped spinning."""
    time.sleep(rest_s)
    return read_gb_per_s()


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a dense model's decode step reads: every block-quantized projection (the LM head
    included) and float Linear; an untied token embedding is read one row per token (not counted). 0 for
    a mixture-of-experts model (only the routed experts are read)."""
    from server.models.moe import SparseMoeBlock

    if any(isinstance(m, SparseMoeBlock) for m in model.modules()):
        return 0
    total, seen = 0, set()
    for m in model.modules():
        if isinstance(m, BlockQuantLinear):
            held = m.weight_q.q
            if held.data_ptr() not in seen:  # a tied head shares the embedding's blocks: read once
                seen.add(held.data_ptr())
                total += m.weight_q.nbytes() - (0 if m.weight_q.packed is None else m.weight_q.packed.numel())
        elif isinstance(m, torch.nn.Linear) and m.weight.data_ptr() not in seen:
            seen.add(m.weight.data_ptr())
            total += m.weight.numel() * m.weight.element_size()
    return total


def measure(
    engine: LLMEngine,
    users: int,
    prompt_len: int,
    steps: int,
    gemm_dtypes: list[str] | None = None,
    int8_pack: bool = False,
    q8_tiles: bool = False,
    qk_amx: bool = False,
) -> dict[str, object]:
    model = engine.loaded.model
    default_dtype = next((m.gemm_dtype for m in model.modules() if hasattr(m, "gemm_dtype")), torch.float32)
    ops = model.fused_ops
    if ops is None:
        raise SystemExit("the fused CPU ops are unavailable here (no compiler?): nothing to compare")
    g = torch.Generator().manual_seed(users)
    for i in range(users):
        prompt = torch.randint(100, 49000, (prompt_len,), generator=g).tolist()
        engine.add_request(
            f"u{users}-{i}", prompt, SamplingParams(max_tokens=10**4, temperature=0.0, ignore_eos=True)
        )
    while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()  # every prompt prefilled: from here on each step is a pure decode step
    modes = (
        tuple(f"graph_{d}" for d in gemm_dtypes)
        if gemm_dtypes
        else PACK_MODES
        if int8_pack
        else TILE_MODES
        if q8_tiles
        else AMX_MODES
        if qk_amx
        else MODES
    )
    qk = None
    if qk_amx:
        from server.quant import cpu_qk_native

        qk = cpu_qk_native.load_qk_native_kernel()
        if qk.amx_min_rows == 0:
            raise SystemExit("the k-quant tiles' amx path does not run here (AMX-BF16, KUBEINFER_QK_AMX)")
    amx_rows = qk.amx_min_rows if qk is not None else 0
    variants = pack_variants(model) if int8_pack else tile_variants(model) if q8_tiles else []
    if q8_tiles and not variants:
        raise SystemExit(
            "no layer is held as Q8_0 / Q5_0 tiles (KUBEINFER_KQUANT_BLOCKS, vnni): nothing to compare"
        )
    if int8_pack and not variants:
        raise SystemExit(
            "no weight was packed at load (KUBEINFER_INT8_PACK, vnni path, bf16): nothing to compare"
        )
    times: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(steps):
        j = i % len(modes)
        for mode in modes[j:] + modes[:j]:
            if gemm_dtypes:
                apply_gemm_dtype(model, getattr(torch, mode.removeprefix("graph_")))
            elif qk is not None:
                qk.set_amx(amx_rows if mode == "amx" else 0)
            elif int8_pack or q8_tiles:
                set_packed(model, variants, mode in ("packed", "tiles"))
                engine.step()  # rebuilds the graph outside the timed step
            else:
                model.fused_ops = None if mode == "torch" else ops
                model.use_decode_graph = mode == "graph"
            t0 = time.perf_counter()
            engine.step()
            times[mode].append(time.perf_counter() - t0)
    model.fused_ops, model.use_decode_graph = ops, True
    if qk is not None:
        qk.set_amx(amx_rows)
    if variants:
        set_packed(model, variants, True)
    apply_gemm_dtype(model, default_dtype)
    for i in range(users):
        engine.abort_request(f"u{users}-{i}")
    p50 = {m: statistics.median(v) * 1e3 for m, v in times.items()}
    base = modes[0] if gemm_dtypes or int8_pack or q8_tiles or qk_amx else "torch"
    read = step_weight_bytes(model)
    return {
        "users": users,
        **({"packed_copies_mib": copies_mib(variants)} if int8_pack else {}),
        **(
            {
                "weight_gb_read_per_step": round(read / 1e9, 3),
                "weight_gb_per_s_p50": {m: round(read / v / 1e6, 1) for m, v in p50.items()},
            }
            if read
            else {}
        ),
        "step_ms_p50": {m: round(v, 3) for m, v in p50.items()},
        "step_ms_min": {m: round(min(v) * 1e3, 3) for m, v in times.items()},
        f"speedup_vs_{base}_p50": {m: round(p50[base] / p50[m], 3) for m in modes if m != base},
        "output_tok_per_s_p50": {m: round(users * 1e3 / v, 1) for m, v in p50.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40, help="steps per mode")
    ap.add_argument("--model", help="a model path or GGUF file (default: the embedded model)")
    ap.add_argument("--max-model-len", type=int, help="the engine's max_model_len (default: the model's)")
    ap.add_argument(
        "--gemm-dtypes", nargs="+", choices=["float32", "bfloat16"], help="compare the graph under these"
    )
    ap.add_argument(
        "--int8-pack", action="store_true", help="compare the graph with and without packed copies"
    )
    ap.add_argument(
        "--q8-tiles",
        action="store_true",
        help="compare the graph over Q8_0/Q5_0 tiles and row-major + copies",
    )
    ap.add_argument(
        "--qk-amx", action="store_true", help="compare the graph with the k-quant amx path on and off"
    )
    args = ap.parse_args()
    # before any kernel runs: the kernels' OpenMP threads spin a while after each call and took half
    # of this figure when it was read right after the steps (34-46 against 72-79 GB/s, 2 cores)
    read_at_start = read_gb_per_s()
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=args.model, max_model_len=args.max_model_len), cache=CacheConfig()
        )
    )
    result = {
        "benchmark": "decode step, layer loop as graph / fused / torch, steps rotated",
        "model": args.model or "embedded",
        "cpu": cpu_info(),
        "threads": torch.get_num_threads(),
        "load_average_at_start": list(os.getloadavg()),
        "memory_read_gb_per_s": round(read_at_start, 1),  # a 1 GiB sum(), this run's threads
        "runs": [
            measure(
                engine,
                u,
                args.prompt_len,
                args.steps,
                args.gemm_dtypes,
                args.int8_pack,
                args.q8_tiles,
                args.qk_amx,
            )
            for u in args.users
        ],
        "load_average_at_end": list(os.getloadavg()),
        "memory_read_gb_per_s_at_end": round(read_after_rest(), 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
