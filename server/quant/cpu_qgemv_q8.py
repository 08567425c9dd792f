"""Linear layers with int8 activations (csrc/qgemv_q8.cpp): llama.cpp's Q8 x Q4/Q8 dot products on our layout.

For M <= 4 rows of x (decode) and weights in 32-value groups (GGUF Q4_0 / Q4_1 / Q8_0, Q4_K repacked,
int4 with group 32: `BlockQuantWeight`, server/quant/cpu_qlinear.py) or 8-bit ones in 16-value groups
without min (Q6_K repacked: each half of a 32-block dotted on its own, `is_g16`), each row of x is quantized per
32-block to int8 with an fp32 scale (ggml's quantize_row_q8_1: d = max|x_b| / 127, q = round(x / d),
half to even, plus the block's d * sum(q) for the min and zero-point terms), and every block's dot
product runs on integers: AVX512-VNNI `vpdpbusd`, else AVX2 `vpmaddubsw`/`vpmaddwd`, else scalar C++,
chosen at run time from `usable_cpu_features()` (what the OS enabled, less KUBEINFER_CPU_DISABLE).

The result is W @ x^ with x^ = d * q the activation as quantized (`quantize_activations_reference`),
up to fp32 rounding: against fp32 activations it differs by at most sum_b (d_b / 2) sum_{k in b} |w_k|
per output (`activation_error_bound`: each value moves by at most half a step of its block).

Batched path: for M > MAX_ROWS rows (decode batches, prefill chunks) of 4- or 8-bit weights in 32-blocks
(Q4_0/Q4_1/Q4_K/int4 g32, Q8_0: the tied LM head of GGUF models), on
AVX512-VNNI only, for layers whose GEMMs run in reduced precision (gemm_dtype bf16 or int8: `--dtype auto` on
a CPU with native bf16, or with AVX512-VNNI but no native bf16; server/quant/gemm_dtype.py): x quantized the same way, W's nibbles and scales packed per
16-column group per call, `vpdpbusd` on 512-bit vectors. 1.3-1.9x the bf16 batched kernel and 1.3-1.45x
oneDNN's bf16 GEMM on a 2-core Zen 4 (docs/benchmarks.md "int8 activations for batches"); its error
against fp32 activations is the same bound as the GEMV's (~5e-3 relative on Gaussian x against bf16's
~2.4e-3).

Serving: `KUBEINFER_INT8_GEMV` (`1` on for every layer, `0` off; unset: on for layers computing in bf16
or int8 where AVX512-VNNI or AVX2 is usable, off elsewhere: `default_gemv_enabled`, docs/benchmarks.md "int8 activations", "AMX")
routes the decode GEMV of BlockQuantLinear and of the decode graph here, `KUBEINFER_INT8_GEMM` (default
on) the batches (`small_m_linear`, `BlockQuantLinear.int8_kernel`, `decode_qlinear_address`); what this
kernel does not take still goes to qlinear.cpp, the library's fallback (`Q8GemvKernel.supports` says which).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from server.config import default_cache_dir
from server.cpu_features import DISABLE_ENV, CpuFeatures
from server.cpu_features import int8_dot_path as path_for  # the path every int8 kernel shares
from server.native import KernelBuildError, NativeSource, env_switch, load_library, usable_cpu_features
from server.quant.cpu_qlinear import (
    BLOCK,
    INT8_ACTIVATION_DTYPES,
    BlockQuantWeight,
    KiQWeight,
    QLinearKernel,
    call_linear,
    check_linear_args,
    dequantize_reference,
    try_load_qlinear_kernel,
    weight_descriptor,
)

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "qgemv_q8.cpp"
ABI_VERSION = 6  # 2: the batched int8 path and kubeinfer_qgemv_q8_set_modes; 3: 8-bit W batched; 4: packed W
# 5: the GEMV takes 8-bit W in 16-value groups (Q6_K repacked); 6: compute COMPUTE_INT8 allows int8 as bf16 does
# No -ffast-math: the quantized activations must equal the torch reference's bit for bit.
NATIVE = NativeSource(
    "qgemv_q8", SOURCE, ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++20"), abi_version=ABI_VERSION
)
MAX_ROWS = 4  # qgemv_q8.cpp's MAX_ROWS: larger M goes to the fallback
PATHS = ("scalar", "avx2", "vnni")  # kubeinfer_qgemv_q8_set_path's 0, 1, 2
ENABLE_ENV = "KUBEINFER_INT8_GEMV"
GEMM_ENABLE_ENV = "KUBEINFER_INT8_GEMM"
# On: the batched int8 path (M > MAX_ROWS, AVX512-VNNI, 4/8-bit weights of layers computing in reduced
# precision) is 1.3-1.9x qlinear's bf16 batched path and oneDNN's bf16 GEMM here (docs/benchmarks.md).
GEMM_DEFAULT_ENABLED = True
# With AMX-BF16 usable, oneDNN's bf16 GEMM (dequantize + AMX tiles) overtakes the batched int8 path from
# ~256 rows (0.94-1.04x at 256, 0.5-0.8x at 512-2048; 1.1-2.4x the other way at 32-192 rows: 2-core Xeon
# with AMX, docs/benchmarks.md "AMX"): there the batched path takes up to this many rows and larger
# batches go to BlockQuantLinear's bf16 GEMM (its BF16_GEMM_MIN_ROWS is 256).
AMX_GEMM_MAX_ROWS = 255
PACK_ENABLE_ENV = "KUBEINFER_INT8_PACK"
# On by default: the batched path reads a packed copy of each weight (Q8GemvKernel.pack) made at load,
# instead of transposing 16 strided rows per 16 columns on every call: 1.3-1.4x at decode batches of 8-16
# rows (docs/benchmarks.md, "packed weights"). The copy costs about the quantized weights' bytes again, so
# by default it is made only while all copies fit in PACK_MEMORY_SHARE of the memory available at load.
PACK_MEMORY_SHARE = 0.25


# KUBEINFER_INT8_GEMV unset: the GEMV takes the decode rows of layers computing in bf16 or int8 where the vnni
# or the avx2 path runs (AVX512-VNNI: Intel Xeon with AMX, Ice Lake, AMD Zen 4+; AVX2: Zen 2/3, Haswell on).
# Served one-user decode 1.8x the fp32-activation GEMV on a Xeon with AMX (docs/benchmarks.md "AMX"); on a
# 2-core Zen 4 the embedded 135M model did not show it in served tok/s (overhead-bound), but a 1B model does:
# Llama-3.2-1B Q4_K_M decode steps 2.3x (the fp32 GEMV decodes nibbles to floats and is compute-bound at 3-11
# GB/s; the int8 one streams 14-24 GB/s a core, docs/benchmarks.md "one-user decode on k-quants"); with the
# kernels built for AVX2 only, one stream 2.0x (simulated on a Zen 5; the 135M model 1.01x: not measured on
# a real AVX2-only CPU). Layers computing in fp32 (--dtype float32, the parity tests) keep fp32 activations
# unless the switch says 1.
def default_gemv_enabled() -> bool:
    """Whether the GEMV is on (for bf16 and int8 layers) when KUBEINFER_INT8_GEMV is unset: the vnni or
    avx2 path running (`usable_cpu_features`: what the OS enables, minus KUBEINFER_CPU_DISABLE); False
    where the feature probe cannot be built. Cached per KUBEINFER_CPU_DISABLE value (it is asked per
    projection)."""
    return _gemv_default_for(os.environ.get(DISABLE_ENV, ""))


@functools.cache
def _gemv_default_for(disabled: str) -> bool:  # `disabled`: the cache key; the env var is read inside
    try:
        features = usable_cpu_features()
    except (KernelBuildError, OSError) as e:
        log.warning("CPU feature probe unavailable, the int8 GEMV stays off by default: %s", e)
        return False
    return path_for(features) in ("vnni", "avx2")


def gemm_max_rows_for(features: CpuFeatures) -> int | None:
    """The batched path's largest M: AMX_GEMM_MAX_ROWS where AMX-BF16 is usable (oneDNN's bf16 GEMM is
    faster from there), else no limit."""
    return AMX_GEMM_MAX_ROWS if features.amx_bf16 else None


def is_g16(w: BlockQuantWeight) -> bool:
    """8-bit values in 16-value groups without zero point or min (Q6_K as the loader repacks it): the
    GEMV's other layout (qgemv_q8.cpp's is_g16), x still quantized per 32-block."""
    k = w.in_features
    return (
        w.bits == 8
        and w.group_size == 16
        and k >= BLOCK
        and k % BLOCK == 0
        and w.mins is None
        and w.zero_point == 0
    )


# ------------------------------------------------------------------ torch references


def quantize_activations_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] fp32 (K % 32 == 0) -> (q [M, K] int8, d [M, K / 32] fp32): ggml's Q8 blocks, computed in
    the kernel's fp32 order (d = amax / 127, q = round_half_even(x * (1 / d)), q = 0 where d = 0)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).to(torch.int8).reshape(m, k)
    return q, d


def dequantize_activations_reference(x: Tensor) -> Tensor:
    """x [M, K] fp32 -> x^ [M, K] fp32 = d * q, the activation the kernel multiplies by."""
    q, d = quantize_activations_reference(x)
    m, k = x.shape
    return (q.float().reshape(m, k // BLOCK, BLOCK) * d[..., None]).reshape(m, k)


def linear_reference(x: Tensor, w: BlockQuantWeight, bias: Tensor | None = None) -> Tensor:
    """x [M, K] fp32 -> [M, N] fp32: W @ x^ in float64, rounded once (what the kernel computes up to fp32
    rounding)."""
    y = dequantize_activations_reference(x).double() @ dequantize_reference(w).double().t()
    return (y if bias is None else y + bias.double()).float()


def activation_error_bound(x: Tensor, w: BlockQuantWeight) -> Tensor:
    """[M, N] fp32: max |W @ x^ - W @ x| from rounding x to Q8: sum_b (d_b / 2) sum_{k in b} |W[n, k]|."""
    k = x.shape[1]
    _, d = quantize_activations_reference(x)  # [M, nb]
    wabs = dequantize_reference(w).abs().reshape(w.out_features, k // BLOCK, BLOCK).sum(-1)  # [N, nb]
    return (d.double() / 2) @ wabs.double().t()


# ------------------------------------------------------------------ the kernel


@dataclass(frozen=True)
class Q8GemvKernel:
    """The loaded library and the path it runs; `linear` is the checked launcher."""

    lib: ctypes.CDLL
    path: Path
    isa: str  # one of PATHS: the code path running here
    fallback: QLinearKernel  # serves what this kernel does not take; kept alive for the pointer
    # [gemv, gemm, gemv_fp32]: which calls it takes (set_modes; the C side's copy is what runs)
    modes: list[bool] = field(default_factory=lambda: [True, False, True])
    # the batched path's largest M from Python (AMX_GEMM_MAX_ROWS where AMX-BF16 is usable); the C entry
    # point has no such limit: the decode graph's batches stay below it (DecodeGraph.max_rows, 255 with bf16)
    gemm_max_rows: int | None = None

    def set_modes(self, gemv: bool, gemm: bool, gemv_fp32: bool = True) -> None:
        """Takes the GEMV (M <= MAX_ROWS; layers computing in fp32 too where `gemv_fp32`, else bf16 ones
        only) and/or the batched int8 path (M > MAX_ROWS: vnni, 4/8-bit W, compute bf16); everything else
        goes to the fallback. Process-wide: the engine's step thread calls it (through `active_kernel`)
        between kernel calls, with the values already set unless a switch changed."""
        # Always through to C: another instance over the same library may have set other modes.
        self.lib.kubeinfer_qgemv_q8_set_modes(int(gemv), int(gemm), int(gemv_fp32))
        self.modes[:] = [gemv, gemm, gemv_fp32]

    def supports(self, w: BlockQuantWeight, m: int, compute: torch.dtype = torch.float32) -> bool:
        """Whether `w` with `m` rows of x takes an int8 path (32-value groups; the GEMV for 1 <= m <=
        MAX_ROWS, the batched path for larger m with 4/8-bit W on the vnni path where `compute` is bf16 or
        int8; fp32 layers only the GEMV, and only where `gemv_fp32`): the C side's kubeinfer_qgemv_q8_supports,
        in Python (no ctypes call per projection)."""
        reduced = compute in INT8_ACTIVATION_DTYPES
        k = w.in_features
        if m <= MAX_ROWS and is_g16(w):
            return self.modes[0] and m >= 1 and (self.modes[2] or reduced)
        if k % BLOCK or w.group_size != BLOCK or w.groups != k // BLOCK:
            return False
        if m > MAX_ROWS:
            return (
                self.modes[1]
                and self.isa == "vnni"
                and w.bits in (4, 8)
                and reduced
                and (self.gemm_max_rows is None or m <= self.gemm_max_rows)
            )
        return self.modes[0] and m >= 1 and (self.modes[2] or reduced)

    def linear(
        self,
        x: Tensor,  # [M, K] fp32, unit stride along K
        w: BlockQuantWeight,  # group_size 32
        bias: Tensor | None = None,  # [N] fp32 contiguous
        out: Tensor | None = None,  # [M, N] fp32, unit stride along N
        compute: torch.dtype = torch.float32,  # the layer's gemm_dtype: bf16 or int8 admit the batched path
    ) -> Tensor:  # [M, N] fp32: W @ x^ (+ bias)
        """Raises TypeError/ValueError for a tensor or a call the kernel cannot take (never the fallback
        here: `supports` says which)."""
        x, out = check_linear_args(x, w, bias, out)
        m = x.shape[0]
        if not self.supports(w, m, compute):
            raise ValueError(
                f"int8 activations take 32-value groups, 1..{MAX_ROWS} rows (GEMV, when on) or more rows of "
                f"4/8-bit weights in reduced precision on AVX512-VNNI (batched, when on, up to "
                f"{self.gemm_max_rows or 'any number of'} rows); got M={m}, {w.fmt} group_size {w.group_size}, "
                f"compute {compute}, path {self.isa}, modes {self.modes}"
            )
        return call_linear(self.lib.kubeinfer_qgemv_q8, "qgemv_q8", x, w, bias, out, compute)

    def packed_bytes(self, w: BlockQuantWeight) -> int:
        """Bytes of `w`'s packed copy for the batched path (kubeinfer_qgemv_q8_packed_bytes), 0 when the
        batched path cannot take `w` here (not 4/8-bit in 32-value groups, or not the vnni path)."""
        return int(self.lib.kubeinfer_qgemv_q8_packed_bytes(ctypes.byref(weight_descriptor(w))))

    def pack(self, w: BlockQuantWeight) -> BlockQuantWeight:
        """`w` with its packed copy (`packed`, about w.nbytes() more: the same bytes of W, scales and offsets
        in fp32) for the batched path, which then reads one contiguous stream per 16 columns instead of
        transposing 16 rows on every call; `w` itself (already packed, or not packable here: packed_bytes 0).
        The copy is derived from w's tensors at this call: changing them afterwards leaves it stale."""
        size = 0 if w.packed is not None else self.packed_bytes(w)
        if size == 0:
            return w
        out = torch.empty(size + 64, dtype=torch.uint8)
        offset = (-out.data_ptr()) % 64  # 64-byte aligned: whole cache lines per block
        out = out[offset : offset + size]
        rc = self.lib.kubeinfer_qgemv_q8_pack(
            ctypes.byref(weight_descriptor(w)), out.data_ptr(), torch.get_num_threads()
        )
        if rc != 0:
            raise RuntimeError(f"qgemv_q8 pack returned {rc} for {w.fmt} [{w.out_features}, {w.in_features}]")
        return dataclasses.replace(w, packed=out)

    def set_path(self, name: str) -> str:
        """Runs path `name` (lowered to what the CPU reports); returns the path now in use. Process-wide:
        for tests and benchmarks, never while another thread runs the kernel."""
        got = int(self.lib.kubeinfer_qgemv_q8_set_path(PATHS.index(name)))
        return PATHS[got]

    @property
    def entry_address(self) -> int:
        """kubeinfer_qgemv_q8, qlinear's signature: what the decode graph calls for every projection."""
        address = ctypes.cast(self.lib.kubeinfer_qgemv_q8, ctypes.c_void_p).value
        assert address is not None
        return int(address)


@functools.cache
def load_q8_gemv_kernel(fallback: QLinearKernel, cache_dir: Path | None = None) -> Q8GemvKernel:
    """Builds (or finds) and loads the kernel, its path set from the usable CPU features and its fallback
    to `fallback`'s kubeinfer_qlinear; raises KernelBuildError if it cannot be built."""
    lib, path = load_library(NATIVE, cache_dir or default_cache_dir())
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    lib.kubeinfer_qgemv_q8.restype = i32
    lib.kubeinfer_qgemv_q8.argtypes = [ctypes.POINTER(KiQWeight), ptr, i64, i64, ptr, ptr, i64, i32]
    lib.kubeinfer_qgemv_q8_supports.restype = i32
    lib.kubeinfer_qgemv_q8_supports.argtypes = [ctypes.POINTER(KiQWeight), i64]
    lib.kubeinfer_qgemv_q8_set_path.restype = i32
    lib.kubeinfer_qgemv_q8_set_path.argtypes = [i32]
    lib.kubeinfer_qgemv_q8_set_modes.restype = None
    lib.kubeinfer_qgemv_q8_set_modes.argtypes = [i32, i32, i32]
    lib.kubeinfer_qgemv_q8_packed_bytes.restype = i64
    lib.kubeinfer_qgemv_q8_packed_bytes.argtypes = [ctypes.POINTER(KiQWeight)]
    lib.kubeinfer_qgemv_q8_pack.restype = i32
    lib.kubeinfer_qgemv_q8_pack.argtypes = [ctypes.POINTER(KiQWeight), ptr, i32]
    lib.kubeinfer_qgemv_q8_set_fallback.restype = None
    lib.kubeinfer_qgemv_q8_set_fallback.argtypes = [ptr]
    lib.kubeinfer_qgemv_q8_set_fallback(ctypes.cast(fallback.lib.kubeinfer_qlinear, ctypes.c_void_p).value)
    features = usable_cpu_features(cache_dir)
    isa = PATHS[int(lib.kubeinfer_qgemv_q8_set_path(PATHS.index(path_for(features))))]
    return Q8GemvKernel(lib, path, isa, fallback, gemm_max_rows=gemm_max_rows_for(features))


def try_load_q8_gemv_kernel(fallback: QLinearKernel, cache_dir: Path | None = None) -> Q8GemvKernel | None:
    """The kernel, or None (logged once) when it cannot be built: qlinear's fp32 GEMV then serves."""
    try:
        return load_q8_gemv_kernel(fallback, cache_dir)
    except (KernelBuildError, OSError) as e:
        _warn_once(str(e))
        return None


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("int8-activation GEMV unavailable, decode runs the fp32-activation kernel: %s", reason)


# ------------------------------------------------------------------ the switch and the hooks

_override: bool | None = None


def _switch(override: bool | None, env: str) -> bool | None:
    """`override` (an `int8_gemv(...)`/`int8_gemm(...)` block), else the env var `env` (`1`/`0`), else None
    (unset). Raises ValueError for another value."""
    return override if override is not None else env_switch(env)


def _gemv_explicit() -> bool | None:
    """`int8_gemv(...)`'s override, else KUBEINFER_INT8_GEMV, else None (unset)."""
    return _switch(_override, ENABLE_ENV)


def int8_gemv_enabled() -> bool:
    """KUBEINFER_INT8_GEMV (`1`/`0`; unset: `default_gemv_enabled()`, for bf16 and int8 layers only), unless
    `int8_gemv(...)` overrides it. Raises ValueError for another value."""
    explicit = _gemv_explicit()
    return default_gemv_enabled() if explicit is None else explicit


@contextlib.contextmanager
def int8_gemv(enabled: bool) -> Iterator[None]:
    """Within this block the decode GEMV runs with int8 activations (True) or fp32 ones (False), whatever
    the environment says: for benchmarks and tests comparing both in one process. A decode graph
    records the kernel when it is built: rebuild it (a new model) after switching."""
    global _override
    saved, _override = _override, enabled
    try:
        yield
    finally:
        _override = saved


_gemm_override: bool | None = None


def int8_gemm_enabled() -> bool:
    """KUBEINFER_INT8_GEMM (`1`/`0`, default GEMM_DEFAULT_ENABLED), unless `int8_gemm(...)` overrides it.
    Raises ValueError for another value."""
    explicit = _switch(_gemm_override, GEMM_ENABLE_ENV)
    return GEMM_DEFAULT_ENABLED if explicit is None else explicit


def int8_pack_switch() -> bool | None:
    """KUBEINFER_INT8_PACK: True (`1`, pack whatever the memory), False (`0`, never), None (unset: pack
    what fits in PACK_MEMORY_SHARE of the available memory). Raises ValueError for another value."""
    return _switch(None, PACK_ENABLE_ENV)


@contextlib.contextmanager
def int8_gemm(enabled: bool) -> Iterator[None]:
    """Within this block batches of more than MAX_ROWS rows take the batched int8 path where it applies
    (True) or not (False), whatever the environment says; a decode graph built before keeps its choice."""
    global _gemm_override
    saved, _gemm_override = _gemm_override, enabled
    try:
        yield
    finally:
        _gemm_override = saved


def active_kernel(kernel: QLinearKernel) -> Q8GemvKernel | None:
    """The int8 kernel, its modes set from the two switches, when either is on and it can be built;
    else None."""
    explicit = _gemv_explicit()  # read once: this runs per projection call
    gemv = default_gemv_enabled() if explicit is None else explicit
    gemm = int8_gemm_enabled()
    if not (gemv or gemm):
        return None
    q8 = try_load_q8_gemv_kernel(kernel)
    if q8 is not None:  # the GEMV by default (switch unset) only for bf16 and int8 layers
        q8.set_modes(gemv, gemm, gemv_fp32=explicit is not None)
    return q8


def batches_take_any_rows(kernel: QLinearKernel) -> bool:
    """Whether the batched int8 path takes bf16 (and int8) layers' batches of any row count here: its switch on
    (KUBEINFER_INT8_GEMM), the kernel built, the vnni path running and no row limit (AMX-BF16 sets one,
    gemm_max_rows_for). Reads no more than the switch and the cached kernel: asked per projection call."""
    if not int8_gemm_enabled():
        return False
    q8 = try_load_q8_gemv_kernel(kernel)
    return q8 is not None and q8.isa == "vnni" and q8.gemm_max_rows is None


def int8_paths_text(cache_dir: Path | None = None) -> str:
    """What takes int8 activations here, for the start-up log ("" when nothing does): bf16 and int8 layers' batches
    (the switch on, the kernels built, AVX512-VNNI usable; at most gemm_max_rows rows) and the decode GEMV."""
    kernel = try_load_qlinear_kernel(cache_dir)
    q8 = None if kernel is None else active_kernel(kernel)
    if q8 is None:
        return ""
    parts = []
    if int8_gemm_enabled() and q8.isa == "vnni":
        rows = "5+" if q8.gemm_max_rows is None else f"5-{q8.gemm_max_rows}"
        parts.append(f"batches of {rows} rows of 4/8-bit weights ({GEMM_ENABLE_ENV}=0 keeps bf16 or fp32)")
    if int8_gemv_enabled():
        layers = "every layer's" if _gemv_explicit() else "bf16 and int8 layers'"
        parts.append(f"{layers} decode rows 1-{MAX_ROWS} ({ENABLE_ENV}=0 keeps fp32)")
    return "; ".join(parts)


def small_m_linear(
    kernel: QLinearKernel,
    x: Tensor,
    w: BlockQuantWeight,
    bias: Tensor | None,
    compute: torch.dtype = torch.float32,  # the layer's gemm_dtype: bf16 lets qlinear's batched path run in bf16
) -> Tensor:
    """BlockQuantLinear's kernel call for M < its gemm_min_rows: the int8 GEMV where the switch is on and
    it takes (w, M), else qlinear's; the same choice as the decode graph's entry point makes in C++."""
    q8 = active_kernel(kernel)
    if q8 is not None and q8.supports(w, x.shape[0], compute):
        return q8.linear(x, w, bias, compute=compute)
    return kernel.linear(x, w, bias, compute=compute)


@dataclass(frozen=True)
class DecodeEntry:
    """The projection entry point a decode graph records, with the int8 library's modes at that moment:
    the graph restores them before each replay (the C side's modes are process-wide, and `int8_gemv(...)`
    or `int8_gemm(...)` may have changed them since)."""

    address: int  # kubeinfer_qgemv_q8 or qlinear's kubeinfer_qlinear
    q8: Q8GemvKernel | None
    modes: tuple[bool, bool, bool]  # (gemv, gemm, gemv_fp32) as recorded; unused without q8

    def restore(self) -> None:
        # Always through to C (one ctypes call per step): another instance over the same library may have
        # set other modes without this one's Python copy knowing.
        if self.q8 is not None:
            self.q8.set_modes(*self.modes)


def decode_entry(kernel: QLinearKernel) -> DecodeEntry:
    """The entry point for the decode graph: kubeinfer_qgemv_q8 (which hands what it does not take to
    `kernel`) when either switch is on, else `kernel`'s kubeinfer_qlinear; with the modes set now."""
    q8 = active_kernel(kernel)
    if q8 is not None:
        gemv, gemm, gemv_fp32 = q8.modes
        return DecodeEntry(q8.entry_address, q8, (gemv, gemm, gemv_fp32))
    address = ctypes.cast(kernel.lib.kubeinfer_qlinear, ctypes.c_void_p).value
    assert address is not None
    return DecodeEntry(int(address), None, (False, False, False))


def decode_qlinear_address(kernel: QLinearKernel) -> int:
    """`decode_entry(kernel).address`."""
    return decode_entry(kernel).address
