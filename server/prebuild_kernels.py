"""`python -m server.prebuild_kernels FOLDER`: builds every C++ kernel for every x86-64 level into FOLDER.

An image's build step (Dockerfile.server): the image then sets KUBEINFER_PREBUILT_KERNELS=FOLDER and
serves without a compiler, choosing the level at run time (server/native.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from server.attention.cpu_kernel import NATIVE as PAGED_DECODE
from server.models.cpu_bf16_gemm import NATIVE as BF16_GEMM
from server.models.cpu_fused import NATIVE as CPU_FUSED
from server.models.moe.native import NATIVE as MOE_EXPERTS
from server.native import PROBE, KernelBuildError, prebuild
from server.quant.cpu_fp8 import NATIVE as FP8
from server.quant.cpu_mxfp4 import NATIVE as MXFP4
from server.quant.cpu_qgemv_q8 import NATIVE as QGEMV_Q8
from server.quant.cpu_qk_native import NATIVE as QK_NATIVE
from server.quant.cpu_qlinear import NATIVE as QLINEAR
from server.worker.cpu_sampling import NATIVE as SAMPLING

# the CPU probe first: choosing a level at run time needs it (built once, for any x86-64 CPU)
SOURCES = (
    PROBE,
    PAGED_DECODE,
    CPU_FUSED,
    QLINEAR,
    QGEMV_Q8,
    MXFP4,
    FP8,
    MOE_EXPERTS,
    QK_NATIVE,
    BF16_GEMM,
    SAMPLING,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.prebuild_kernels", description=__doc__)
    parser.add_argument("folder", type=Path, help="where the libraries go (<folder>/<level>/<name>-<key>.so)")
    args = parser.parse_args(argv)
    try:
        built = prebuild(SOURCES, args.folder)
    except KernelBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in built:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
