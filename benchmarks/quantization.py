"""Perplexity, weight memory and decode speed of every quantization method in one run; prints JSON.

    python benchmarks/quantization.py                        # all methods on the embedded SmolLM2
    python benchmarks/quantization.py --methods none int4 awq --decode-tokens 16

AWQ and GPTQ checkpoints are written once by our quantizer into --work-dir and reused. Perplexity is
over the held-out text of server.quantize.evaluation (scored in fp32, as the tests do); decode speed is a
batch-1 greedy generation through LLMEngine in the serving dtype ("auto"), counted from the first
token to the last. The reference ("none") is the embedded model, itself dequantized Q4_1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import server  # noqa: F401  (applies server/cpu_env.py's CPU runtime settings before torch loads)

# isort: split
import torch

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.models.loader import load_model, resolve_model
from server.quant import quantized_layer_bytes
from server.quantize.evaluation import HELDOUT_TEXT, score_sequence, top1_agreement
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
PREQUANTIZED = {
    "awq": {"method": "awq", "awq_grid": 10},
    "gptq": {"method": "gptq", "sym": False, "act_order": True, "damp_percent": 0.1},
}


@dataclass(frozen=True)
class Row:
    method: str
    perplexity: float
    perplexity_ratio: float
    top1_agreement_256: float
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(ALL_METHODS), choices=ALL_METHODS)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/kubeinfer-quant-bench"))
    ap.add_argument("--calib-tokens", type=int, default=128, help="as the tests (see docs/quantization.md)")
    ap.add_argument("--eval-tokens", type=int, default=257)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    base_folder = resolve_model(None).folder
    ids = Tokenizer(base_folder).encode(HELDOUT_TEXT, add_special_tokens=False)[: args.eval_tokens]
    heldout = torch.tensor(ids, dtype=torch.int64)
    methods = list(dict.fromkeys(["none", *args.methods]))
    rows: list[Row] = []
    base_scores = None
    for method in methods:
        folder = (
            _checkpoint(method, args.work_dir, args.calib_tokens) if method in PREQUANTIZED else base_folder
        )
        flag = None if method in ("none", *PREQUANTIZED) else method
        loaded = load_model(folder, torch.float32, torch.device("cpu"), 1024, flag)
        scores = score_sequence(loaded.model, heldout)
        del loaded
        base_scores = base_scores or scores
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
        rows.append(
            Row(
                method=method,
                perplexity=round(scores.perplexity, 3),
                perplexity_ratio=round(scores.perplexity / base_scores.perplexity, 4),
                top1_agreement_256=round(top1_agreement(base_scores, scores, 256), 4),
                weight_bytes=llm.info.weight_bytes,
                quantized_layer_bytes=held,
                quantized_layer_ratio_vs_fp16=round(held / fp16, 4),
                decode_tokens_per_s=round(_decode_speed(llm, prompt, args.decode_tokens), 2),
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
                "results": [asdict(r) for r in rows],
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
