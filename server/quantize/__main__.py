"""python -m server.quantize --method awq|gptq|rtn [--model M] --out DIR"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m server.quantize",
        description="Write an AWQ (GEMM) or GPTQ (v1) 4-bit checkpoint from a full-precision model.",
    )
    parser.add_argument(
        "--method",
        required=True,
        choices=("awq", "gptq", "rtn"),
        help="awq: activation-aware scales + clipping; gptq: Hessian error compensation; "
        "rtn: plain round-to-nearest in the AWQ layout (a baseline)",
    )
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        choices=(32, 64, 128),
        help="default: 128 if it divides every in_features, else 64, else 32",
    )
    parser.add_argument(
        "--sym", action="store_true", help="gptq: symmetric (zero 8) instead of asymmetric zero points"
    )
    parser.add_argument(
        "--act-order", action="store_true", help="gptq: desc_act (quantize columns by Hessian diagonal)"
    )
    parser.add_argument("--calib-tokens", type=int, default=512, help="calibration tokens (default 512)")
    parser.add_argument("--damp-percent", type=float, default=0.1, help="gptq: Hessian damping (default 0.1)")
    parser.add_argument("--awq-grid", type=int, default=20, help="awq: scale exponents tried (default 20)")
    parser.add_argument("--no-clip", action="store_true", help="awq: skip the clipping search")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from server.quantize import QuantizeOptions, quantize_model

    try:
        opts = QuantizeOptions(
            method=args.method,
            group_size=args.group_size,
            sym=args.sym,
            act_order=args.act_order,
            calib_tokens=args.calib_tokens,
            damp_percent=args.damp_percent,
            awq_clip=not args.no_clip,
            awq_grid=args.awq_grid,
        )
        result = quantize_model(args.model, args.out, opts)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        json.dumps(
            {
                "out": str(result.out),
                "method": result.method,
                "group_size": result.group_size,
                "calib_tokens": result.calib_tokens,
                "seconds": round(result.seconds, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
