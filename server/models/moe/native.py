"""The fused routed-experts call on CPU (csrc/moe_experts.cpp): one native call per MoE block and step.

It takes the routing (ids and weights per token), groups the token-expert pairs by expert, and runs each
active expert's gate/up GEMM, activation and down GEMM over its tokens, summing the weighted outputs per
token; the GEMMs go through the projection entry point the rest of the model calls
(`server.quant.cpu_qgemv_q8.decode_entry`: the int8 GEMV where its switch is on, else qlinear's kernel)
with each expert's `KiQWeight` descriptor (`cpu_qlinear.weight_descriptor`), or MXFP4's kernel
(`server/quant/cpu_mxfp4.py`) over the packed bytes. `FusedExpertsCall` holds a block's descriptors,
built once; `KUBEINFER_MOE_FUSED=0` keeps the per-expert torch loop (FusedMoE._grouped), for A/B runs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from server.config import default_cache_dir
from server.native import KernelBuildError, NativeSource, env_switch, load_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "moe_experts.cpp"
ABI_VERSION = 3  # 2: the packed copies' group strides (w13/w2_packed_group_bytes), task_rows; 3: batch_tokens
# -ffp-contract=off: out += y * w rounds the product first, as the torch path's `ys *= w; index_add_`.
NATIVE = NativeSource(
    "moe_experts",
    SOURCE,
    ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++20", "-ffp-contract=off"),
    abi_version=ABI_VERSION,
)
ENABLE_ENV = "KUBEINFER_MOE_FUSED"
KIND_QLINEAR, KIND_MXFP4 = 0, 1
ACTIVATIONS = {"silu": 0, "swigluoai": 1}


class KiMoeExperts(ctypes.Structure):
    """struct KiMoeExperts in csrc/moe_experts.cpp."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("activation", ctypes.c_int32),
        ("swiglu_alpha", ctypes.c_float),
        ("swiglu_limit", ctypes.c_float),
        ("num_experts", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("w13", ctypes.c_void_p),
        ("w13_scales", ctypes.c_void_p),
        ("w2", ctypes.c_void_p),
        ("w2_scales", ctypes.c_void_p),
        ("desc_bytes", ctypes.c_int64),
        ("b13", ctypes.c_void_p),
        ("b2", ctypes.c_void_p),
        ("qlinear", ctypes.c_void_p),
        ("mxfp4", ctypes.c_void_p),
        ("w13_packed_group_bytes", ctypes.c_int64),
        ("w2_packed_group_bytes", ctypes.c_int64),
        ("task_rows", ctypes.c_int64),  # rows of W per task, a multiple of 96; 0: the library's choice
        ("batch_tokens", ctypes.c_int64),  # tokens per batch at most; 0: the library's (its 64 MiB scratch)
    ]


def fused_enabled() -> bool:
    """KUBEINFER_MOE_FUSED: `1` (default) runs the fused call where the experts allow it, `0` the torch
    loop. Raises ValueError for another value. Read per call (tests and benchmarks switch it)."""
    return env_switch(ENABLE_ENV) is not False


@dataclass(frozen=True)
class MoeExpertsKernel:
    lib: ctypes.CDLL
    path: Path


@functools.cache
def load_moe_experts_kernel(cache_dir: Path | None = None) -> MoeExpertsKernel:
    """Builds (or finds) and loads the library; raises KernelBuildError if it cannot be built."""
    lib, path = load_library(NATIVE, cache_dir or default_cache_dir())
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    lib.kubeinfer_moe_experts.restype = i32
    lib.kubeinfer_moe_experts.argtypes = [
        ctypes.POINTER(KiMoeExperts),
        ptr,
        i64,
        i64,
        ptr,
        ptr,
        i64,
        ptr,
        i32,
    ]
    return MoeExpertsKernel(lib, path)


def try_load_moe_experts_kernel(cache_dir: Path | None = None) -> MoeExpertsKernel | None:
    """The library, or None (logged once) when it cannot be built: the per-expert torch loop serves."""
    try:
        return load_moe_experts_kernel(cache_dir)
    except (KernelBuildError, OSError) as e:
        _warn_once(str(e))
        return None


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("fused MoE experts call unavailable, experts run one torch call each: %s", reason)


class FusedExpertsCall:
    """A block's experts as the native call sees them; `run` is the checked launcher.

    `keep` holds every tensor the descriptors point into (and the descriptors themselves): the struct
    holds raw pointers, so the call must not outlive them. Built by the ExpertGemms implementations
    (BlockQuantExperts.fused_call, Mxfp4Experts.fused_call)."""

    def __init__(
        self,
        kernel: MoeExpertsKernel,
        spec: KiMoeExperts,
        keep: Sequence[object],
    ) -> None:
        self.kernel = kernel
        self.spec = spec
        self.keep = tuple(keep)

    def run(
        self,
        x: Tensor,  # [T, H] fp32, unit stride along H
        ids: Tensor,  # [T, top_k] int64, each in [0, E)
        weights: Tensor,  # [T, top_k] fp32
        entry: int = 0,  # the qlinear-signature entry point (kind qlinear); MXFP4's is in the spec
    ) -> Tensor:  # [T, H] fp32: the weighted sum of each token's chosen experts' outputs
        """Raises ValueError for shapes or dtypes the call cannot take, RuntimeError when the native
        call fails (its return code)."""
        s = self.spec
        t = x.shape[0]
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != s.hidden or (t > 1 and x.stride(1) != 1):
            raise ValueError(
                f"x must be [T, {s.hidden}] fp32 with unit stride, got {x.dtype} {tuple(x.shape)}"
            )
        if ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[0] != t:
            raise ValueError(f"ids must be [{t}, top_k] int64, got {ids.dtype} {tuple(ids.shape)}")
        if weights.dtype != torch.float32 or tuple(weights.shape) != tuple(ids.shape):
            raise ValueError(
                f"weights must be {tuple(ids.shape)} fp32, got {weights.dtype} {tuple(weights.shape)}"
            )
        if x.stride(1) != 1:
            x = x.contiguous()
        ids, weights = ids.contiguous(), weights.contiguous()
        out = torch.empty(t, s.hidden, dtype=torch.float32)
        if t == 0:
            return out
        if s.kind == KIND_QLINEAR:
            s.qlinear = entry
        rc = self.kernel.lib.kubeinfer_moe_experts(
            ctypes.byref(s),
            x.data_ptr(),
            t,
            max(x.stride(0), s.hidden),  # one row: its stride is arbitrary
            ids.data_ptr(),
            weights.data_ptr(),
            ids.shape[1],
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"moe_experts returned {rc} for x {tuple(x.shape)}, ids {tuple(ids.shape)}")
        return out


def descriptor_array(descs: Sequence[ctypes.Structure]) -> ctypes.Array[ctypes.Structure]:
    """The descriptors as one C array (consecutive, `ctypes.sizeof` apart)."""
    kind = type(descs[0])
    return (kind * len(descs))(*descs)
