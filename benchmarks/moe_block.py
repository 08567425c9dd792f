"""One MoE block of a real GGUF on CPU: the fused experts call (server/models/moe/native.py) against the
per-expert loop (KUBEINFER_MOE_FUSED=0), alternated in one process, and where a one-token step goes.

The blocks are the file's own (default: the 2.1B Qwen3-MoE shape of benchmarks/real_shape_models.py,
Q4_K_M: Q4_K gate/up, Q6_K or Q4_K down, 16 experts, top-8, hidden 2048, expert intermediate 768),
`--layers` of them served as the loader serves them (BlockQuantExperts over qlinear's kernel, router in
fp32) and stepped in turn, each step with new tokens, so the chosen experts' bytes come from memory, not
from a cache that holds one layer. Per case: median ms per block step for each path (the fused call also with the experts computing in
bf16, as the engine sets them under `--dtype auto` on a CPU with native bf16), the router + top-k
alone, and at one token the chosen experts' bytes over the step's time (as repacked in memory: Q4_K at
6.0 bits per weight, Q6_K at 10.0; and as in the file, 4.5 and 6.56) against a 64 MiB copy's bandwidth.
The experts are laid out as the loader holds them for bf16 layers (`read_gguf_checkpoint`: 16-row tiles
where the tile kernels run; KUBEINFER_KQUANT_BLOCKS=0 for the row-major / repacked layouts, which fp32
layers get): the fp32 columns over tiles measure the tiles' slow fp32 path, not what fp32 serving runs.
The machine may be shared: compare the ratios; the load average is printed before and after.

    python benchmarks/moe_block.py [--gguf FILE --layers 4 --tokens 1 16 --rounds 5 --reps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from cpu_ceilings import copy_gb_per_s

from server.models.moe import FusedMoE, MoEConfig
from server.models.moe.native import ENABLE_ENV
from server.models.moe.quant import BlockQuantExperts
from server.models.moe.weights import ExpertWeights
from server.native import usable_cpu_features
from server.quant.cpu_qgemv_q8 import active_kernel
from server.quant.cpu_qlinear import BlockQuantWeight, load_qlinear_kernel
from server.quant.gguf_checkpoint import read_gguf_checkpoint

DEFAULT_GGUF = Path.home() / ".cache/kubeinfer/real-shapes/qwen3-moe-2b/qwen3-moe-2b-Q4_K_M.gguf"
FILE_BITS = {"q4_k": 4.5, "q6_k": 6.5625, "q8_0": 8.5, "q4_0": 4.5}


def _packed(blocks: list[FusedMoE], task_rows: int = 0) -> list[FusedMoE]:
    """The same layers with their experts' packed copies for the int8 batched path (BlockQuantExperts
    .pack_int8, as the engine makes them at load under bf16); [] where that path does not run here.
    `task_rows` > 0 fixes the fused call's rows per task (0: the library's choice, task_rows_for)."""
    out = []
    for b in blocks:
        src = b.experts
        assert isinstance(src, BlockQuantExperts) and src.kernel is not None
        q8 = active_kernel(src.kernel)
        if q8 is None or q8.isa != "vnni":
            return []
        experts = BlockQuantExperts(list(src.w13), list(src.w2), src.b13, src.b2, src.kernel, torch.bfloat16)
        experts.pack_int8(q8)
        call = experts.fused_call(b.cfg)
        assert call is not None
        call.spec.task_rows = task_rows
        out.append(FusedMoE(b.cfg, b.weights, experts=experts))
    return out


def _layers(path: Path, count: int) -> tuple[MoEConfig, list[FusedMoE], list[float]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    router0 = by_name["blk.0.ffn_gate_inp.weight"]
    gate0 = by_name["blk.0.ffn_gate_exps.weight"]
    h, i, e = (int(v) for v in gate0.shape)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    top_k = int(reader.fields[f"{arch}.expert_used_count"].parts[-1][0])
    assert tuple(int(v) for v in router0.shape) == (h, e)
    cfg = MoEConfig(arch.replace("moe", "_moe"), e, top_k, h, i, renormalize=arch == "qwen3moe")
    kernel = load_qlinear_kernel()
    # the experts as the loader holds them (gguf_checkpoint: 16-row tiles where the tile kernels run,
    # KUBEINFER_KQUANT_BLOCKS; else row-major / repacked), not a layout of the benchmark's own
    ckpt = read_gguf_checkpoint(path, torch.bfloat16)
    blocks, file_bytes = [], []
    for n in range(count):
        pre = f"model.layers.{n}.mlp"
        gate, up, down = (ckpt.experts[f"{pre}.experts.{p}"] for p in ("gate", "up", "down"))
        w13 = [BlockQuantWeight.concat_rows([a, b]) for a, b in zip(gate, up, strict=True)]
        experts = BlockQuantExperts(w13, down, kernel=kernel)
        router = ckpt.tensors[f"{pre}.router"]
        assert isinstance(router, torch.Tensor)
        w = ExpertWeights(router=router.float(), router_bias=None, w13=None, w2=None, b13=None, b2=None)
        blocks.append(FusedMoE(cfg, w, experts=experts))
        kinds = [by_name[f"blk.{n}.ffn_{p}_exps.weight"].tensor_type.name.lower() for p in ("gate", "down")]
        file_bytes.append((2 * i * h * FILE_BITS[kinds[0]] + h * i * FILE_BITS[kinds[1]]) / 8)
    return cfg, blocks, file_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--rounds", type=int, default=5, help="alternations of the two paths")
    ap.add_argument("--reps", type=int, default=8, help="block steps per path per round")
    args = ap.parse_args()
    load_before = os.getloadavg()
    cfg, blocks, file_bytes = _layers(args.gguf, args.layers)
    g = torch.Generator().manual_seed(0)
    out: dict[str, object] = {
        "file": args.gguf.name,
        "expert_layouts": sorted({w.fmt for b in blocks for w in b.experts.w13 + b.experts.w2}),  # type: ignore[attr-defined]
        "shape": {"hidden": cfg.hidden_size, "inter": cfg.intermediate_size, "experts": cfg.num_experts},
        "top_k": cfg.top_k,
        "layers": args.layers,
        "threads": torch.get_num_threads(),
        "cpu_features": usable_cpu_features().names(),
        "copy_gb_per_s": round(copy_gb_per_s(), 2),
    }
    # (KUBEINFER_MOE_FUSED, the experts' compute dtype): bf16 lets batches of 4+ rows per expert take
    # qlinear's bf16 path (and 4-bit 32-groups the int8 batched path), as the engine sets under --dtype auto
    paths = {"loop": ("0", torch.float32), "fused": ("1", torch.float32), "fused_bf16": ("1", torch.bfloat16)}
    # fused_bf16 with the experts' packed copies made once (the engine's default where they fit in memory)
    # and with 96 rows per task whatever the tokens (the call's rows per task before task_rows_for)
    packed, packed_96 = _packed(blocks), _packed(blocks, task_rows=96)
    if packed:
        paths["fused_bf16_packed"] = ("1", torch.bfloat16)
        paths["fused_bf16_packed_96"] = ("1", torch.bfloat16)
    layers_of = {
        name: {"fused_bf16_packed": packed, "fused_bf16_packed_96": packed_96}.get(name, blocks)
        for name in paths
    }
    for t in args.tokens:
        times: dict[str, list[float]] = {p: [] for p in (*paths, "route")}
        chosen_bytes: list[float] = []
        chosen_file_bytes: list[float] = []
        step = 0
        with torch.inference_mode():
            for name, (flag, compute) in paths.items():  # warm each
                os.environ[ENABLE_ENV] = flag
                for b in layers_of[name]:
                    b.experts.compute = compute  # type: ignore[attr-defined]
                    b(torch.randn(t, cfg.hidden_size, generator=g))
            for r in range(args.rounds):
                for name, (flag, compute) in paths.items() if r % 2 == 0 else reversed(paths.items()):
                    os.environ[ENABLE_ENV] = flag
                    for b in layers_of[name]:
                        b.experts.compute = compute  # type: ignore[attr-defined]
                    for _ in range(args.reps):
                        n = step % len(blocks)
                        step += 1
                        moe = layers_of[name][n]
                        x = torch.randn(t, cfg.hidden_size, generator=g)
                        t0 = time.perf_counter()
                        moe(x)
                        times[name].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        ids = moe.route(x).ids
                        times["route"].append(time.perf_counter() - t0)
                        used = sorted(set(ids.reshape(-1).tolist()))
                        experts = blocks[n].experts  # the weights as stored, without packed copies
                        assert isinstance(experts, BlockQuantExperts)
                        chosen_bytes.append(
                            sum(experts.w13[e].nbytes() + experts.w2[e].nbytes() for e in used)
                        )
                        chosen_file_bytes.append(len(used) * file_bytes[n])
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        case: dict[str, object] = {
            "loop_ms": round(med["loop"], 3),
            "fused_ms": round(med["fused"], 3),
            "fused_bf16_ms": round(med["fused_bf16"], 3),
            "fused_speedup": round(med["loop"] / med["fused"], 2),
            "fused_bf16_speedup": round(med["loop"] / med["fused_bf16"], 2),
            **(
                {
                    "fused_bf16_packed_ms": round(med["fused_bf16_packed"], 3),
                    "packed_over_unpacked_bf16": round(med["fused_bf16"] / med["fused_bf16_packed"], 2),
                    "fused_bf16_packed_96_ms": round(med["fused_bf16_packed_96"], 3),
                    "task_rows_auto_over_96": round(
                        med["fused_bf16_packed_96"] / med["fused_bf16_packed"], 2
                    ),
                }
                if packed
                else {}
            ),
            "route_ms": round(med["route"], 3),
            "chosen_mb_in_memory": round(statistics.mean(chosen_bytes) / 1e6, 2),
            "chosen_mb_in_file": round(statistics.mean(chosen_file_bytes) / 1e6, 2),
        }
        for name in paths:
            gbs = statistics.mean(chosen_bytes) / (med[name] / 1e3) / 1e9
            case[f"{name}_gb_per_s"] = round(gbs, 2)
            case[f"{name}_of_copy_bandwidth"] = round(gbs / float(out["copy_gb_per_s"]), 2)  # type: ignore[arg-type]
        out[f"tokens_{t}"] = case
    out["load_average_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
