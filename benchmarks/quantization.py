"""Perplexity, weight memory and decode speed of every quantization method in one run; prints JSON.

    python benchmarks/quantization.py                        # all methods on the embedded SmolLM2
    python benchmarks/quantization.py --methods none int4 awq --decode-tokens 16
    python benchmarks/quantization.py --compare-cpu-paths --methods int8 int4 awq gptq fp8 --rounds 3

--compare-cpu-paths loads each method twice, with the previous CPU layers (torch's bf16 int4/int8
kernels, fp8 converted per forward) and with the weights repacked for our weight-only kernel
(server/quant/cpu_repack.py; fp8: its codes through server/quant/cpu_fp8.py's kernel), and
alternates 1-user greedy decodes between the two engines (rounds x each), so both see the same machine
load; it reports the median tokens/s of each, their ratio and the weight bytes each holds.

AWQ and GPTQ checkpoints are written once by our quantizer into --work-dir and reused. Each method is
scored over the held-out text of server.quantize.evaluation in every --dtypes compute dtype ("auto" is
the server's default: bf16 on a CPU with native bf16, else fp32): perplexity, its ratio to the fp32
unquantized model, and the mean KL divergence of the next-token distributions from that model (nats/token;
steadier than a short text's perplexity). Decode speed is a batch-1 greedy generation through LLMEngine in
the serving dtype ("auto"), counted from the first token to the last (--decode-tokens 0 skips it). The
reference ("none") is the embedded model, itself dequantized Q4_1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import server  # noqa: F401  (applies server/cpu_env.py's CPU runtime settings before torch loads)

# isort: split
import torch

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.models.loader import load_model, resolve_dtype, resolve_model
from server.quant import quantized_layer_bytes
from server.quantize.evaluation import (
    HELDOUT_TEXT,
    mean_kl,
    score_sequence,
    sequence_logprobs,
    top1_agreement,
)
from server.request import SamplingParams
from server.tokenizer import Tokenizer

ALL_METHODS = (
    "none",
    "int8",
    "fp8",
    "int4",
    "awq",
    "gptq",
    "bitsandbytes",
    "bitsandbytes-nf4",
    "bitsandbytes-fp4",
)
DOWN = "model.layers.0.mlp.down_proj"
PREQUANTIZED = {
    "awq": {"method": "awq", "awq_grid": 10},
    "gptq": {"method": "gptq", "sym": False, "act_order": True, "damp_percent": 0.1},
}


@dataclass(frozen=True)
class Accuracy:
    dtype: str  # the --dtype name as the server takes it
    compute_dtype: str  # what it resolved to on this machine
    perplexity: float
    perplexity_ratio: float  # to the unquantized model in fp32
    kl_to_fp32: float  # mean KL(unquantized fp32 || this), nats/token
    top1_agreement_256: float  # teacher-forced, against the unquantized fp32 model


@dataclass(frozen=True)
class Row:
    method: str
    accuracy: list[Accuracy]
    weight_bytes: int  # whole model in the serving dtype, as EngineInfo reports it
    quantized_layer_bytes: int  # the projections only, in the serving dtype
    quantized_layer_ratio_vs_fp16: float
    decode_tokens_per_s: float
    load_s: float


def _checkpoint(method: str, work: Path, calib_tokens: int) -> Path:
    from server.quantize import QuantizeOptions, quantize_model

    out = work / f"smollm2-{method}-c{calib_tokens}"
    if not (out / "config.json").is_file():
        quantize_model(None, out, QuantizeOptions(calib_tokens=calib_tokens, **PREQUANTIZED[method]))  # type: ignore[arg-type]
    return out


def _decode_speed(llm: LLMEngine, prompt: list[int], tokens: int) -> float:
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    llm.add_request("bench", prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    stamps: list[float] = []
    while llm.has_unfinished():
        for out in llm.step():
            stamps.extend(time.perf_counter() for _ in out.new_token_ids)
    if len(stamps) < 2:
        return float("nan")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _engine(folder: Path, flag: str | None, threads: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), quantize=flag, dtype="float32"),
            cache=CacheConfig(num_kv_blocks=64),
            max_num_seqs=1,
            device="cpu",
            num_threads=threads,
        )
    )


def _compare_cpu_paths(args: argparse.Namespace) -> dict[str, Any]:
    from server.quant.cpu_repack import cpu_kernel_enabled, previous_cpu_path

    if not cpu_kernel_enabled():
        raise SystemExit("the CPU weight-only kernel cannot be built here: nothing to compare")
    base_folder = resolve_model(None).folder
    results = []
    for method in args.methods:
        if method not in ("int8", "int4", "awq", "gptq", "fp8"):
            raise SystemExit(f"--compare-cpu-paths covers int8, int4, awq, gptq and fp8, not {method}")
        folder = (
            _checkpoint(method, args.work_dir, args.calib_tokens) if method in PREQUANTIZED else base_folder
        )
        flag = None if method in PREQUANTIZED else method
        with previous_cpu_path():
            old = _engine(folder, flag, args.threads)
        new = _engine(folder, flag, args.threads)
        prompt = new.tokenizer.encode("The history of the printing press")
        speeds: dict[str, list[float]] = {"previous": [], "kernel": []}
        for _ in range(args.rounds):
            speeds["previous"].append(_decode_speed(old, prompt, args.decode_tokens))
            speeds["kernel"].append(_decode_speed(new, prompt, args.decode_tokens))
        prev, kern = statistics.median(speeds["previous"]), statistics.median(speeds["kernel"])
        row = {
            "method": method,
            "previous_tokens_per_s": round(prev, 2),
            "kernel_tokens_per_s": round(kern, 2),
            "speedup": round(kern / prev, 3),
            "previous_runs": [round(v, 2) for v in speeds["previous"]],
            "kernel_runs": [round(v, 2) for v in speeds["kernel"]],
            "previous_weight_bytes": old.info.weight_bytes,
            "kernel_weight_bytes": new.info.weight_bytes,
            "previous_projection_layer": type(old.loaded.model.get_submodule(DOWN)).__name__,
            "kernel_projection_layer": type(new.loaded.model.get_submodule(DOWN)).__name__,
        }
        print(json.dumps(row), file=sys.stderr, flush=True)
        results.append(row)
        del old, new
    return {
        "model": "SmolLM2-135M-Instruct (embedded), fp32 activations, 1 user greedy decode",
        "decode_tokens": args.decode_tokens,
        "rounds": args.rounds,
        "threads": args.threads,
        "cpu": _cpu_model(),
        "load_average_at_start": os.getloadavg(),
        "note": "previous and kernel runs alternate on one process: compare the ratio, not absolutes",
        "results": results,
        "layers": _layer_times(max(5, args.rounds)),
    }


def _layer_times(rounds: int, calls: int = 50) -> list[dict[str, Any]]:
    """One projection at 1 row (decode), previous layer vs kernel layer, alternating: median wall and
    thread-CPU microseconds per call (CPU time leaves out the time this thread waited for a core)."""
    from server.quant.cpu_repack import int4_linear, int8_linear, quantize_int8
    from server.quant.formats import quantize_rtn
    from server.quant.layers import Fp8Linear, Int4Linear, Int8Linear

    rows = []
    for n, k in ((1536, 576), (576, 1536)):  # SmolLM2's gate/up and down projections
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05
        pairs: dict[str, tuple[Any, Any]] = {
            "int8": (Int8Linear.quantize(w, None), int8_linear(*quantize_int8(w), None)),
            "int4-g64": (Int4Linear(quantize_rtn(w, 64), None), int4_linear(quantize_rtn(w, 64), None)),
            "fp8": (Fp8Linear.quantize(w, None, cpu_kernel=False), Fp8Linear.quantize(w, None)),
        }
        x = torch.randn(1, k)
        for name, (old, new) in pairs.items():
            wall: dict[str, list[float]] = {"previous": [], "kernel": []}
            cpu: dict[str, list[float]] = {"previous": [], "kernel": []}
            for _ in range(rounds):
                for key, layer in (("previous", old), ("kernel", new)):
                    t0, c0 = time.perf_counter(), time.thread_time()
                    for _ in range(calls):
                        layer(x)
                    wall[key].append((time.perf_counter() - t0) / calls * 1e6)
                    cpu[key].append((time.thread_time() - c0) / calls * 1e6)
            med = {
                f"{m}_{key}_us": round(statistics.median(d[key]), 1)
                for m, d in (("wall", wall), ("cpu", cpu))
                for key in d
            }
            rows.append(
                {
                    "layer": f"{name} [{n}, {k}] x 1 row",
                    **med,
                    "cpu_speedup": round(med["cpu_previous_us"] / med["cpu_kernel_us"], 3),
                    "wall_speedup": round(med["wall_previous_us"] / med["wall_kernel_us"], 3),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(ALL_METHODS), choices=ALL_METHODS)
    ap.add_argument(
        "--compare-cpu-paths", action="store_true", help="previous vs kernel CPU path, interleaved"
    )
    ap.add_argument("--rounds", type=int, default=3, help="--compare-cpu-paths: decodes per path")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/kubeinfer-quant-bench"))
    ap.add_argument("--calib-tokens", type=int, default=128, help="as the tests (see docs/quantization.md)")
    ap.add_argument("--eval-tokens", type=int, default=257)
    ap.add_argument("--decode-tokens", type=int, default=32, help="0 = no decode speed")
    ap.add_argument(
        "--dtypes", nargs="+", default=["auto", "float32"], help="compute dtypes to score each method in"
    )
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.compare_cpu_paths:
        print(json.dumps(_compare_cpu_paths(args), indent=2))
        return 0

    base_folder = resolve_model(None).folder
    ids = Tokenizer(base_folder).encode(HELDOUT_TEXT, add_special_tokens=False)[: args.eval_tokens]
    heldout = torch.tensor(ids, dtype=torch.int64)
    cpu = torch.device("cpu")
    ref = load_model(base_folder, torch.float32, cpu, 1024).model
    ref_scores, ref_logprobs = score_sequence(ref, heldout), sequence_logprobs(ref, heldout)
    del ref
    methods = list(dict.fromkeys(["none", *args.methods]))
    rows: list[Row] = []
    for method in methods:
        folder = (
            _checkpoint(method, args.work_dir, args.calib_tokens) if method in PREQUANTIZED else base_folder
        )
        flag = None if method in ("none", *PREQUANTIZED) else method
        accuracy = []
        for name in args.dtypes:
            dtype = resolve_dtype(name, cpu)
            loaded = load_model(folder, dtype, cpu, 1024, flag)
            scores = score_sequence(loaded.model, heldout)
            logprobs = sequence_logprobs(loaded.model, heldout)
            del loaded
            accuracy.append(
                Accuracy(
                    dtype=name,
                    compute_dtype=str(dtype).removeprefix("torch."),
                    perplexity=round(scores.perplexity, 3),
                    perplexity_ratio=round(scores.perplexity / ref_scores.perplexity, 4),
                    kl_to_fp32=round(mean_kl(ref_logprobs, logprobs), 5),
                    top1_agreement_256=round(top1_agreement(ref_scores, scores, 256), 4),
                )
            )
        t0 = time.perf_counter()
        llm = LLMEngine(
            EngineConfig(
                model=ModelConfig(model=str(folder), quantize=flag),
                cache=CacheConfig(num_kv_blocks=64),
                max_num_seqs=1,
                device="cpu",
                num_threads=args.threads,
            )
        )
        load_s = time.perf_counter() - t0
        held, fp16 = quantized_layer_bytes(llm.loaded.model)  # in the serving dtype
        prompt = llm.tokenizer.encode("The history of the printing press")
        speed = _decode_speed(llm, prompt, args.decode_tokens) if args.decode_tokens else float("nan")
        rows.append(
            Row(
                method=method,
                accuracy=accuracy,
                weight_bytes=llm.info.weight_bytes,
                quantized_layer_bytes=held,
                quantized_layer_ratio_vs_fp16=round(held / fp16, 4),
                decode_tokens_per_s=round(speed, 2),
                load_s=round(load_s, 2),
            )
        )
        print(json.dumps(asdict(rows[-1])), file=sys.stderr, flush=True)
        del llm
    print(
        json.dumps(
            {
                "model": "SmolLM2-135M-Instruct (embedded, dequantized Q4_1)",
                "eval_tokens": int(heldout.numel()),
                "calib_tokens": args.calib_tokens,
                "threads": args.threads,
                "cpu": _cpu_model(),
                "load_average_at_start": os.getloadavg(),
                "results": [asdict(r) for r in rows],
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
